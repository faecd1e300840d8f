"""Noticing a forgotten ``manager.step()``: a one-time warning, and what ``stats()`` flags.

Scales change only in :meth:`~scalestate.ScalingStateManager.step`; a loop
that never calls it trains on scale 1 with zero histories, silently. Two
signs tell such a loop from gradient accumulation, however long:

* **Weights updated in place between steps.** Gradient accumulation leaves
  the weights alone until the optimizer steps, and ``manager.step()`` follows
  that optimizer step. A weight that a cast finds modified in place (its
  version counter moved) :data:`WEIGHT_UPDATES_WITHOUT_STEP` times since the
  last ``step()`` means optimizer steps without ``manager.step()``. Three
  rather than one leaves room for a deliberate in-place edit of a weight
  between microbatches. Seen by eager casts of ``WEIGHT`` slots whose
  optimizer bumps the version counter (``torch.optim``'s for-loop and
  ``foreach`` implementations do; ``fused=True`` does not, nor do compiled
  casts, which bypass the weight-cast cache that sees it).
* **Many training passes since the last step.** A pass begins at a
  ``begin_forward()`` (or ``with manager.forward():``), or, in a loop without
  phases, at the first recorded forward cast after a recorded backward cast.
  :data:`PASSES_WITHOUT_STEP` (10,000) is about five times the microbatches of
  the largest batches in use: the large language models of 2020 to 2024
  trained on 1,536 to 2,048 sequences per optimizer step (GPT-3; Llama 2
  and 3), at most 2,048 microbatches on one rank at one sequence each, and
  fewer per rank under data parallelism.

Either sign gives one :class:`~scalestate.errors.MissingStepWarning` per
manager, and makes :meth:`~scalestate.ScalingStateManager.stats` flag the
slots with pending amaxes :attr:`~scalestate.RiskFlag.NO_STEP`.
"""

from __future__ import annotations

import warnings

from scalestate.errors import MissingStepWarning

__all__ = ["PASSES_WITHOUT_STEP", "WEIGHT_UPDATES_WITHOUT_STEP", "StepWatch"]

#: Training passes since the last ``step()`` after which a step is taken to be missing.
PASSES_WITHOUT_STEP = 10_000
#: In-place updates of one weight since the last ``step()`` after which a step is taken to be missing.
WEIGHT_UPDATES_WITHOUT_STEP = 3


class StepWatch:
    """Counts, for one manager, the signs of a missing ``step()`` since the last one."""

    def __init__(self) -> None:
        self._passes = 0
        #: A training pass has begun and no backward has followed yet.
        self._in_pass = False
        #: In-place updates seen since the last step, per weight row.
        self._updates: dict[int, int] = {}
        self._overdue = False
        self._warned = False

    @property
    def passes(self) -> int:
        """Training passes counted since the last ``step()``."""
        return self._passes

    @property
    def overdue(self) -> bool:
        """True once a sign of a missing ``step()`` has been seen since the last one."""
        return self._overdue

    def forward_phase(self) -> None:
        """An explicit training forward begins (``begin_forward()``, ``forward()``)."""
        self._in_pass = True
        self._count_pass()

    def backward_phase(self) -> None:
        """An explicit backward begins: the next forward is a new pass."""
        self._in_pass = False

    def recorded(self, forward: bool) -> None:
        """An eager cast was recorded: a forward one begins a pass unless one is under way."""
        if not forward:
            self._in_pass = False
        elif not self._in_pass:
            self._in_pass = True
            self._count_pass()

    def weight_updated(self, row: int) -> None:
        """A weight cast found its weight modified in place since its last cast in this step."""
        n = self._updates[row] = self._updates.get(row, 0) + 1
        if n >= WEIGHT_UPDATES_WITHOUT_STEP:
            self._missing(
                f"a weight was modified in place {n} times since the last manager.step() (or since the "
                "manager was made), as optimizer.step() does",
                "If you update weights in place between microbatches on purpose, ignore this warning",
            )

    def reset(self) -> None:
        """A step, a discarded step or a load: counting starts again (the warning stays given)."""
        self._passes = 0
        self._in_pass = False
        self._updates.clear()
        self._overdue = False

    def _count_pass(self) -> None:
        self._passes += 1
        if self._passes >= PASSES_WITHOUT_STEP:
            self._missing(
                f"{self._passes:,} training passes recorded amaxes since the last manager.step() (or since "
                "the manager was made)",
                f"If this is gradient accumulation over more than {PASSES_WITHOUT_STEP:,} microbatches, "
                "ignore this warning",
            )

    def _missing(self, what: str, otherwise: str) -> None:
        self._overdue = True
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{what}: scales change only in manager.step(), so without it they stay as they are (1 "
            "before the first step) and no amax history fills. Call manager.step() once per optimizer "
            f"step, after its backward passes. {otherwise} (its category is "
            "scalestate.errors.MissingStepWarning); given once per manager",
            MissingStepWarning,
            stacklevel=2,
        )
