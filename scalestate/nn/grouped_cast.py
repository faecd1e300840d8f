"""Grouped casts and the autograd Function of grouped layers (see :mod:`scalestate.nn.grouped`).

:func:`quantize_grouped` casts each group of a tensor's rows through its own
handle, in one backend call where the backend takes grouped requests
(:class:`~scalestate.backends.GroupedCastRequest`).
:class:`GroupedFP8LinearFunction` runs every expert's three products, as
:class:`~scalestate.nn.function.FP8LinearFunction` runs one layer's, casting
the output gradients of all experts at once. :func:`sort_by_expert` orders
top-k routing assignments by expert, as grouped layers take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.errors import ArgumentTypeError, ArgumentValueError, CastError
from scalestate.handle import ScalingHandle
from scalestate.nn.function import backward_products, forward_product
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["GroupedFP8LinearFunction", "check_group_sizes", "quantize_grouped", "sort_by_expert"]


@overload
def sort_by_expert(
    top_k_index: Tensor, num_experts: int, *, on_device: Literal[False] = False
) -> tuple[Tensor, Tensor, list[int]]: ...


@overload
def sort_by_expert(
    top_k_index: Tensor, num_experts: int, *, on_device: Literal[True]
) -> tuple[Tensor, Tensor, Tensor]: ...


@overload
def sort_by_expert(
    top_k_index: Tensor, num_experts: int, *, on_device: bool
) -> tuple[Tensor, Tensor, list[int] | Tensor]: ...


def sort_by_expert(
    top_k_index: Tensor, num_experts: int, *, on_device: bool = False
) -> tuple[Tensor, Tensor, list[int] | Tensor]:
    """Token assignments ordered by expert: ``(order, tokens, group_sizes)``.

    ``top_k_index`` is ``[T, k]``: the experts each token is routed to.
    ``order`` indexes the flattened ``[T * k]`` assignments so that they run
    expert by expert (tokens in ascending order within each expert),
    ``tokens`` is the token of each, and ``group_sizes`` the ``E`` counts as
    Python ints: ``x[tokens]`` is what a grouped layer takes with
    ``group_sizes``, and ``weights.reshape(-1)[order]`` the routing weight of
    each of its rows. Reading the counts is the one host synchronization of a
    MoE layer; pass the list to every grouped layer of it. Indices outside
    ``0 .. E - 1`` (transformers' marker of an expert held by another rank)
    are dropped.

    ``on_device=True`` reads nothing on the host: ``group_sizes`` is an
    ``[E]`` int64 tensor, and every index must be in ``0 .. E - 1`` (none is
    dropped). Compiled code takes it so, to run one graph for every routing
    (see :mod:`scalestate.nn.grouped_device`).

    Example:
        >>> import torch, scalestate as ss
        >>> order, tokens, sizes = ss.nn.sort_by_expert(torch.tensor([[2, 0], [1, 2]]), 3)
        >>> tokens.tolist(), sizes
        ([0, 1, 0, 1], [1, 1, 2])
        >>> ss.nn.sort_by_expert(torch.tensor([[2, 0], [1, 2]]), 3, on_device=True)[2]
        tensor([1, 1, 2])
    """
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    if on_device:
        order = torch.argsort(flat, stable=True)
        sizes = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        sizes.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
        return order, torch.div(order, k, rounding_mode="floor"), sizes
    keyed = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # the dropped ones sort last
    order = torch.argsort(keyed, stable=True)
    counts: list[int] = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts].tolist()
    order = order[: sum(counts)]
    return order, torch.div(order, k, rounding_mode="floor"), counts


def check_group_sizes(group_sizes: Tensor | Sequence[int], n_experts: int, n_tokens: int, where: str) -> list[int]:
    """``group_sizes`` as Python ints, checked against the expert and token counts (a tensor is read
    once: one host synchronization)."""
    if isinstance(group_sizes, Tensor):
        if group_sizes.dim() != 1 or group_sizes.is_floating_point() or group_sizes.is_complex():
            raise ArgumentTypeError(
                f"{where}: group_sizes must be a 1-d integer tensor (tokens per expert); "
                f"got shape {tuple(group_sizes.shape)}, {group_sizes.dtype}"
            )
        sizes: list[int] = group_sizes.tolist()
    elif isinstance(group_sizes, Sequence) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in group_sizes
    ):
        sizes = list(group_sizes)
    else:
        raise ArgumentTypeError(
            f"{where}: group_sizes must be a 1-d integer tensor or a sequence of ints; got {group_sizes!r}"
        )
    if len(sizes) != n_experts:
        raise ArgumentValueError(f"{where}: group_sizes has {len(sizes)} entries for {n_experts} experts")
    if any(n < 0 for n in sizes):
        raise ArgumentValueError(f"{where}: group_sizes must be non-negative; got {sizes}")
    if sum(sizes) != n_tokens:
        raise ArgumentValueError(
            f"{where}: group_sizes sums to {sum(sizes)}, but the input has {n_tokens} tokens; pass the "
            "tokens ordered by expert and the number routed to each (zeros for experts with none)"
        )
    return sizes


def quantize_grouped(
    handles: Sequence[ScalingHandle],
    x: Tensor,
    group_sizes: Tensor | Sequence[int],
    role: Role,
    *,
    transpose: bool = False,
) -> tuple[Quantized | None, ...]:
    """Cast each group of ``x``'s rows for ``role`` through its own handle: group ``g`` (rows
    ``sum(group_sizes[:g]) .. sum(group_sizes[:g + 1])``) as ``handles[g].quantize(x_g, role,
    transpose=transpose)`` would cast it, with the same bits and records.

    Where the backend takes grouped casts (see
    :class:`~scalestate.backends.GroupedCastRequest`) and the recipe scales per
    tensor, every group is cast in one backend call, with one
    accumulator update for all; otherwise, and for ``WEIGHT`` (whose casts are
    cached per tensor), one cast per group. Empty groups cast and record nothing.

    Args:
        handles: one per group, all of one manager, each registered with ``role``.
        x: ``(T, K)``, ordered by group.
        group_sizes: ``G`` non-negative row counts summing to ``T``.
        role: the role every group is cast for.
        transpose: also make each group's other orientation (see :meth:`ScalingHandle.quantize`).

    Returns:
        One :class:`~scalestate.Quantized` per group, ``None`` for an empty one.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad handles or group sizes.
        CastError: ``x`` is not a 2-d floating-point tensor.
    """
    handles = tuple(handles)
    if not handles or not all(isinstance(h, ScalingHandle) for h in handles):
        raise ArgumentTypeError("quantize_grouped: handles must be a non-empty sequence of ScalingHandles")
    manager = handles[0].manager
    if any(h.manager is not manager for h in handles):
        raise ArgumentValueError("quantize_grouped: every handle must belong to one manager")
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise CastError(f"quantize_grouped: x must be a 2-d floating-point tensor (rows by group); got {got}")
    sizes = check_group_sizes(group_sizes, len(handles), x.shape[0], f"quantize_grouped {handles[0].name!r}...")
    return cast_groups(handles, x, sizes, role, transpose)


def cast_groups(
    handles: Sequence[ScalingHandle], x: Tensor, sizes: Sequence[int], role: Role, transpose: bool
) -> tuple[Quantized | None, ...]:
    """:func:`quantize_grouped` on checked arguments."""
    used = [g for g, n in enumerate(sizes) if n]
    out: list[Quantized | None] = [None] * len(sizes)
    if not used:
        return tuple(out)
    slots = [handles[g]._slot(role) for g in used]
    cast = handles[0].manager._cast_grouped(slots, x, [sizes[g] for g in used], transpose)
    for g, q in zip(used, cast, strict=True):
        out[g] = q
    return tuple(out)


class GroupedFP8LinearFunction(torch.autograd.Function):
    """Every used expert's ``x_e @ w_e.T + b_e`` from casts already made; backward casts the output
    gradient of all experts at once (:func:`quantize_grouped`) and runs each expert's two products as
    :class:`~scalestate.nn.function.FP8LinearFunction` does. Only FP8 tensors and scales are saved."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        used: tuple[int, ...],
        sizes: tuple[int, ...],
        qxs: list[Quantized],
        qws: list[Quantized],
        handles: tuple[ScalingHandle, ...],
        backend: Backend,
        out_dtype: torch.dtype,
    ) -> Tensor:
        outs: list[Tensor] = []
        tensors: list[Tensor] = []
        layouts: list[tuple[int, Any]] = []
        x_is_transposed = False
        for e, qx, qw in zip(used, qxs, qws, strict=True):
            out, x_saved, w_saved, x_is_transposed = forward_product(
                backend, qx, qw, out_dtype, None if bias is None else bias[e]
            )
            outs.append(out)
            for q in (x_saved, w_saved):
                flat, layout = q.flatten()
                tensors.extend(flat)
                layouts.append((len(flat), layout))
        ctx.save_for_backward(*tensors)
        ctx.layouts, ctx.used, ctx.sizes, ctx.handles, ctx.backend = layouts, used, sizes, handles, backend
        ctx.x_is_transposed = x_is_transposed
        ctx.shapes = (weight.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_out = grad_out.contiguous()  # as compiled code has it (see FP8LinearFunction.backward)
        w_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        used, sizes = ctx.used, ctx.sizes
        if need_x or need_w:
            saved, at, ops = ctx.saved_tensors, 0, []
            for n, layout in ctx.layouts:
                ops.append(Quantized.unflatten(saved[at : at + n], layout))
                at += n
            qgs = cast_groups([ctx.handles[e] for e in used], grad_out, sizes, Role.GRAD_OUTPUT, ctx.x_is_transposed)
            dtypes = (x_dtype if need_x else None, w_dtype if need_w else None)
            grads = [
                backward_products(ctx.backend, qg, ops[2 * i], ops[2 * i + 1], ctx.x_is_transposed, dtypes)
                for i, qg in enumerate(qgs)
                if qg is not None
            ]
            if need_x:
                parts = [gx for gx, _ in grads]
                grad_x = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
            if need_w:
                grad_w = grad_out.new_zeros(w_shape, dtype=w_dtype)
                grad_w[list(used)] = torch.stack([gw for _, gw in grads])  # type: ignore[misc]
        if need_b:
            grad_b = grad_out.new_zeros((w_shape[0], w_shape[1]), dtype=b_dtype)
            for e, part in zip(used, grad_out.split(sizes), strict=True):  # type: ignore[no-untyped-call]
                grad_b[e] = part.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None
