"""Grouped layers in compiled code with the group sizes on the device: one graph for every routing.

:func:`scalestate.nn.grouped_linear` reads its group sizes on the host in
eager code, so that an expert with no tokens casts nothing at all. Compiled
code that did the same would guard on every size, and compile again for each
new pattern of empty experts. Given the sizes as a tensor, under
``torch.compile``, with a per-tensor recipe (delayed or current scaling) and a
backend whose grouped products are its own (see
:class:`~scalestate.backends.SupportsDeviceGroups`: the emulation backend
everywhere, ``cuda`` off CUDA, ``scaled_mm`` on a CPU with
``torch.nn.functional.scaled_mm``), the layer runs a fixed set of operations
instead: each role is cast in one grouped cast of every expert, the products
run through the backend's ``grouped_scaled_mm`` (which adds each expert's
bias to its product), each expert's bias gradient is its own rows' sum through
one opaque operator (``scalestate::grouped_sum``), and only experts with
tokens record their amaxes. The outputs, gradients and the state after each
step are the eager layer's, bitwise. Other recipes and backends (the emulation
and ``scaled_mm`` ones) take :mod:`scalestate.nn.grouped_opaque`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import GroupedOperand, SupportsDeviceGroups
from scalestate.backends.base import HOST_READ_OP, group_spans
from scalestate.errors import ArgumentTypeError, ArgumentValueError
from scalestate.handle import ScalingHandle
from scalestate.nn.grouped_opaque import opaque_grouped_linear
from scalestate.recipe import Role

__all__ = ["DeviceGroupedFP8LinearFunction", "device_grouped_linear", "grouped_sum"]


def device_grouped_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group_sizes: Tensor,
    handles: Sequence[ScalingHandle],
    out_dtype: torch.dtype,
    where: str,
) -> Tensor | None:
    """:func:`scalestate.nn.grouped_linear` with ``group_sizes`` left on the device (compiled code only);
    ``None`` where its recipe or backend needs the host path. The sizes' values are not checked
    (that would read them on the host): they must be ``E`` non-negative counts summing to ``T``."""
    n_experts, out_features, in_features = weight.shape
    if group_sizes.dim() != 1 or group_sizes.shape[0] != n_experts or group_sizes.is_floating_point():
        raise ArgumentTypeError(
            f"{where}: group_sizes must be a 1-d integer tensor of {n_experts} token counts; "
            f"got shape {tuple(group_sizes.shape)}, {group_sizes.dtype}"
        )
    if group_sizes.device != x.device:
        raise ArgumentValueError(f"{where}: group_sizes is on {group_sizes.device}, the input on {x.device}")
    if x.shape[0] == 0:  # as eager: nothing to cast or multiply, and no gradient for the parameters
        return x.new_zeros((0, out_features), dtype=out_dtype)
    manager = handles[0].manager
    slots = tuple(tuple(h._slot(role) for h in handles) for role in (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT))
    groups = manager._device_groups
    if not all(groups.takes(group, x.device) for group in slots):
        products = groups.opaque_products(slots, x.device)
        if products is None:
            return None
        return opaque_grouped_linear(x, weight, bias, group_sizes, slots, products, manager, out_dtype)
    counts = group_sizes.to(torch.int64)
    active = counts > 0
    qx = groups.cast_rows(slots[0], x, counts, active)
    rows_per_expert = torch.full((n_experts,), out_features, dtype=torch.int64, device=x.device)
    qw = groups.cast_rows(slots[1], weight.detach().reshape(-1, in_features), rows_per_expert, active)
    out: Tensor = DeviceGroupedFP8LinearFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, qx.data, qx.scale_inv.index_select(0, qx.group_of_row).unsqueeze(1), qx.group_of_row,
        qw.data.view(weight.shape), qw.scale_inv.view(n_experts, 1, 1), counts, active, manager, slots[2],
        manager.backend, out_dtype,
    )
    return out


class DeviceGroupedFP8LinearFunction(torch.autograd.Function):
    """Every expert's ``x_e @ w_e.T`` from the grouped casts of all rows and all weights; backward casts
    the output gradient of all experts at once and runs both grouped products. Only FP8 tensors and
    their scales are saved."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        x_data: Tensor,
        x_scale_inv: Tensor,
        group_of_row: Tensor,
        w_data: Tensor,
        w_scale_inv: Tensor,
        counts: Tensor,
        active: Tensor,
        manager: Any,
        grad_slots: tuple[Any, ...],
        backend: SupportsDeviceGroups,
        out_dtype: torch.dtype,
    ) -> Tensor:
        offsets = counts.cumsum(0).to(torch.int32)
        a = GroupedOperand(x_data, x_scale_inv)
        out = backend.grouped_scaled_mm(
            a, GroupedOperand(w_data.transpose(1, 2), w_scale_inv), offsets, out_dtype=out_dtype, bias=bias
        )
        ctx.save_for_backward(x_data, x_scale_inv, group_of_row, w_data, w_scale_inv, counts, active, offsets)
        ctx.manager, ctx.grad_slots, ctx.backend = manager, grad_slots, backend
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_out = grad_out.contiguous()  # as eager has it (see FP8LinearFunction.backward)
        x_data, x_scale_inv, group_of_row, w_data, w_scale_inv, counts, active, offsets = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        backend: SupportsDeviceGroups = ctx.backend
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            qg = ctx.manager._device_groups.cast_rows(ctx.grad_slots, grad_out, counts, active)
            g_scale_inv = qg.scale_inv.index_select(0, group_of_row)
            if need_x:  # dy @ w, expert by expert
                grad_x = backend.grouped_scaled_mm(
                    GroupedOperand(qg.data, g_scale_inv.unsqueeze(1)), GroupedOperand(w_data, w_scale_inv),
                    offsets, out_dtype=x_dtype,
                )
            if need_w:  # dy.T @ x over each expert's tokens; zeros for an expert with none
                grad_w = backend.grouped_scaled_mm(
                    GroupedOperand(qg.data.t(), g_scale_inv.unsqueeze(0)), GroupedOperand(x_data, x_scale_inv),
                    offsets, out_dtype=w_dtype,
                )
        if need_b:  # each expert's rows summed as ss.nn.Linear sums its bias gradient; zeros for an empty one
            grad_b = torch.ops.scalestate.grouped_sum(grad_out, offsets).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None, None


@torch.library.custom_op("scalestate::grouped_sum", mutates_args=(), **HOST_READ_OP)
def grouped_sum(x: Tensor, offsets: Tensor) -> Tensor:
    """``(G, N)`` float32: row ``g`` is ``x[start_g:end_g].sum(0, dtype=torch.float32)`` over group ``g``'s
    rows of the 2-d ``x`` (``offsets``: ``[G]`` int32 ends, as ``torch.nn.functional.grouped_mm`` takes
    them), zeros for an empty group: the bits of each group's own sum, which a segmented reduction
    over all rows need not give. An operator of its own, so that compiled code keeps the sizes on the
    device; its ``ends`` are read on the host when it runs."""
    out = x.new_zeros((offsets.shape[0], x.shape[1]), dtype=torch.float32)
    for g, start, end in group_spans(offsets, skip_empty=True):
        out[g] = x[start:end].sum(0, dtype=torch.float32)
    return out


@grouped_sum.register_fake
def _(x: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty((offsets.shape[0], x.shape[1]), dtype=torch.float32)
