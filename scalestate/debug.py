"""Debug mode: every recompute must reproduce the amaxes of its forward."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scalestate.errors import RecomputeMismatchError

if TYPE_CHECKING:
    from scalestate.state import Slot

__all__ = ["RecomputeChecker"]


class RecomputeChecker:
    """The forward amaxes of the current step, matched off by their recomputes.

    Each recorded forward cast leaves its amax; each recompute of the slot
    must find an equal one (NaN matches NaN), which it then consumes.
    """

    def __init__(self) -> None:
        self._pending: dict[int, list[float]] = {}

    def forward(self, slot: Slot, amax: float) -> None:
        """A recorded forward cast of ``slot`` observed ``amax``."""
        self._pending.setdefault(slot.row, []).append(amax)

    def recompute(self, slot: Slot, amax: float, iteration: int) -> None:
        """A recompute of ``slot`` observed ``amax``; raise unless a forward did too."""
        pending = self._pending.get(slot.row, [])
        for i, seen in enumerate(pending):
            if seen == amax or (math.isnan(seen) and math.isnan(amax)):
                del pending[i]
                return
        forward = f"amax {pending[0]!r}" if pending else "nothing (no unmatched forward cast in this step)"
        raise RecomputeMismatchError(
            f"recompute of slot {slot.name!r} ({slot.role.name}) at step {iteration} observed "
            f"amax {amax!r}, but its forward observed {forward}. The recomputed region is not "
            "deterministic: dropout or other random ops without preserved RNG state, "
            "data-dependent control flow, or an input modified in place between forward and backward"
        )

    def clear(self) -> None:
        """Forget the step's amaxes."""
        self._pending.clear()
