"""The end of a step: its checks, the cross-rank reduction, the non-finite policy, the update.

:func:`run_step` is everything :meth:`ScalingStateManager.step` does after
its phase check, in an order that lets any refusal happen before the state
changes: every check, and the reduction (which only computes), come first;
the step amaxes, histories and scales are written only once nothing can
refuse any more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scalestate.errors import PhaseError
from scalestate.math import ScaleRule
from scalestate.nonfinite import NonFinitePolicy, refuse_nonfinite

if TYPE_CHECKING:
    from scalestate._engine.state import State
    from scalestate.backends import Backend
    from scalestate.distributed import Reduction

__all__ = ["check_forward_recorded", "run_step"]


def check_forward_recorded(state: State) -> None:
    """Raise PhaseError if a name's gradient cast was recorded this step while none of its
    forward casts were (they ran as evaluation), which would leave its forward scales unfed."""
    for name in state.backward_only():
        if any(slot.forward for slot in state.slots if slot.name == name):
            raise PhaseError(
                f"slot {name!r} was cast for GRAD_OUTPUT in this step, but none of its forward "
                "casts was recorded: they ran with grad disabled and no phase set, so they "
                "counted as evaluation. Run the training forward inside "
                "`with manager.forward():` (or after begin_forward())"
            )


def run_step(
    state: State,
    reduction: Reduction,
    backend: Backend,
    recipe: dict[str, Any],
    rule: ScaleRule,
    policy: NonFinitePolicy,
) -> None:
    """Check, reduce, apply the non-finite policy, update; raises before changing anything."""
    try:
        check_forward_recorded(state)
    except PhaseError:
        reduction.reduce(state, recipe, refused=True)  # the other ranks learn it: no hang
        raise
    reduced = reduction.reduce(state, recipe)
    if policy is NonFinitePolicy.RAISE:
        refuse_nonfinite(state, state.step_amax if reduced is None else reduced)
    if reduced is not None:
        state.step_amax.copy_(reduced)
    fallback = policy is NonFinitePolicy.FALLBACK
    backend.update(state.step_update(rule, count=policy is not NonFinitePolicy.RAISE, forget=fallback))
    state.freeze()
    state.end_step(histories_may_vanish=fallback)
