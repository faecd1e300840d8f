"""The manager's phase API: ``begin_*()``, the phase blocks, :meth:`step` and :meth:`discard_step`.

:class:`PhaseControl` is a base of :class:`scalestate.ScalingStateManager`
and nothing else; its methods are documented (and public) there. It holds no
state of its own: it drives the manager's :class:`~scalestate._engine.state.State`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from scalestate._engine.stepping import run_step
from scalestate.errors import ScaleStateError
from scalestate.phase import Phase

if TYPE_CHECKING:
    from scalestate._engine.binding import BackendBinding
    from scalestate._engine.state import State
    from scalestate.distributed import Reduction
    from scalestate.math import ScaleRule
    from scalestate.nonfinite import NonFinitePolicy

__all__ = ["PhaseControl"]

_Self = TypeVar("_Self", bound="PhaseControl")


class PhaseControl:
    """The phases and the step of a :class:`scalestate.ScalingStateManager` (see there)."""

    _state: State
    _binding: BackendBinding
    _reduction: Reduction
    _recipe_dict: dict[str, Any]
    _rule: ScaleRule
    _on_nonfinite: NonFinitePolicy
    #: The last step() raised: the step may be discarded or a state loaded mid-step.
    _refused: bool

    def begin_forward(self) -> None:
        """Enter the training forward phase (lasts until another ``begin_*()`` or :meth:`step`)."""
        self._state.phases.begin(Phase.FORWARD, "begin_forward()")
        self._state.watch.forward_phase()

    def begin_recompute(self) -> None:
        """Enter the recompute phase: forward casts use the step's scales and record nothing.

        For frameworks that recompute outside autograd; torch's checkpoint
        mechanisms are recognised without it.
        """
        self._state.phases.begin(Phase.RECOMPUTE, "begin_recompute()")

    def begin_backward(self) -> None:
        """Enter the backward phase: gradient casts are recorded; forward casts are recomputes."""
        self._state.phases.begin(Phase.BACKWARD, "begin_backward()")
        self._state.watch.backward_phase()

    def forward(self: _Self) -> contextlib.AbstractContextManager[_Self]:
        """A training forward block: ``with manager.forward(): loss = model(x)``."""
        return self._block(Phase.FORWARD)

    def recompute(self: _Self) -> contextlib.AbstractContextManager[_Self]:
        """A recompute block (allowed inside any other block)."""
        return self._block(Phase.RECOMPUTE)

    def backward(self: _Self) -> contextlib.AbstractContextManager[_Self]:
        """A backward block: ``with manager.backward(): loss.backward()``."""
        return self._block(Phase.BACKWARD)

    @contextlib.contextmanager
    def _block(self: _Self, phase: Phase) -> Iterator[_Self]:
        with self._state.phases.block(phase):
            if phase is Phase.FORWARD and len(self._state.phases.blocks) == 1:  # nested: the same pass
                self._state.watch.forward_phase()
            elif phase is Phase.BACKWARD:
                self._state.watch.backward_phase()
            yield self

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        """End the step: roll every history, derive new scales, clear the accumulators.

        Call once per optimizer step, after all microbatches' backward passes,
        on every rank of the group. With a group of more than one rank, the
        step amaxes are first max-reduced across it by one ``all_reduce``
        (the first step after registration changed also checks, once, that
        every rank registered the same slots). Then one fused backend update
        for all slots; no host-device sync. Resets the calling thread's phase
        to ``IDLE``.

        A step that raises changes nothing: the manager stays usable. Run the
        step again, drop it with :meth:`discard_step`, or load a good state
        with :meth:`load_state_dict`.

        Raises:
            PhaseError: called inside a phase block, or a slot's backward was
                recorded while none of its forward casts were (they counted as
                evaluation), which would leave its forward scales unfed.
            NonFiniteAmaxError: ``on_nonfinite="raise"`` and a slot's step amax
                is NaN or infinite.
            SlotMismatchError: (on every rank) the ranks of the group
                registered different slots or use different recipes.
            ReductionError: the reduction failed: another rank died, raised
                before step(), or did not call step() within the group's timeout.
        """
        st = self._state
        st.phases.require_no_block(
            "step()", "call step() once per optimizer step, after the forward and backward blocks have closed"
        )
        try:
            run_step(st, self._reduction, self._binding.backend, self._recipe_dict, self._rule, self._on_nonfinite)
        except ScaleStateError:
            self._refused = True
            raise
        st.phases.phase = Phase.IDLE
        self._refused = False

    def discard_step(self) -> None:
        """Drop everything recorded since the last :meth:`step`, as if those passes had not run.

        For loops that skip an optimizer step (a NaN loss, as ``GradScaler``
        skips), or after :meth:`step` refused one. Scales and histories are
        unchanged; the calling thread's phase returns to ``IDLE``; cached
        weight casts are dropped.
        """
        st = self._state
        st.phases.require_no_block("discard_step()", "call it between steps, after the blocks have closed")
        st.discard()
        st.phases.phase = Phase.IDLE
        self._refused = False
