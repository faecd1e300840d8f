"""Grouped layers in compiled code with the group sizes on the device: one graph for every routing.

:func:`scalestate.nn.grouped_linear` reads its group sizes on the host in
eager code, so that an expert with no tokens casts nothing at all. Compiled
code that did the same would guard on every size, and compile again for each
new pattern of empty experts. Given the sizes as a tensor, under
``torch.compile``, with a per-tensor recipe (delayed or current scaling) and a
backend whose grouped products are its own (see
:class:`~scalestate.backends.SupportsDeviceGroups`: the emulation backend
everywhere, ``cuda`` off CUDA), the layer runs a fixed set of operations
instead: each role is cast in one grouped cast of every expert, the products
run through the backend's ``grouped_scaled_mm``, and only experts with tokens
record their amaxes. The outputs, gradients and the state after each step are
the eager layer's, bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import GroupedOperand, SupportsDeviceGroups
from scalestate.errors import ArgumentTypeError, ArgumentValueError
from scalestate.handle import ScalingHandle
from scalestate.recipe import Role

__all__ = ["DeviceGroupedFP8LinearFunction", "device_grouped_linear"]


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
    ``None`` where its recipe, backend or bias need the host path. The sizes' values are not checked
    (that would read them on the host): they must be ``E`` non-negative counts summing to ``T``."""
    n_experts, out_features, in_features = weight.shape
    if group_sizes.dim() != 1 or group_sizes.shape[0] != n_experts or group_sizes.is_floating_point():
        raise ArgumentTypeError(
            f"{where}: group_sizes must be a 1-d integer tensor of {n_experts} token counts; "
            f"got shape {tuple(group_sizes.shape)}, {group_sizes.dtype}"
        )
    if group_sizes.device != x.device:
        raise ArgumentValueError(f"{where}: group_sizes is on {group_sizes.device}, the input on {x.device}")
    if bias is not None:  # a per-expert sum of the output gradient with the eager bits needs each group's size
        return None
    manager = handles[0].manager
    slots = tuple(tuple(h._slot(role) for h in handles) for role in (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT))
    if not all(manager._takes_device_groups(group, x.device) for group in slots):
        return None
    counts = group_sizes.to(torch.int64)
    active = counts > 0
    qx = manager._cast_grouped_rows(slots[0], x, counts, active)
    rows_per_expert = torch.full((n_experts,), out_features, dtype=torch.int64, device=x.device)
    qw = manager._cast_grouped_rows(slots[1], weight.detach().reshape(-1, in_features), rows_per_expert, active)
    out: Tensor = DeviceGroupedFP8LinearFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, qx.data, qx.scale_inv.index_select(0, qx.group_of_row).unsqueeze(1), qx.group_of_row,
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
            a, GroupedOperand(w_data.transpose(1, 2), w_scale_inv), offsets, out_dtype=out_dtype
        )
        ctx.save_for_backward(x_data, x_scale_inv, group_of_row, w_data, w_scale_inv, counts, active, offsets)
        ctx.manager, ctx.grad_slots, ctx.backend = manager, grad_slots, backend
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x_data, x_scale_inv, group_of_row, w_data, w_scale_inv, counts, active, offsets = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        backend: SupportsDeviceGroups = ctx.backend
        x_dtype, w_dtype = ctx.dtypes
        grad_x = grad_w = None
        if need_x or need_w:
            qg = ctx.manager._cast_grouped_rows(ctx.grad_slots, grad_out, counts, active)
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
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None, None
