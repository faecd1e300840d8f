"""`FP8LinearFunction`: the autograd Function of an FP8 linear layer, shared by every module of `scalestate.nn`.

Its forward multiplies operands already cast to FP8; its backward casts the
output gradient through a caller's function and runs both gradient products
in FP8. :func:`scalestate.nn.linear` calls it on whole tensors, and
:func:`scalestate.nn.tensor_parallel.linear` on the local shards of DTensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.quantized import Quantized

__all__ = [
    "FP8LinearFunction", "GradCaster", "backward_products", "forward_product", "keep_saved_input", "linear_backward",
    "linear_forward", "product", "saved_operands",
]


#: Casts the output gradient: ``cast_grad(dy, transpose) -> Quantized``.
GradCaster = Callable[[Tensor, bool], Quantized]


class FP8LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with x and w already cast; backward casts ``dy`` with
    ``cast_grad`` and runs both of its products in FP8. Only FP8 tensors (and their
    scales) are saved. ``add_bias=False`` leaves the bias out of this rank's output
    (a partial sum that another rank adds it to) while still giving it its gradient.
    ``weight_transposed=True``: the ``weight`` parameter is stored ``(in, out)`` (``qw``
    is still its cast in the ``(out, in)`` orientation); its gradient is returned transposed."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        qx: Quantized,
        qw: Quantized,
        cast_grad: GradCaster,
        backend: Backend,
        out_dtype: torch.dtype,
        add_bias: bool = True,
        weight_transposed: bool = False,
    ) -> Tensor:
        ctx.cast_grad = cast_grad
        return linear_forward(ctx, x, weight, bias, qx, qw, backend, out_dtype, add_bias, weight_transposed)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return *linear_backward(ctx, grad_out, ctx.cast_grad), None, None, None, None, None, None, None


def linear_forward(
    ctx: Any,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    qx: Quantized,
    qw: Quantized,
    backend: Backend,
    out_dtype: torch.dtype,
    add_bias: bool = True,
    weight_transposed: bool = False,
) -> Tensor:
    """The forward of an FP8 linear Function (see :class:`FP8LinearFunction`): the product, and on ``ctx``
    what :func:`linear_backward` needs (the FP8 operands, saved; the backend; the dtypes)."""
    ctx.weight_transposed = weight_transposed
    _keep(backend, qw)  # the weight's cast serves this product and the input gradient's
    out, x_saved, w_saved, ctx.x_is_transposed = forward_product(
        backend, qx, qw, out_dtype, bias if add_bias else None
    )
    x_tensors, ctx.x_layout = x_saved.flatten()
    w_tensors, ctx.w_layout = w_saved.flatten()
    ctx.n_x = len(x_tensors)
    ctx.save_for_backward(*x_tensors, *w_tensors)
    ctx.backend = backend
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    return out


def linear_backward(ctx: Any, grad_out: Tensor, cast_grad: GradCaster) -> tuple[Tensor | None, ...]:
    """The input, weight and bias gradients of an FP8 linear Function whose forward was
    :func:`linear_forward`, the output gradient cast by ``cast_grad``."""
    # Row-major, whatever its layout: a sum over another layout (the bias gradient) adds in another
    # order, and compiled code, where AOT autograd makes the gradients of a graph's outputs contiguous
    # but a gradient produced inside the graph may be laid out otherwise, would differ from eager.
    grad_out = grad_out.contiguous()
    saved = ctx.saved_tensors
    qx = Quantized.unflatten(saved[: ctx.n_x], ctx.x_layout)
    qw = Quantized.unflatten(saved[ctx.n_x :], ctx.w_layout)
    backend: Backend = ctx.backend
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = grad_w = grad_b = None
    if need_x or need_w:
        qg = cast_grad(grad_out, ctx.x_is_transposed)
        if need_x and need_w:
            _keep(backend, qg, brief=True)  # both products take it, in this backward
        grad_x, grad_w = backward_products(
            backend, qg, qx, qw, ctx.x_is_transposed, (x_dtype if need_x else None, w_dtype if need_w else None)
        )
    if need_b:
        grad_b = grad_out.sum(0, dtype=torch.float32).to(b_dtype)
    if grad_w is not None and ctx.weight_transposed:
        grad_w = grad_w.t()  # the same values, in the parameter's (in, out) layout
    return grad_x, grad_w, grad_b


def _keep(backend: Backend, q: Quantized, brief: bool = False) -> None:
    """Tell a backend that dequantizes its operands (the emulation) that several products take ``q``
    (with ``brief``, products that run next: see ``EmulationBackend.keep_dequantized``)."""
    keep = getattr(backend, "keep_dequantized", None)
    if keep is not None:
        keep(q, brief=brief)


def keep_saved_input(backend: Backend, qx: Quantized, weight: Tensor) -> None:
    """Before a layer's :class:`FP8LinearFunction`: where autograd records it and the weight gradient's
    product will take ``qx`` again, tell a backend that dequantizes its operands (the emulation) to keep
    ``qx``'s dequantization until then (see ``EmulationBackend.keep_saved``)."""
    keep = getattr(backend, "keep_saved", None)
    if keep is not None and weight.requires_grad and torch.is_grad_enabled():
        keep(qx)


