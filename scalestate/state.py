"""The one mutable object behind a manager: slot buffers and step bookkeeping."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor

from scalestate.backends.base import CastSpec
from scalestate.phase import Phase
from scalestate.quantized import Quantized
from scalestate.recipe import Role

if TYPE_CHECKING:
    from scalestate.handle import ScalingHandle

__all__ = ["CachedCast", "Slot", "State"]


@attrs.frozen
class Slot:
    """One (name, role) pair: a row of every buffer."""

    name: str
    role: Role
    spec: CastSpec


@attrs.frozen(eq=False)
class CachedCast:
    """A weight cast, valid while the weight and the scale epoch are unchanged."""

    source: weakref.ref[Tensor]
    data_ptr: int
    version: int
    epoch: int
    quantized: Quantized
    amax: Tensor

    def matches(self, x: Tensor, epoch: int) -> bool:
        """True if ``x`` is the very tensor cast, unmodified, in this epoch."""
        return (
            self.epoch == epoch
            and self.source() is x
            and self.version == x._version
            and self.data_ptr == x.data_ptr()
        )


@attrs.define(eq=False)
class State:
    """Slot buffers (one contiguous tensor each, a row per slot) and bookkeeping.

    Buffers grow by concatenation as slots register; nothing keeps views into
    them, so growing never leaves a stale reference behind.
    """

    device: torch.device
    history_len: int
    #: ``[N, H]`` amax history per slot, newest last.
    history: Tensor = attrs.field(init=False)
    #: ``[N]`` current scale per slot.
    scales: Tensor = attrs.field(init=False)
    #: ``[N]`` max of the amaxes recorded since the last step.
    step_amax: Tensor = attrs.field(init=False)
    #: ``[N]`` largest finite value of each slot's format.
    fp8_max: Tensor = attrs.field(init=False)
    slots: list[Slot] = attrs.Factory(list)
    handles: dict[str, ScalingHandle] = attrs.Factory(dict)
    phase: Phase = Phase.IDLE
    #: Open phase blocks: (the block's phase, the phase to restore on exit).
    blocks: list[tuple[Phase, Phase]] = attrs.Factory(list)
    iteration: int = 0
    #: Bumped whenever scales may change (step, load): invalidates weight casts.
    epoch: int = 0
    #: True once a tensor has been cast: the state's device is then fixed.
    pinned: bool = False
    #: Rows known to have no history yet (always exact while ``history_known``).
    fresh_rows: set[int] = attrs.Factory(set)
    #: True when ``fresh_rows`` lists *every* row without history: before the
    #: first step, and whenever the state is on the CPU, where reading it back
    #: is free. On an accelerator the test is left to the device.
    history_known: bool = True
    #: Names whose forward / backward casts were recorded in this step.
    forward_recorded: set[str] = attrs.Factory(set)
    backward_recorded: set[str] = attrs.Factory(set)
    weight_casts: dict[int, CachedCast] = attrs.Factory(dict)
    #: Debug mode: the forward amaxes of this step per row, not yet matched by a recompute.
    forward_amaxes: dict[int, list[float]] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.history = self._zeros(0, self.history_len)
        self.scales = self._zeros(0)
        self.step_amax = self._zeros(0)
        self.fp8_max = self._zeros(0)

    def _zeros(self, *shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def add_rows(self, slots: list[Slot]) -> list[int]:
        """Append rows for ``slots`` (zero history, scale 1); return their indices."""
        first, k = len(self.slots), len(slots)
        self.history = torch.cat([self.history, self._zeros(k, self.history_len)])
        self.scales = torch.cat([self.scales, self._zeros(k) + 1])
        self.step_amax = torch.cat([self.step_amax, self._zeros(k)])
        maxima = torch.tensor([s.spec.fp8_max for s in slots], dtype=torch.float32, device=self.device)
        self.fp8_max = torch.cat([self.fp8_max, maxima])
        self.slots.extend(slots)
        rows = list(range(first, first + k))
        self.fresh_rows.update(rows)
        return rows

    def to(self, device: torch.device) -> None:
        """Move every buffer to ``device`` (values kept); drop cached weight casts."""
        self.history = self.history.to(device)
        self.scales = self.scales.to(device)
        self.step_amax = self.step_amax.to(device)
        self.fp8_max = self.fp8_max.to(device)
        self.device = device
        self.weight_casts.clear()
        self.refresh_history_rows()

    def refresh_history_rows(self) -> None:
        """Recompute which rows have no history, where that costs no device sync."""
        if self.device.type == "cpu":
            self.fresh_rows = set((self.history[:, -1] <= 0).nonzero().flatten().tolist())
            self.history_known = True
        else:
            self.fresh_rows.clear()
            self.history_known = False

    def end_step(self) -> None:
        """Forget the step's bookkeeping after the buffers were updated."""
        self.iteration += 1
        self.epoch += 1
        self.phase = Phase.IDLE
        self.refresh_history_rows()
        self.forward_recorded.clear()
        self.backward_recorded.clear()
        self.weight_casts.clear()
        self.forward_amaxes.clear()
