"""The registry of conversions: which layer types :func:`scalestate.nn.convert` swaps, and how.

``torch.nn.Linear`` is registered by default, transformers' ``Conv1D`` as soon
as transformers is in use (see :mod:`scalestate.integrations.transformers`),
and any other type with :func:`register_conversion`. Matching is by exact type
unless a conversion is registered with ``subclasses=True``: a subclass may
compute more than its base in ``forward``, which a swap would lose.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TypeVar

import attrs
import torch

from scalestate.errors import ConversionError, ConversionTypeError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import WeightSlotModule
from scalestate.nn.fsdp import wrap_weight
from scalestate.nn.linear import Linear

__all__ = [
    "ConversionFn",
    "ConversionRequest",
    "adopt_parameters",
    "register_conversion",
    "registered_conversions",
    "unregister_conversion",
]


#: An FP8 module with one weight, as conversions make them.
M = TypeVar("M", bound=WeightSlotModule)


@attrs.frozen
class ConversionRequest:
    """What a conversion function is asked to build: passed to every registered ``fn``.

    A frozen record, so that later versions can add fields without changing
    the signature of the functions already written against it.
    """

    #: The manager that must own the new module's scaling state.
    manager: ScalingStateManager
    #: The slot name to register (the module's path in the model, or for a
    #: model that is itself converted, a free name such as ``"linear"``).
    #: :func:`convert` has checked that it is not taken.
    name: str
    #: Whether FSDP2 should all-gather the new module's weight in FP8 (see
    #: :class:`scalestate.nn.Linear`); a conversion that cannot do so raises.
    fp8_all_gather: bool = False


#: ``fn(module, request) -> new_module``: builds the FP8 replacement of ``module``.
ConversionFn = Callable[[torch.nn.Module, ConversionRequest], torch.nn.Module]


@attrs.frozen
class _Registration:
    fn: ConversionFn
    subclasses: bool


def _convert_linear(module: torch.nn.Module, request: ConversionRequest) -> torch.nn.Module:
    """The default conversion of ``torch.nn.Linear``: a :class:`scalestate.nn.Linear` on its parameters."""
    if not isinstance(module, torch.nn.Linear):
        raise ConversionTypeError(
            f"the torch.nn.Linear conversion got a {type(module).__name__}, not a torch.nn.Linear"
        )
    new = Linear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        manager=request.manager,
        name=request.name,
        device="meta",
        fp8_all_gather=request.fp8_all_gather,
    )
    return adopt_parameters(new, module, request)


#: Every registered conversion, by module type.
_registry: dict[type[torch.nn.Module], _Registration] = {torch.nn.Linear: _Registration(_convert_linear, False)}


def adopt_parameters(new: M, module: torch.nn.Module, request: ConversionRequest) -> M:
    """``new`` (made on ``meta``) takes over ``module``'s ``weight`` and ``bias`` objects and its
    train/eval mode; the weight is wrapped for an FP8 all-gather when the request asks for one."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise ConversionTypeError(
            f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor: nothing to adopt"
        )
    new.weight = wrap_weight(weight, new.handle) if request.fp8_all_gather else weight
    new.bias = module.bias
    new.train(module.training)
    return new


#: Modules of these packages have conversions in an integration, registered when it is imported.
_INTEGRATIONS = {
    "transformers.pytorch_utils": "scalestate.integrations.transformers",
    # every transformers MoE modeling module imports it (its experts' decorator lives there)
    "transformers.integrations.moe": "scalestate.integrations.transformers_moe",
}


