"""The emulation backend's grouped products: each group's dequantized operands multiplied in float32.

:func:`grouped_mm` is an operator of its own (``scalestate::grouped_mm``) so
that compiled code keeps the group sizes on the device; importing
:mod:`scalestate.backends.emulation` registers it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.backends.base import HOST_READ_OP, GroupedOperand, group_spans, rows_then_zeros

__all__ = ["dequantized", "grouped_mm"]


def dequantized(operand: GroupedOperand) -> Tensor:
    """``data * scale_inv`` in float32, in the data's memory order (a transposed operand stays a transposed
    view, as :meth:`EmulationBackend.dequantize` keeps it, so that each group's product sees its layout)."""
    data, scale_inv = operand
    if data.dim() >= 2 and not data.is_contiguous() and data.mT.is_contiguous():
        return (data.mT.to(torch.float32) * scale_inv.mT).mT
    return data.to(torch.float32) * scale_inv


@torch.library.custom_op("scalestate::grouped_mm", mutates_args=(), **HOST_READ_OP)
def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor, row_major: bool = False, bias: Tensor | None = None) -> Tensor:
    """Each group's ``torch.mm``, grouped as ``torch.nn.functional.grouped_mm`` groups (see
    :meth:`SupportsDeviceGroups.grouped_scaled_mm <scalestate.backends.SupportsDeviceGroups.grouped_scaled_mm>`),
    on any dtype and device, with the bits of ``torch.mm`` on each group's slices (with ``row_major``, on
    row-major copies of them, as ``torch.nn.functional.scaled_mm`` multiplies on CPU). An operator of its
    own, so that compiled code keeps the sizes on the device (torch's own refuses float32 while tracing);
    its ``ends`` are read on the host when it runs. ``bias`` (3-d ``b`` only): ``bias[g]`` is added
    to group ``g``'s product in float32, as :meth:`EmulationBackend.scaled_mm` adds a bias."""
    def mm(x: Tensor, y: Tensor) -> Tensor:
        return torch.mm(x.contiguous(), y.contiguous()) if row_major else torch.mm(x, y)

    if b.dim() == 3:  # rows of a by group, each times b[g]
        groups = group_spans(offsets, skip_empty=True)
        parts = [mm(a[s:e], b[g]) for g, s, e in groups]
        if bias is not None:
            parts = [part + bias[g].float() for part, (g, _, _) in zip(parts, groups, strict=True)]
        return rows_then_zeros(parts, a.shape[0], b.shape[-1], a, a.dtype)
    return torch.stack([mm(a[:, s:e], b[s:e]) for _, s, e in group_spans(offsets)])


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offsets: Tensor, row_major: bool = False, bias: Tensor | None = None) -> Tensor:
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]))
    return a.new_empty((offsets.shape[0], a.shape[0], b.shape[1]))
