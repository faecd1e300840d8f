"""Phases, and how each cast is classified.

The manager has an explicit phase *per thread* (like torch's grad mode), set
by ``begin_*()`` calls or the ``forward()`` / ``recompute()`` / ``backward()``
blocks. A cast of a forward role (``INPUT``, ``WEIGHT``) is then one of:

* **recorded**: a training forward; its amax goes into the step accumulator;
* **recompute**: activation checkpointing re-running a forward; it uses the
  same scales and records nothing;
* **evaluation**: not training; it uses the scales and records nothing.

Casts of backward roles (``GRAD_OUTPUT``) are always recorded.

:func:`classify` decides, as a pure function of the :class:`Signals` read at
the cast. Recompute is recognised, in this order, by: the explicit
``RECOMPUTE`` phase; a region marked by :func:`scalestate.checkpoint`; or the
cast running inside autograd's backward (every torch checkpoint mechanism
recomputes there). With no explicit phase, a forward cast with grad enabled
is recorded. One with grad disabled is evaluation, unless it runs inside the
forward of an ``autograd.Function`` through which torch will propagate
gradients: the forward of ``torch.utils.checkpoint(use_reentrant=True)``
runs its region under ``no_grad`` in a training pass, and only there does
torch wire the Function's graph node to its inputs. Under a user's
``torch.no_grad()`` no node is wired, so no gradient can flow: evaluation.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NamedTuple

import torch
from torch.autograd.function import BackwardCFunction

from scalestate.errors import PhaseError
from scalestate.recipe import Direction

__all__ = ["CastKind", "Phase", "PhaseStack", "Signals", "classify", "read_signals"]


class Phase(enum.Enum):
    """The manager's explicit phase (per thread)."""

    #: No phase set: between steps, or a loop that sets none.
    IDLE = "idle"
    #: A training forward pass.
    FORWARD = "forward"
    #: Activation checkpointing re-running a forward pass.
    RECOMPUTE = "recompute"
    #: A backward pass.
    BACKWARD = "backward"


class CastKind(enum.Enum):
    """What a single cast counts as."""

    RECORD = "record"
    RECOMPUTE = "recompute"
    EVALUATION = "evaluation"
    #: A forward cast with grad enabled in the BACKWARD phase, outside
    #: autograd's backward: a new forward without begin_forward(). An error.
    MISPLACED = "misplaced"
    #: Made ahead of its use (``quantize(..., ahead_of_use=True)``, e.g. before FSDP's
    #: all-gather), whatever the signals: records nothing; the use, a later cast of
    #: the same tensor (a weight-cache hit), is classified and recorded. Never from
    #: :func:`classify`.
    AHEAD = "ahead"