def register_conversion(
    module_type: type[torch.nn.Module],
    fn: ConversionFn,
    *,
    replace: bool = False,
    subclasses: bool = False,
) -> None:
    """Make :func:`convert` swap modules of ``module_type`` for what ``fn`` builds.

    ``fn(module, request)`` gets the module to replace and a
    :class:`ConversionRequest` (``manager``, ``name``, ``fp8_all_gather``) and
    returns the FP8 module that takes its place at every path it is reachable
    by. It should register its slots with ``request.manager`` under
    ``request.name`` and take over the *same* parameter objects (so that
    ``state_dict`` keys, tied weights and optimizers built before the
    conversion keep working), and keep the module's ``training`` flag.
    Modules that already cast through a scalestate handle (a ``handle``
    attribute holding a :class:`scalestate.ScalingHandle`) are never converted.

    The registry is process-wide, like that of backends.

    Args:
        module_type: the class to convert (a ``torch.nn.Module`` subclass).
        fn: builds the replacement.
        replace: allow replacing an existing conversion of ``module_type``
            (``torch.nn.Linear``'s default included).
        subclasses: also convert instances of subclasses of ``module_type``
            that have no conversion of their own (default: exact type only,
            since a subclass's ``forward`` may do more than its base's).

    Raises:
        ConversionTypeError: ``module_type`` is not a ``torch.nn.Module`` subclass, or
            ``fn`` is not callable.
        ConversionError: ``module_type`` already has a conversion and ``replace`` is false.

    Example:
        >>> import torch, scalestate as ss
        >>> class Scaled(torch.nn.Linear):  # a subclass: not converted by default
        ...     def forward(self, x):
        ...         return 2 * super().forward(x)
        >>> class FP8Scaled(ss.nn.Linear):
        ...     def forward(self, x):
        ...         return 2 * super().forward(x)
        >>> def to_fp8(module, request):
        ...     new = FP8Scaled(module.in_features, module.out_features, bias=module.bias is not None,
        ...                     manager=request.manager, name=request.name, device="meta")
        ...     new.weight, new.bias = module.weight, module.bias
        ...     return new.train(module.training)
        >>> ss.nn.register_conversion(Scaled, to_fp8)
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> net = ss.nn.convert(torch.nn.Sequential(Scaled(4, 4)), m)
        >>> type(net[0]).__name__, list(m.handles)
        ('FP8Scaled', ['0'])
        >>> ss.nn.unregister_conversion(Scaled)
    """
    if not isinstance(module_type, type) or not issubclass(module_type, torch.nn.Module):
        raise ConversionTypeError(
            f"register_conversion: module_type must be a torch.nn.Module subclass (the class, not an "
            f"instance); got {module_type!r}"
        )
    if not callable(fn):
        raise ConversionTypeError(
            f"register_conversion: fn for {module_type.__qualname__} must be callable as "
            f"fn(module, request) -> torch.nn.Module; got {fn!r}"
        )
    if not isinstance(replace, bool) or not isinstance(subclasses, bool):
        raise ConversionTypeError(
            f"register_conversion: replace and subclasses must be True or False; got replace={replace!r}, "
            f"subclasses={subclasses!r}"
        )
    load_integrations()  # so that an integration's later import cannot shadow this registration
    if module_type in _registry and not replace:
        raise ConversionError(
            f"a conversion of {_type_name(module_type)} is already registered "
            f"({_fn_name(_registry[module_type].fn)}); pass replace=True to replace it"
        )
    _registry[module_type] = _Registration(fn, subclasses)


def unregister_conversion(module_type: type[torch.nn.Module]) -> None:
    """Stop :func:`convert` from converting ``module_type`` (e.g. ``torch.nn.Linear``).

    Raises:
        ConversionError: ``module_type`` has no conversion; the message lists those registered.
    """
    load_integrations()
    if module_type not in _registry:
        have = ", ".join(sorted(_type_name(t) for t in _registry)) or "none"
        raise ConversionError(
            f"no conversion of {_type_name(module_type) if isinstance(module_type, type) else repr(module_type)} "
            f"is registered (registered: {have}); nothing to unregister"
        )
    del _registry[module_type]


def registered_conversions() -> dict[type[torch.nn.Module], ConversionFn]:
    """The module types :func:`convert` converts, each with its conversion (a copy).

    Example:
        >>> import torch, scalestate as ss
        >>> torch.nn.Linear in ss.nn.registered_conversions()
        True
    """
    load_integrations()
    return {module_type: reg.fn for module_type, reg in _registry.items()}


def conversion_for(module: torch.nn.Module) -> ConversionFn | None:
    """The conversion of ``module``: its exact type's, else the nearest base registered with
    ``subclasses=True``; ``None`` for an unregistered type or a module already converted."""
    if isinstance(getattr(module, "handle", None), ScalingHandle):
        return None
    exact = _registry.get(type(module))
    if exact is not None:
        return exact.fn
    for base in type(module).__mro__[1:]:
        reg = _registry.get(base)
        if reg is not None and reg.subclasses:
            return reg.fn
    return None


def build(fn: ConversionFn, module: torch.nn.Module, request: ConversionRequest) -> torch.nn.Module:
    new = fn(module, request)
    if not isinstance(new, torch.nn.Module):
        raise ConversionTypeError(
            f"the conversion of {_type_name(type(module))} ({_fn_name(fn)}) returned "
            f"{type(new).__name__}, not a torch.nn.Module; a conversion returns the module to put in "
            f"its place (see ss.nn.register_conversion)"
        )
    return new


def load_integrations() -> None:
    """Import the integrations whose library the program already uses: they register conversions.

    Importing one never imports its library: only a module already in ``sys.modules`` counts.
    """
    for used, integration in _INTEGRATIONS.items():
        if used not in sys.modules:
            continue
        module = sys.modules.get(integration) or importlib.import_module(integration)
        # An integration whose conversions depend on which of its library's modules are loaded
        # (transformers' model families) registers the newly loaded ones at every call.
        refresh = getattr(module, "register_loaded_families", None)
        if callable(refresh):
            refresh()


def _type_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def _fn_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
