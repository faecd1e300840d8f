"""The non-finite policy: what ``step()`` does with a NaN or infinite step amax (invariant 11).

``"skip"`` (default): the slot keeps its history and scale for that step.
``"raise"``: ``step()`` raises :class:`~scalestate.errors.NonFiniteAmaxError`
naming every offending slot and role, and changes nothing. ``"fallback"``: the
slot forgets its history and scales just in time until a finite step gives it
history again. ``"skip"`` and ``"fallback"`` count the steps per slot, in the
backend's step update, on the state's device (see
:meth:`~scalestate.ScalingStateManager.nonfinite_counts`). In no case does a
non-finite amax yield a non-finite or zero scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias

from torch import Tensor

from scalestate.errors import NonFiniteAmaxError
from scalestate.math import nonfinite_mask

if TYPE_CHECKING:
    from scalestate._engine.state import State

__all__ = ["NONFINITE_POLICIES", "NonFinitePolicy", "refuse_nonfinite"]

NonFinitePolicy: TypeAlias = Literal["skip", "raise", "fallback"]
NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("skip", "raise", "fallback")


def refuse_nonfinite(state: State, step_amax: Tensor) -> None:
    """Raise :class:`NonFiniteAmaxError` if any of ``step_amax`` (``[N]``, one per slot) is NaN
    or infinite. One flag is read back to the host: the cost of the ``"raise"`` policy."""
    bad = nonfinite_mask(step_amax)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten().tolist()
    values = step_amax[rows].tolist()
    slots = state.slots
    named = ", ".join(f"{slots[r].name!r} {slots[r].role.name} ({v})" for r, v in zip(rows, values, strict=True))
    raise NonFiniteAmaxError(
        f"step {state.iteration}: non-finite amax recorded for {len(rows)} slot(s): {named}. step() "
        "changed nothing. Skip this optimizer step and call manager.discard_step(), or reload a good "
        "state with manager.load_state_dict(); with on_nonfinite='skip' (keep the scales) or "
        "'fallback' (scale just in time) training continues by itself"
    )
