"""Phases, and how each cast is classified.

The manager has an explicit phase, set by ``begin_*()`` calls or the
``forward()`` / ``recompute()`` / ``backward()`` blocks. A cast of a
forward role (``INPUT``, ``WEIGHT``) is then one of:

* **recorded**: a training forward; its amax goes into the step accumulator;
* **recompute**: activation checkpointing re-running a forward; it uses the
  same scales and records nothing;
* **evaluation**: not training; it uses the scales and records nothing.

Casts of backward roles (``GRAD_OUTPUT``) are always recorded.

Recompute is recognised, in this order, by: the explicit ``RECOMPUTE`` phase;
a region marked by :func:`scalestate.checkpoint`; or the cast running inside
autograd's backward (every torch checkpoint mechanism recomputes there).

With no explicit phase, a forward cast with grad enabled is recorded and one
with grad disabled is evaluation, except inside the forward of
``torch.utils.checkpoint(use_reentrant=True)``, which runs under ``no_grad``
and is recognised as training.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import sys
from collections.abc import Iterator
from types import CodeType, FrameType

import torch

__all__ = ["CastKind", "Phase"]


class Phase(enum.Enum):
    """The manager's explicit phase."""

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


# Markers of the running code, like torch's grad mode: they describe the
# region being executed, not any manager's state, so every manager sees them.
_recompute_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "scalestate_recompute_depth", default=0
)
_training_forward_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "scalestate_training_forward_depth", default=0
)


@contextlib.contextmanager
def _marked(var: contextvars.ContextVar[int]) -> Iterator[None]:
    token = var.set(var.get() + 1)
    try:
        yield
    finally:
        var.reset(token)


def recompute_region() -> contextlib.AbstractContextManager[None]:
    """Mark the code run inside as a recompute, for every manager."""
    return _marked(_recompute_depth)


def training_forward_region() -> contextlib.AbstractContextManager[None]:
    """Mark the code run inside as a training forward even with grad disabled."""
    return _marked(_training_forward_depth)


def in_marked_recompute() -> bool:
    """True inside :func:`recompute_region`."""
    return _recompute_depth.get() > 0


def in_marked_training_forward() -> bool:
    """True inside :func:`training_forward_region`."""
    return _training_forward_depth.get() > 0


def in_autograd_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return bool(torch._C._current_graph_task_id() != -1)


def _reentrant_forward_code() -> CodeType | None:
    fn = getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None)
    return getattr(fn, "__code__", None)


_REENTRANT_FORWARD = _reentrant_forward_code()


def in_reentrant_checkpoint_forward() -> bool:
    """True inside a training forward of ``torch.utils.checkpoint(use_reentrant=True)``.

    That forward runs its function under ``torch.no_grad()``, which would
    otherwise read as evaluation. It is training when one of its tensor inputs
    requires grad (without one, torch's reentrant checkpoint produces no
    gradients at all: that is an evaluation pass through a checkpointed model).
    Only consulted for casts with grad disabled and no explicit phase, so
    training with grad enabled, and explicit loops, never pay for the look.
    """
    if _REENTRANT_FORWARD is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            args = frame.f_locals.get("args", ())
            return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        frame = frame.f_back
    return False
