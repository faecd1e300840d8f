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

import enum
from typing import TYPE_CHECKING, Literal, TypeAlias

from torch import Tensor

from scalestate.errors import ArgumentValueError, NonFiniteAmaxError
from scalestate.math import nonfinite_mask

if TYPE_CHECKING:
    from scalestate._engine.state import State

__all__ = ["NONFINITE_POLICIES", "NonFinitePolicy", "NonFinitePolicyName", "parse_policy", "refuse_nonfinite"]


class NonFinitePolicy(str, enum.Enum):
    """What ``step()`` does with a slot whose step amax is NaN or infinite.

    ``ScalingStateManager(on_nonfinite=...)`` takes a member or its string
    value (``"skip"``) and holds the member. A ``str`` enum: each member equals
    its value (``NonFinitePolicy.SKIP == "skip"``).

    Example:
        >>> import scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite="fallback")
        >>> m.on_nonfinite is ss.NonFinitePolicy.FALLBACK, m.on_nonfinite == "fallback"
        (True, True)
    """

    #: Keep the slot's history and scale for that step (counted).
    SKIP = "skip"
    #: Raise :class:`~scalestate.errors.NonFiniteAmaxError` and change nothing.
    RAISE = "raise"
    #: Forget the slot's history; scale just in time until a finite step (counted).
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value


#: The string values ``on_nonfinite`` also accepts.
NonFinitePolicyName: TypeAlias = Literal["skip", "raise", "fallback"]
#: Every policy, in the order messages list them.
NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = tuple(NonFinitePolicy)


def parse_policy(value: NonFinitePolicy | NonFinitePolicyName) -> NonFinitePolicy:
    """The member ``value`` names (a member, or its string value).

    Raises:
        ArgumentValueError: ``value`` is neither; the message lists the policies.
    """
    if isinstance(value, str):
        try:
            return NonFinitePolicy(value)
        except ValueError:
            pass
    names = ", ".join(repr(p.value) for p in NONFINITE_POLICIES)
    raise ArgumentValueError(f"on_nonfinite must be one of {names}; got {value!r}")


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
