"""Compiled grouped layers of a fine-grained recipe with the group sizes on the device.

A fine-grained cast scales each row, tile, block or MX block from its own
elements. Along the tokens (the weight gradient's contraction axis) the
blocks start at each expert's first token, so they depend on where the
groups begin: a cast of all rows at once would not give the bits of one cast
per expert. Here each expert's casts and products run inside two operators
of their own (``scalestate::fine_grouped_forward`` and
``scalestate::fine_grouped_backward``), opaque to the compiler, which read
the group ends on the host when they run and call, expert by expert, the
very casts and products eager code calls. Compiled code keeps the sizes on
the device, one graph serves every routing, and the bits are eager's:
outputs, gradients, and each expert's amaxes, which the operators return
(``[E]`` tensors) and the traced code records for the experts with tokens.

The cost: backward casts each expert's input and weight again (the same bits
as the forward's casts), so the input is saved in its own precision, not in
FP8. Taken for the emulation backend's products, every fine-grained recipe
but NVFP4 (whose casts draw on the manager's random state), without
``collect_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scalestate.backends.base import Backend, CastSpec
from scalestate.finegrained import quantize as fine_quantize
from scalestate.granularity import Granularity, GranularityKind
from scalestate.nn.function import backward_products, forward_product
from scalestate.quantized import Quantized

__all__ = ["DeviceFineGroupedFunction", "describe_cast", "fine_grouped_backward", "fine_grouped_forward"]

#: The products: the emulation backend's (stateless but for a table cache), made at the first call.
_products: list[Backend] = []


def _backend() -> Backend:
    """The emulation backend, imported when a product first runs (importing scalestate loads no backend)."""
    if not _products:
        from scalestate.backends.emulation import EmulationBackend

        _products.append(EmulationBackend())
    return _products[0]


def describe_cast(spec: CastSpec) -> str:
    """A fine-grained spec as the operators take it: ``"<dtype>:<kind>:<block>:<power_of_2>"``."""
    granularity = spec.granularity
    assert granularity is not None
    kind = GranularityKind(granularity.kind).value
    return f"{str(spec.dtype).removeprefix('torch.')}:{kind}:{granularity.block}:{int(granularity.power_of_2)}"


def _cast(x: Tensor, description: str) -> tuple[Quantized, Tensor]:
    """The fine-grained cast eager code makes of ``x`` (both orientations) and its amax."""
    dtype, kind, block, power_of_2 = description.split(":")
    granularity = Granularity(GranularityKind(kind), int(block), power_of_2 == "1")
    fq = fine_quantize(x, getattr(torch, dtype), granularity, columnwise=True)
    return fq.quantized, fq.amax


def _groups(offsets: Tensor) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of each group with rows (``offsets``: ``[G]`` ends, read on the host)."""
    ends: list[int] = offsets.tolist()
    return [(g, s, e) for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends, strict=True)) if e > s]