def forward_product(
    backend: Backend, qx: Quantized, qw: Quantized, out_dtype: torch.dtype, bias: Tensor | None
) -> tuple[Tensor, Quantized, Quantized, bool]:
    """``x @ w.T + bias`` from the casts: ``(out, x_saved, w_saved, x_is_transposed)``, where the
    saved operands are what the backward products need, and ``x_is_transposed`` says whether
    ``x_saved`` is ``x.t()`` (the gradient cast then makes the other layout too)."""
    if qx.tile is not None:
        # Each product takes its operands scaled along its own contraction axis:
        # x and w along in_features here; w along out_features and x along tokens later.
        out = product(backend, qx.rowwise(), qw.rowwise().t(), out_dtype, bias)
    else:
        out = product(backend, qx, qw.t(), out_dtype, bias)
    return (out, *saved_operands(qx, qw))


def saved_operands(qx: Quantized, qw: Quantized) -> tuple[Quantized, Quantized, bool]:
    """What :func:`forward_product` keeps of the casts for the backward products: ``(x_saved, w_saved,
    x_is_transposed)``."""
    if qx.tile is not None:
        return qx.columnwise(), qw, True  # backward needs x only along tokens
    # The weight-gradient product needs x in the other layout: keep only that copy when the cast made it.
    x_saved = qx if qx.other is None else Quantized.of(qx.other)
    return x_saved, qw, qx.transposed is not None


def backward_products(
    backend: Backend,
    qg: Quantized,
    qx: Quantized,
    qw: Quantized,
    x_is_transposed: bool,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
) -> tuple[Tensor | None, Tensor | None]:
    """The input and weight gradients from the cast output gradient and the saved operands of
    :func:`forward_product`; ``dtypes`` gives each one's dtype, ``None`` for a gradient not needed."""
    x_dtype, w_dtype = dtypes
    grad_x = grad_w = None
    if qx.tile is not None:
        if x_dtype is not None:  # dy @ w: both along out_features
            grad_x = product(backend, qg.rowwise(), qw.columnwise().t(), x_dtype)
        if w_dtype is not None:  # dy.T @ x: both along tokens (qx is x.t() cast along its rows)
            grad_w = product(backend, qg.columnwise(), qx.t(), w_dtype)
        return grad_x, grad_w
    if x_dtype is not None:
        grad_x = product(backend, qg, qw, x_dtype)
    if w_dtype is not None:
        grad_w = product(backend, qg.t(), qx.t() if x_is_transposed else qx, w_dtype)
    return grad_x, grad_w


def product(
    backend: Backend, a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """The backend's FP8 product, with autocast off (the operands are FP8 and accumulate in
    float32); the autocast context is entered only where autocast is on, as it costs microseconds."""
    device_type = a.data.device.type
    if not torch.is_autocast_enabled(device_type):
        return backend.scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
    with torch.autocast(device_type, enabled=False):
        return backend.scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
