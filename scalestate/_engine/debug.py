"""Debug mode: every recompute must reproduce an amax its forward observed.

What is checked, exactly: per slot of a forward role (``INPUT``, ``WEIGHT``)
and per step, the amaxes of the slot's recorded forward casts are kept (as
host floats: debug mode syncs). Every recompute cast of the slot must observe
one of them, bit for bit as a float32 value (every NaN matches every NaN).
A forward amax may be recomputed any number of times: nested checkpointed
regions, a recompute outside autograd (``begin_recompute()``) of a stage that
checkpoints inside, and selective checkpointing all recompute one forward
more than once. The check cannot tell which forward a recompute stands for:
a recompute that reproduces exactly the amax of another forward cast of the
same slot in the same step (another microbatch's) passes. Evaluation casts
and backward roles are not checked. Everything is forgotten at each step,
``discard_step()`` and load.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scalestate.errors import RecomputeMismatchError

if TYPE_CHECKING:
    from scalestate._engine.state import Slot

__all__ = ["RecomputeChecker"]

#: How many of a slot's forward amaxes an error message lists.
_SHOWN = 4


def _key(amax: float) -> float | str:
    """``amax`` as a set member: every NaN is one value."""
    return "nan" if math.isnan(amax) else amax


class RecomputeChecker:
    """The forward amaxes of the current step, against which every recompute is checked."""

    def __init__(self) -> None:
        #: Per slot row: the distinct amaxes its recorded forward casts observed, in order.
        self._seen: dict[int, dict[float | str, None]] = {}

    def forward(self, slot: Slot, amax: float) -> None:
        """A recorded forward cast of ``slot`` observed ``amax``."""
        self._seen.setdefault(slot.row, {})[_key(amax)] = None

    def recompute(self, slot: Slot, amax: float, iteration: int) -> None:
        """A recompute of ``slot`` observed ``amax``; raise unless a forward cast of the step did too."""
        seen = self._seen.get(slot.row, {})
        if _key(amax) in seen:
            return
        if seen:
            values = [float(v) for v in seen]
            shown = ", ".join(repr(v) for v in values[:_SHOWN])
            more = f" and {len(values) - _SHOWN} more" if len(values) > _SHOWN else ""
            forward = f"amax {shown}{more}"
        else:
            forward = "nothing (no recorded forward cast of this slot in this step)"
        raise RecomputeMismatchError(
            f"recompute of slot {slot.name!r} ({slot.role.name}) at step {iteration} observed "
            f"amax {amax!r}, but its forward casts in this step observed {forward}. The recomputed "
            "region is not deterministic: dropout or other random ops without preserved RNG state, "
            "data-dependent control flow, or an input modified in place between forward and backward"
        )

    def clear(self) -> None:
        """Forget the step's amaxes."""
        self._seen.clear()