@torch.library.custom_op("scalestate::fine_grouped_forward", mutates_args=())
def fine_grouped_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, offsets: Tensor, x_cast: str, w_cast: str, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Each expert's ``x_e @ weight[e].T + bias[e]`` from its own fine-grained casts, as eager grouped
    layers make them: ``(out, x_amax, w_amax)``, with the ``[E]`` amaxes of each expert's input and
    weight casts (0 for an expert with no rows)."""
    n = offsets.shape[0]
    amax_x = x.new_zeros(n, dtype=torch.float32)
    amax_w = x.new_zeros(n, dtype=torch.float32)
    outs = []
    for g, s, e in _groups(offsets):
        qx, amax_x[g] = _cast(x[s:e], x_cast)
        qw, amax_w[g] = _cast(weight[g], w_cast)
        outs.append(forward_product(_backend(), qx, qw, out_dtype, None if bias is None else bias[g])[0])
    if not outs:
        return x.new_zeros((x.shape[0], weight.shape[1]), dtype=out_dtype), amax_x, amax_w
    return torch.cat(outs), amax_x, amax_w


@fine_grouped_forward.register_fake
def _(
    x: Tensor, weight: Tensor, bias: Tensor | None, offsets: Tensor, x_cast: str, w_cast: str, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    n = offsets.shape[0]
    amax = x.new_empty(n, dtype=torch.float32)
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=out_dtype), amax, torch.empty_like(amax)


@torch.library.custom_op("scalestate::fine_grouped_backward", mutates_args=())
def fine_grouped_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    x_cast: str,
    w_cast: str,
    g_cast: str,
    need_x: bool,
    need_w: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each expert's input and weight gradients from its own fine-grained casts (of the input, the weight
    and the output gradient), as eager grouped layers compute them: ``(grad_x, grad_w, g_amax)``;
    ``grad_x`` (``x``'s dtype) and ``grad_w`` (``weight``'s, zeros for an expert with no rows) are
    empty where not needed; ``g_amax`` holds each expert's output-gradient amax."""
    amax_g = x.new_zeros(offsets.shape[0], dtype=torch.float32)
    grad_w = grad_out.new_zeros(weight.shape if need_w else (0,), dtype=weight.dtype)
    parts = []
    for g, s, e in _groups(offsets):
        qx, _ = _cast(x[s:e], x_cast)
        qw, _ = _cast(weight[g], w_cast)
        qg, amax_g[g] = _cast(grad_out[s:e], g_cast)
        # what forward_product keeps of tiled casts: x along the tokens, w whole
        dtypes = (x.dtype if need_x else None, weight.dtype if need_w else None)
        gx, gw = backward_products(_backend(), qg, qx.columnwise(), qw, True, dtypes)
        if gx is not None:
            parts.append(gx)
        if gw is not None:
            grad_w[g] = gw
    if not need_x:
        grad_x = x.new_zeros((0,))
    elif parts:
        grad_x = torch.cat(parts)
    else:
        grad_x = x.new_zeros(x.shape)
    return grad_x, grad_w, amax_g


@fine_grouped_backward.register_fake
def _(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    x_cast: str,
    w_cast: str,
    g_cast: str,
    need_x: bool,
    need_w: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_x = x.new_empty(x.shape if need_x else (0,))
    grad_w = weight.new_empty(weight.shape if need_w else (0,))
    return grad_x, grad_w, x.new_empty(offsets.shape[0], dtype=torch.float32)


class DeviceFineGroupedFunction(torch.autograd.Function):
    """A fine-grained grouped layer through the two operators: ``(out, x_amax, w_amax)``, the amaxes for
    the caller to record; backward records the output gradients' amaxes into ``grad_slots``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        offsets: Tensor,
        active: Tensor,
        casts: tuple[str, str, str],
        out_dtype: torch.dtype,
        manager: Any,
        grad_slots: Sequence[Any],
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, amax_x, amax_w = torch.ops.scalestate.fine_grouped_forward(
            x, weight, bias, offsets, casts[0], casts[1], out_dtype
        )
        ctx.save_for_backward(x, weight, offsets, active)
        ctx.mark_non_differentiable(amax_x, amax_w)
        ctx.casts, ctx.manager, ctx.grad_slots = casts, manager, grad_slots
        ctx.b_dtype = None if bias is None else bias.dtype
        return out, amax_x, amax_w

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        x, weight, offsets, active = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            gx, gw, amax_g = torch.ops.scalestate.fine_grouped_backward(
                grad_out, x, weight, offsets, *ctx.casts, need_x, need_w
            )
            ctx.manager._device_groups.record(ctx.grad_slots, amax_g, active)
            grad_x, grad_w = (gx if need_x else None), (gw if need_w else None)
        if need_b:  # each expert's rows summed as ss.nn.Linear sums its bias gradient
            grad_b = torch.ops.scalestate.grouped_sum(grad_out, offsets).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None
