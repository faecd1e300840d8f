"""Exceptions raised by scalestate.

Every error a user can cause derives from :class:`ScaleStateError`, and also
from the builtin exception that describes its category (``ValueError``,
``RuntimeError``, ``LookupError``), so code that already catches those keeps
working. Messages say what was expected, what was received and what to do.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CastError",
    "DeviceUnavailableError",
    "MissingStepWarning",
    "NonFiniteAmaxError",
    "PhaseError",
    "RecipeError",
    "RecomputeMismatchError",
    "ReductionError",
    "ScaleStateError",
    "SlotError",
    "SlotMismatchError",
    "StateDictError",
    "UnknownBackendError",
]


class ScaleStateError(Exception):
    """Base class of every error raised by scalestate."""


class RecipeError(ScaleStateError, ValueError):
    """A recipe field has a value outside what it allows."""


class PhaseError(ScaleStateError, RuntimeError):
    """A phase method was called in a phase where it is not allowed."""


class SlotError(ScaleStateError, ValueError):
    """A slot was registered twice, or a role was used that a slot lacks."""


class UnknownBackendError(ScaleStateError, LookupError):
    """No backend is registered under the requested name."""


class BackendUnavailableError(ScaleStateError, RuntimeError):
    """The backend exists but cannot run here; the message says why."""


class StateDictError(ScaleStateError, ValueError):
    """A state dict does not match the manager it is loaded into."""


class CastError(ScaleStateError, ValueError):
    """A tensor handed to a cast or an FP8 product has a dtype or shape it cannot take."""


class RecomputeMismatchError(ScaleStateError, RuntimeError):
    """A recompute cast observed an amax that no recorded forward cast of its slot observed in the step."""


class SlotMismatchError(SlotError):
    """Ranks of a reduction group registered different slots (or recipes); raised on every rank."""


class ReductionError(ScaleStateError, RuntimeError):
    """The step's cross-rank reduction failed: a rank died, raised, or never called ``step()``."""


class NonFiniteAmaxError(ScaleStateError, FloatingPointError):
    """``on_nonfinite="raise"``: a step amax was NaN or infinite; the step changed nothing."""


class DeviceUnavailableError(ScaleStateError, RuntimeError):
    """The device asked for does not exist here: this torch build lacks its support, or the
    machine lacks the device; the message says which, and what to pass instead."""


class MissingStepWarning(UserWarning):
    """Training went on for long without ``manager.step()``, so the scales never changed.

    Given once per manager, after a weight was modified in place 3 times
    between two steps, or after 10,000 training passes without a step (the
    diagnostics guide, "A forgotten step", says why those numbers). Not an
    error: where a step is rightly that long, silence it with
    ``warnings.filterwarnings("ignore", category=MissingStepWarning)``.
    """
