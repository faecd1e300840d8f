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

__all__ = ["DeviceGroups"]


class DeviceGroups:
    """One manager's compiled grouped casts with the sizes on the device, and what the operators of
    `scalestate.nn.grouped_opaque` read and record."""

    def __init__(self, caster: Caster) -> None:
        self._caster = caster

    @property
    def stats(self) -> bool:
        """Whether the manager collects cast statistics."""
        return self._caster._stats

    @property
    def signs(self) -> Tensor:
        """NVFP4's RHT signs (the state's own tensor)."""
        return self._caster._state.random.signs

    def takes(self, slots: Sequence[Slot], device: torch.device) -> bool:
        """Whether compiled code can cast and multiply ``slots``' groups with the sizes on the device:
        per-tensor specs shared by all, no statistics, and a backend whose grouped products are its own
        on ``device`` in the layout it is handed (no transposed copies wanted)."""
        caster = self._caster
        if not torch.compiler.is_compiling() or not slots or not caster.one_per_tensor_spec(slots):
            return False
        settle_during_trace(caster._binding, device)
        backend = caster._binding.backend
        return (
            isinstance(backend, SupportsDeviceGroups)
            and backend.grouped_products(device)
            and not backend.wants_transposed(device)
        )

    def opaque_products(self, slot_groups: Sequence[Sequence[Slot]], device: torch.device) -> str | None:
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
        settle_during_trace(self._caster._binding, device)
        key = getattr(self._caster._binding.backend, "_products_key", None)
        return key() if callable(key) else None

    def scales_and_jit(self, slots: Sequence[Slot]) -> tuple[Tensor, Tensor]:
        """``slots``' scales and whether each casts just in time, as two ``[G]`` tensors (float32, bool)."""
        st = self._caster._state
        jit = self._caster.group_jit(slots, compiling=True)
        if isinstance(jit, bool):
            jit = torch.full((len(slots),), jit, dtype=torch.bool, device=st.device)
        return st.scales.index_select(0, self._rows(slots)), jit

    def sr_keys(self, slots: Sequence[Slot], active: Tensor) -> Tensor:
        """Each slot's stochastic-rounding key (zeros where its casts do not round stochastically),
        counting a cast for the ``active`` slots only, as eager casts of the slots with rows count theirs."""
        st = self._caster._state
        if not slots[0].spec.stochastic:
            return torch.zeros(len(slots), dtype=torch.int64, device=st.device)
        return st.random.sr_keys(self._rows(slots), active)

    def record(self, slots: Sequence[Slot], amax: Tensor, active: Tensor, counts: Tensor | None = None) -> None:
        """Max ``amax[g]`` (a ``[G]`` float32 tensor) into ``slots[g]``'s accumulator where ``active[g]``
        and the cast counts as recorded (not in a recompute or an evaluation), as each eager cast records
        (NaN propagates); with ``collect_stats``, add ``counts[g]`` (``[G, 4]`` int64: elements, then
        `scalestate._engine.counting.cast_counts`'s three; zeros for a group without rows) to its
        statistics too."""
        if not self._recording(slots):
            return
        st = self._caster._state
        rows = self._rows(slots)
        kept = torch.where(active, amax, torch.zeros_like(amax))
        st.step_amax.index_copy_(0, rows, torch.maximum(st.step_amax.index_select(0, rows), kept))
        if self._caster._stats and counts is not None:
            st._counts.index_add_(0, rows, counts)  # zeros for a group without rows, which cast nothing

    def cast_rows(self, slots: Sequence[Slot], x: Tensor, counts: Tensor, active: Tensor) -> GroupedRows:
        """Cast ``x``'s row groups (``counts`` rows each, on the device), group ``g`` for ``slots[g]``,
        in one request; only groups where ``active`` (a ``[G]`` bool tensor) record their amax."""
        st = self._caster._state
        backend = self._caster._binding.backend
        assert isinstance(backend, SupportsDeviceGroups)
        jit = self._caster.group_jit(slots, compiling=True)
        record = torch.zeros(len(slots), dtype=torch.float32, device=st.device) if self._recording(slots) else None
        scales = st.scales.index_select(0, self._rows(slots))
        out = backend.cast_grouped_rows(GroupedCastRequest(x.detach(), slots[0].spec, counts, scales, jit, record))
        if record is not None:
            self.record(slots, record, active)
        return out

    def _recording(self, slots: Sequence[Slot]) -> bool:
        """Whether ``slots``' casts count as recorded now (one phase, one role: every slot's kind)."""
        return self._caster._kind(slots[0], False, True) is CastKind.RECORD

    def _rows(self, slots: Sequence[Slot]) -> Tensor:
        """The slots' state rows, from their own index tensors, inputs of the graph: a literal list would be
        a constant of each layer's graph, and identical layers would not share their compiled kernels."""
        st = self._caster._state
        return torch.cat([st.row_index(slot) for slot in slots])
