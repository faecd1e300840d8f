"""Grouped casts whose group sizes stay on the device: compiled grouped layers, one graph for every routing.

A grouped layer in compiled code cannot read its group sizes on the host
without a guard on each (a recompilation for every new pattern of empty
experts). Where the backend has :class:`~scalestate.backends.SupportsDeviceGroups`
and its grouped products are its own products' bits on the device, the layer
casts every group in one request whatever its size: a group with no rows (or,
for a weight, an expert with no tokens) is cast but records nothing, so the
state after a step is the eager run's, bitwise. Eager code keeps the host
path (`scalestate._engine.casting.Caster.cast_grouped`): there an empty
expert casts nothing at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from scalestate._engine.binding import settle_during_trace
from scalestate._engine.state import Slot
from scalestate.backends import GroupedCastRequest, GroupedRows, SupportsDeviceGroups
from scalestate.phase import CastKind

if TYPE_CHECKING:
    from scalestate._engine.casting import Caster

__all__ = [
    "DeviceGroups", "cast_rows", "opaque_products", "record_groups", "scales_and_jit", "takes_device_groups",
]


class DeviceGroups:
    """The manager's compiled grouped casts with the sizes on the device (the functions of this module)."""

    def __init__(self, caster: Caster) -> None:
        self._caster = caster

    def takes(self, slots: Sequence[Slot], device: torch.device) -> bool:
        """:func:`takes_device_groups`."""
        return takes_device_groups(self._caster, slots, device)

    def opaque_products(self, slot_groups: Sequence[Sequence[Slot]], device: torch.device) -> str | None:
        """:func:`opaque_products`."""
        return opaque_products(self._caster, slot_groups, device)

    def scales_and_jit(self, slots: Sequence[Slot]) -> tuple[Tensor, Tensor]:
        """:func:`scales_and_jit`."""
        return scales_and_jit(self._caster, slots)

    def randomness(self, slots: Sequence[Slot], active: Tensor) -> tuple[Tensor, Tensor]:
        """NVFP4's RHT signs and each slot's stochastic-rounding key (zeros where its casts do not round
        stochastically), counting a cast for the active slots only, as eager casts of the slots with rows
        would count theirs."""
        st = self._caster._state
        if not slots[0].spec.stochastic:
            return st.random.signs, torch.zeros(len(slots), dtype=torch.int64, device=st.device)
        rows = torch.cat([st.row_index(slot) for slot in slots])
        return st.random.signs, st.random.sr_keys(rows, active)

    def cast_rows(self, slots: Sequence[Slot], x: Tensor, counts: Tensor, active: Tensor) -> GroupedRows:
        """:func:`cast_rows`."""
        return cast_rows(self._caster, slots, x, counts, active)

    def record(self, slots: Sequence[Slot], amax: Tensor, active: Tensor, counts: Tensor | None = None) -> None:
        """:func:`record_groups`."""
        record_groups(self._caster, slots, amax, active, counts)

    @property
    def stats(self) -> bool:
        """Whether the manager collects cast statistics."""
        return self._caster._stats


def takes_device_groups(caster: Caster, slots: Sequence[Slot], device: torch.device) -> bool:
    """Whether compiled code can cast and multiply ``slots``' groups with the sizes on the device:
    per-tensor specs shared by all, no statistics, and a backend whose grouped products are its own
    on ``device`` in the layout it is handed (no transposed copies wanted)."""
    if not torch.compiler.is_compiling() or not slots or not caster.one_per_tensor_spec(slots):
        return False
    settle_during_trace(caster._binding, device)
    backend = caster._binding.backend
    return (
        isinstance(backend, SupportsDeviceGroups)
        and backend.grouped_products(device)
        and not backend.wants_transposed(device)
    )


def opaque_products(caster: Caster, slot_groups: Sequence[Sequence[Slot]], device: torch.device) -> str | None:
    """Whether compiled code can run a grouped layer through the opaque operators of
    `scalestate.nn.grouped_opaque` with the sizes on the device: the description of the backend they
    rebuild (its ``_products_key()``: the emulation and ``scaled_mm`` backends, not their subclasses),
    or ``None``. Each role's slots (``slot_groups``, one sequence per role) must share one spec."""
    if not torch.compiler.is_compiling() or not all(slot_groups):
        return None
    for slots in slot_groups:
        spec = slots[0].spec
        if any(slot.spec != spec for slot in slots):
            return None
    settle_during_trace(caster._binding, device)
    key = getattr(caster._binding.backend, "_products_key", None)
    return key() if callable(key) else None


def scales_and_jit(caster: Caster, slots: Sequence[Slot]) -> tuple[Tensor, Tensor]:
    """``slots``' scales and whether each casts just in time, as two ``[G]`` tensors (float32, bool)."""
    st = caster._state
    rows = torch.cat([st.row_index(slot) for slot in slots])
    jit = caster.group_jit(slots, compiling=True)
    if isinstance(jit, bool):
        jit = torch.full((len(slots),), jit, dtype=torch.bool, device=st.device)
    return st.scales.index_select(0, rows), jit


def record_groups(
    caster: Caster, slots: Sequence[Slot], amax: Tensor, active: Tensor, counts: Tensor | None = None
) -> None:
    """Max ``amax[g]`` (a ``[G]`` float32 tensor) into ``slots[g]``'s accumulator where ``active[g]`` and
    the cast counts as recorded (not in a recompute or an evaluation), as each eager cast records
    (NaN propagates); with ``collect_stats``, add ``counts[g]`` (``[G, 4]`` int64: elements, then
    `scalestate._engine.counting.cast_counts`'s three; zeros for a group without rows) to its
    statistics too."""
    if caster._kind(slots[0], False, True) is not CastKind.RECORD:  # one phase, one role: every slot's kind
        return
    st = caster._state
    rows = torch.cat([st.row_index(slot) for slot in slots])
    kept = torch.where(active, amax, torch.zeros_like(amax))
    st.step_amax.index_copy_(0, rows, torch.maximum(st.step_amax.index_select(0, rows), kept))
    if caster._stats and counts is not None:
        st._counts.index_add_(0, rows, counts)  # zeros for a group without rows, which cast nothing


def cast_rows(caster: Caster, slots: Sequence[Slot], x: Tensor, counts: Tensor, active: Tensor) -> GroupedRows:
    """Cast ``x``'s row groups (``counts`` rows each, on the device), group ``g`` for ``slots[g]``,
    in one request; only groups where ``active`` (a ``[G]`` bool tensor) record their amax."""
    st = caster._state
    backend = caster._binding.backend
    assert isinstance(backend, SupportsDeviceGroups)
    # the slots' own index tensors, inputs of the graph: a literal list would be a constant of each
    # layer's graph, and identical layers would not share their compiled kernels
    rows = torch.cat([st.row_index(slot) for slot in slots])
    jit = caster.group_jit(slots, compiling=True)
    recording = caster._kind(slots[0], False, True) is CastKind.RECORD  # one phase, one role: every slot's kind
    record = torch.zeros(len(slots), dtype=torch.float32, device=st.device) if recording else None
    request = GroupedCastRequest(x.detach(), slots[0].spec, counts, st.scales.index_select(0, rows), jit, record)
    out = backend.cast_grouped_rows(request)
    if record is not None:
        record_groups(caster, slots, record, active)
    return out