class PhaseStack(threading.local):
    """One manager's phase and open blocks, separately for every thread."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        #: Open blocks: (the block's phase, the phase to restore on exit).
        self.blocks: list[tuple[Phase, Phase]] = []

    def __reduce__(self) -> tuple[object, tuple[Phase]]:
        """A copy (pickled, deep-copied) has the calling thread's phase, and no open blocks
        (they belong to the ``with`` statements of the original)."""
        return _phases_at, (self.phase,)

    def begin(self, phase: Phase, call: str) -> None:
        """Switch to ``phase`` (``call`` names the method for errors); recompute may start inside a block."""
        if self.blocks and phase is not Phase.RECOMPUTE:
            raise PhaseError(
                f"{call} called inside `with manager.{self.blocks[-1][0].value}()`, which sets the "
                "phase itself and restores it on exit; leave the block first, or use either "
                "the blocks or the begin_*() calls, not both"
            )
        self.phase = phase

    @contextlib.contextmanager
    def block(self, phase: Phase) -> Iterator[None]:
        """Set ``phase`` for the block and restore the previous one on exit, also on error."""
        if phase is not Phase.RECOMPUTE:
            for open_phase, _ in self.blocks:
                if open_phase is not phase:
                    raise PhaseError(
                        f"`with manager.{phase.value}()` entered inside `with manager.{open_phase.value}()`; "
                        f"close the {open_phase.value} block before starting a {phase.value} block"
                    )
        self.blocks.append((phase, self.phase))
        self.phase = phase
        try:
            yield
        finally:
            _, self.phase = self.blocks.pop()

    def require_no_block(self, call: str, fix: str) -> None:
        """Raise a PhaseError naming ``call``, the open block and ``fix`` if a block is open."""
        if self.blocks:
            raise PhaseError(f"{call} called inside `with manager.{self.blocks[-1][0].value}()`; {fix}")


def _phases_at(phase: Phase) -> PhaseStack:
    """A PhaseStack whose creating thread is in ``phase`` (other threads start IDLE)."""
    stack = PhaseStack()
    stack.phase = phase
    return stack


class _Marks(threading.local):
    """Markers of the code being run on this thread, like torch's grad mode: they
    describe a region (set by :func:`scalestate.checkpoint`), not any manager's
    state, so every manager sees them."""

    recompute = 0
    training = 0


_marks = _Marks()


@contextlib.contextmanager
def _marked(mark: str) -> Iterator[None]:
    setattr(_marks, mark, getattr(_marks, mark) + 1)
    try:
        yield
    finally:
        setattr(_marks, mark, getattr(_marks, mark) - 1)


def recompute_region() -> contextlib.AbstractContextManager[None]:
    """Mark the code run inside as a recompute, for every manager."""
    return _marked("recompute")


def training_forward_region() -> contextlib.AbstractContextManager[None]:
    """Mark the code run inside as a training forward even with grad disabled."""
    return _marked("training")


class Signals(NamedTuple):
    """What the code around a cast says about it (read by :func:`read_signals`)."""

    #: The calling thread's explicit phase.
    phase: Phase
    #: ``torch.is_grad_enabled()``.
    grad_enabled: bool
    #: Whether autograd's engine runs a backward on this thread; ``None`` where
    #: it cannot be known (while ``torch.compile`` traces).
    in_backward: bool | None
    #: Inside :func:`recompute_region`.
    recompute_mark: bool
    #: Inside :func:`training_forward_region`.
    training_mark: bool


def read_signals(phase: Phase, *, compiling: bool) -> Signals:
    """The signals of the current thread for a cast made now."""
    in_backward = None if compiling else torch._C._current_graph_task_id() != -1
    return Signals(phase, torch.is_grad_enabled(), in_backward, _marks.recompute > 0, _marks.training > 0)


def classify(
    direction: Direction, signals: Signals, in_training_function: Callable[[], bool] | None = None
) -> CastKind:
    """What a cast of a role of ``direction`` counts as, given ``signals``.

    Args:
        direction: the role's direction; backward casts are always recorded.
        signals: read at the cast.
        in_training_function: asked only for a forward cast with grad disabled
            and no phase, mark or backward to decide it (it may be slow):
            whether the cast runs inside the forward of an ``autograd.Function``
            that torch will propagate gradients through. ``None`` where that
            cannot be asked (while compiling): such a cast is evaluation.
    """
    if direction is Direction.BACKWARD:
        return CastKind.RECORD
    if signals.phase is Phase.RECOMPUTE or signals.recompute_mark or signals.in_backward:
        return CastKind.RECOMPUTE
    if signals.phase is Phase.FORWARD or signals.training_mark:
        return CastKind.RECORD
    if signals.phase is Phase.BACKWARD:
        if not signals.grad_enabled:
            return CastKind.EVALUATION
        # While compiling, the engine's state is unknown; a forward cast with grad
        # enabled in the BACKWARD phase can then only be a recompute.
        return CastKind.RECOMPUTE if signals.in_backward is None else CastKind.MISPLACED
    if signals.grad_enabled:
        return CastKind.RECORD
    if in_training_function is not None and in_training_function():
        return CastKind.RECORD
    return CastKind.EVALUATION


def in_training_function_forward() -> bool:
    """True inside the forward of an ``autograd.Function`` that gradients will flow through.

    ``Function.apply`` runs ``forward`` under ``no_grad`` whatever the caller's
    grad mode; torch wires the Function's graph node (its ``ctx``, the first
    argument of ``forward``) to the inputs that need gradients only when grad
    was enabled at the call. A wired node is therefore a training pass; an
    unwired one is not. Walks this thread's stack; not inside ``torch.compile``.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount:
            ctx = frame.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, BackwardCFunction) and any(node is not None for node, _ in ctx.next_functions):
                return True
        frame = frame.f_back
    return False
