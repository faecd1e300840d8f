"""Exceptions raised by scalestate.

Every error a user can cause is one of the classes here: it derives from
:class:`ScaleStateError`, and also from the builtin exception that describes
its category (``ValueError``, ``TypeError``, ``RuntimeError``, ``LookupError``,
``ImportError``, ...), so code that already catches those keeps working.
Nothing in scalestate raises a bare builtin exception or a bare
:class:`ScaleStateError` (a test of the package's source checks it).
Messages say what was expected, what was received and what to do.

Example:
    >>> import scalestate as ss
    >>> from scalestate.errors import ArgumentValueError, ScaleStateError
    >>> try:
    ...     ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite="ignore")
    ... except ArgumentValueError as e:
    ...     isinstance(e, ScaleStateError), isinstance(e, ValueError)
    (True, True)
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "BackendUnavailableError",
    "CastError",
    "ConversionError",
    "ConversionTypeError",
    "MissingDependencyError",
    "DeviceUnavailableError",
    "MissingStepWarning",
    "NonFiniteAmaxError",
    "PhaseError",
    "ReadOnlyError",
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
    """Base class of every error raised by scalestate; ``except ScaleStateError`` catches them all.

    Never raised itself: each error is one of the subclasses below.
    """


class ArgumentTypeError(ScaleStateError, TypeError):
    """An object of the wrong type was handed to scalestate.

    Raised when a ``manager=`` is not a :class:`~scalestate.ScalingStateManager`,
    a flag (``collect_stats``, ``fp8_all_gather``, ``restore``, ...) is not
    ``True`` or ``False``, a factory or callback is not callable, ``group=`` is
    not a process group, a device mesh or ``None``, a ``recipe`` is not a
    recipe, a backend lacks a member of :class:`scalestate.backends.Backend`,
    or a manager built with an explicit process group is pickled (a process
    group cannot leave its process; save ``manager.state_dict()`` instead).
    """


class ArgumentValueError(ScaleStateError, ValueError):
    """An argument has the right type but a value, or a combination with others, that is not allowed.

    Raised for a choice outside its allowed values (``on_nonfinite``, a
    backend's ``fallback``), a malformed or taken backend name (pass
    ``replace=True`` to replace one), a ``group=`` this build or this mesh
    cannot give (no ``torch.distributed``, a mesh of more than one dimension,
    an unknown mesh dimension), ``context_fn`` with ``use_reentrant=True``,
    ``fp8_all_gather=True`` with a manager whose step does not reduce over
    FSDP's shard group, and bad settings of the bundled demo.
    """


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
    """A tensor handed to a cast, to an FP8 product or to :class:`~scalestate.Quantized` cannot be used as it is.

    Raised for a dtype, shape or device it cannot take: a non-float tensor
    cast, ``transpose=True`` for one that is not 2-d, a tensor on another
    device than a manager whose state is already in use there, an FP8 layer's
    input of the wrong width, :class:`~scalestate.Quantized` data that is not
    FP8, or built without ``scale`` and ``scale_inv``, transposed when not
    2-d, or asked for a columnwise orientation it does not hold; also for a
    fine-grained recipe where only per-tensor scales serve (tensor-parallel
    layers, ``fp8_all_gather=True``).
    """


class RecomputeMismatchError(ScaleStateError, RuntimeError):
    """A recompute cast observed an amax that no recorded forward cast of its slot observed in the step."""


class SlotMismatchError(SlotError):
    """Ranks of a reduction group registered different slots (or recipes); raised on every rank."""


class ReductionError(ScaleStateError, RuntimeError):
    """The step's cross-rank reduction failed: a rank died, raised, or never called ``step()``."""


class NonFiniteAmaxError(ScaleStateError, FloatingPointError):
    """``on_nonfinite="raise"``: a step amax was NaN or infinite; the step changed nothing."""


class ConversionError(ScaleStateError, ValueError):
    """A model conversion cannot be done as asked; the model is unchanged, and the message names the alternative.

    Raised by :func:`scalestate.nn.convert`, the conversion registry
    (:func:`scalestate.nn.register_conversion` for a type that already has a
    conversion without ``replace=True``, ``unregister_conversion`` for one
    that has none) and the integrations' converters (for the torchao adapter:
    a config, a recipe or a model it does not serve); also for a ``prefix``
    that is not a dotted path, and a layer holding a child module, parameter
    or buffer under a name its FP8 version uses itself, so that keeping it
    would lose something (found once the FP8 layers are built: their slots
    stay registered).
    """


class ConversionTypeError(ConversionError, ArgumentTypeError):
    """A conversion got an argument of the wrong type, or a conversion function returned one.

    For instance a ``model`` that is not a ``torch.nn.Module``, a ``filter_fn``
    that is not callable, a conversion function handed a module it does not
    convert or returning something other than a module.
    """


class MissingDependencyError(ScaleStateError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that adds it.

    Raised on importing an integration without its library
    (``scalestate.integrations.torchao`` needs torchao,
    ``scalestate.integrations.transformers`` needs transformers and, for the
    Trainer, accelerate), and by ``scalestate plot`` without matplotlib.
    """


class ReadOnlyError(ScaleStateError, AttributeError):
    """An attribute of a read-only object was set or deleted (:class:`~scalestate.Quantized` is immutable)."""


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
