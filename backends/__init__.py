"""Backend registry: names to factories.

Design requirement: importing scalestate imports no backend. A backend module is
imported the first time a manager asks for it by name, so a backend with heavy
or optional dependencies costs nothing until used.

Built in:

* ``emulation``: pure torch, any device; the reference.
* ``scaled_mm``: torch's scaled-matmul kernels (CUDA sm89+, or CPU in recent
  torch); fine-grained recipes where torch's kernels take them (see
  :mod:`scalestate.backends.scaled_mm`). ``ScaledMMBackend(fallback="emulation")``
  emulates the products they cannot run.

Whether a backend runs a recipe on a device: :func:`supports`.

Third parties register with :func:`register_backend`, or without any import
through the entry-point group ``scalestate.backends`` (the entry point names a
factory: any callable returning a backend, a class included)::

    [project.entry-points."scalestate.backends"]
    mykernels = "mypkg.fp8:MyBackend"

:func:`unregister_backend` takes a registration out again (a test's, say).

This table is the one process-wide registry in scalestate. It holds factories
only: every manager calls the factory and owns the backend instance it gets,
so two managers never share backend state.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Callable

import torch

from scalestate.backends.base import (
    Backend,
    CastRequest,
    CastSpec,
    GroupedCastRequest,
    GroupedOperand,
    GroupedRows,
    StepUpdate,
    SupportsDeviceGroups,
    SupportsGroupedCast,
    SupportsRecipe,
    granularity_label,
    recipe_granularities,
)
from scalestate.errors import ArgumentTypeError, ArgumentValueError, BackendUnavailableError, UnknownBackendError
from scalestate.recipe import Recipe

__all__ = [
    "Backend",
    "BackendFactory",
    "CastRequest",
    "CastSpec",
    "GroupedCastRequest",
    "GroupedOperand",
    "GroupedRows",
    "StepUpdate",
    "SupportsDeviceGroups",
    "SupportsGroupedCast",
    "SupportsRecipe",
    "available_backends",
    "check_backend",
    "check_supports",
    "get_backend",
    "register_backend",
    "unregister_backend",
    "resolve_backend",
    "supports",
    "validate_backend",
]

ENTRY_POINT_GROUP = "scalestate.backends"

#: Anything that returns a backend when called with no arguments.
BackendFactory = Callable[[], Backend]

_log = logging.getLogger("scalestate")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")

#: Built-in backends, imported lazily from "module:attribute".
_BUILTIN: dict[str, str] = {
    "emulation": "scalestate.backends.emulation:EmulationBackend",
    "scaled_mm": "scalestate.backends.scaled_mm:ScaledMMBackend",
    "cuda": "scalestate.backends.cuda:CudaBackend",
}
#: Preference of ``backend="auto"`` per device type, best first.
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    # On CUDA, FP8 tensor cores beat a float32 product of dequantized operands.
    "cuda": ("cuda", "scaled_mm", "emulation"),
    # On CPU, torch._scaled_mm is slower than the emulation's float32 GEMM
    # (see benchmarks), so the reference is also the fastest.
    "cpu": ("emulation",),
}

_registry: dict[str, str | BackendFactory] = dict(_BUILTIN)
#: Names unregistered in this process: an entry point of one of them is not loaded again.
_withdrawn: set[str] = set()


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available as ``ScalingStateManager(..., backend=name)``.

    Args:
        name: letters, digits, ``_``, ``.``, ``-``; not ``"auto"``.
        factory: called with no arguments, once per manager, returns a backend.
        replace: allow replacing an existing registration of ``name``.

    Raises:
        ArgumentValueError: the name is taken (and ``replace`` is false) or malformed.
        ArgumentTypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not _NAME.match(name) or name == "auto":
        raise ArgumentValueError(
            f"backend name must match {_NAME.pattern} and not be 'auto'; got {name!r}"
        )
    if not callable(factory):
        raise ArgumentTypeError(f"factory for backend {name!r} must be callable; got {factory!r}")
    if name in _registry and not replace:
        raise ArgumentValueError(
            f"a backend named {name!r} is already registered; "
            "pass replace=True to replace it, or choose another name"
        )
    _registry[name] = factory
    _withdrawn.discard(name)


def unregister_backend(name: str) -> None:
    """Take back what :func:`register_backend` (or an entry point) registered as ``name``.

    Managers made before keep the backend instance they have. A built-in
    name is never removed (``"auto"`` and every manager that names it rely on
    it): unregistering a built-in that ``register_backend(...,
    replace=True)`` replaced restores the built-in backend. A name that came
    from an entry point is not loaded from it again in this process;
    :func:`register_backend` brings the name back.

    Args:
        name: a registered name.

    Raises:
        UnknownBackendError: nothing is registered as ``name``, or ``name`` is
            a built-in backend that was never replaced; the message lists the
            names that can be unregistered.

    Example:
        >>> import scalestate as ss
        >>> from scalestate.backends.emulation import EmulationBackend
        >>> ss.backends.register_backend("mine", EmulationBackend)
        >>> ss.backends.unregister_backend("mine")
        >>> "mine" in ss.backends.available_backends()
        False
    """
    if name not in _registry:
        _load_entry_points()
    builtin = _BUILTIN.get(name)
    if name not in _registry or _registry[name] == builtin:
        removable = [n for n in _registered_names() if _registry[n] != _BUILTIN.get(n)]
        what = (
            f"{name!r} is a built-in backend, which cannot be removed (a replacement of it can)"
            if builtin is not None
            else f"no backend named {name!r} is registered"
        )
        raise UnknownBackendError(
            f"cannot unregister {name!r}: {what}; registered by register_backend() or an entry point: "
            f"{', '.join(removable) or 'none'}"
        )
    if builtin is not None:
        _registry[name] = builtin
    else:
        del _registry[name]
        _withdrawn.add(name)


def _load_entry_points() -> None:
    """Register every entry point of the group whose name is not registered yet (nor unregistered)."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _withdrawn:
            continue
        if not _NAME.match(ep.name) or ep.name == "auto":
            _log.warning("scalestate: ignoring backend entry point %r (%s): invalid name", ep.name, ep.value)
            continue
        _registry.setdefault(ep.name, ep.value)


def _registered_names() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def get_backend(name: str) -> Backend:
    """A new instance of the backend registered as ``name``.

    Raises:
        UnknownBackendError: nothing is registered under ``name``; the message
            lists what is.
    """
    if name not in _registry:
        _load_entry_points()
    if name not in _registry:
        raise UnknownBackendError(
            f"no backend named {name!r}; registered: {', '.join(_registered_names())} "
            "(or 'auto'). Register one with scalestate.backends.register_backend()"
        )
    target = _registry[name]
    factory = _import(target) if isinstance(target, str) else target
    return validate_backend(factory(), name)


def validate_backend(backend: object, registered_as: str | None = None) -> Backend:
    """``backend`` if it has every member of :class:`Backend`, else an :class:`~scalestate.errors.ArgumentTypeError`."""
    label = f"backend {registered_as!r} ({type(backend).__qualname__})" if registered_as else (
        f"backend {type(backend).__qualname__}"
    )
    for member in ("available", "cast", "wants_transposed", "scaled_mm", "update"):
        if not callable(getattr(backend, member, None)):
            hint = (
                " (quantize(x, scale, spec, jit) became cast(request: CastRequest) in scalestate 0.2)"
                if member == "cast" and callable(getattr(backend, "quantize", None))
                else ""
            )
            raise ArgumentTypeError(
                f"{label} has no method {member}(){hint}; see scalestate.backends.Backend for the interface"
            )
    if not isinstance(getattr(backend, "name", None), str):
        raise ArgumentTypeError(f"{label} has no string attribute 'name'")
    return backend  # type: ignore[return-value]  # checked member by member above


def _import(target: str) -> BackendFactory:
    module, _, attribute = target.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module), attribute)
    return factory


def available_backends(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """Every registered backend, with whether it can run on ``device`` and why.

    Example:
        >>> import scalestate as ss
        >>> ss.backends.available_backends("cpu")["emulation"]
        (True, 'pure torch: runs on any device')
    """
    dev = None if device is None else torch.device(device)
    report: dict[str, tuple[bool, str]] = {}
    for name in _registered_names():
        try:
            report[name] = get_backend(name).available(dev)
        except Exception as exc:  # a broken third-party backend must not hide the others
            report[name] = (False, f"failed to load: {type(exc).__name__}: {exc}")
    return report


def supports(backend: Backend, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``backend`` runs every cast and product of ``recipe`` on ``device``, and why.

    Asks the backend's optional ``supports(recipe, device)`` method (see
    :class:`SupportsRecipe`) when it has one. A backend without it is taken
    to run per-tensor recipes wherever :meth:`Backend.available` says it
    runs, and no fine-grained recipe (it cannot be known to read
    ``CastSpec.granularity``).

    Example:
        >>> import scalestate as ss
        >>> from scalestate.backends.emulation import EmulationBackend
        >>> ss.backends.supports(EmulationBackend(), ss.MXFP8Scaling(), "cpu")
        (True, 'pure torch: runs every recipe on any device')
    """
    method = getattr(backend, "supports", None)
    if callable(method):
        answer: tuple[bool, str] = method(recipe, device)
        return answer
    dev = None if device is None else torch.device(device)
    roles = recipe_granularities(recipe)
    if all(g is None for g in roles.values()):
        return backend.available(dev)
    kinds = ", ".join(dict.fromkeys(granularity_label(g) for g in roles.values()))
    return False, (
        f"backend {backend.name!r} ({type(backend).__qualname__}) has no supports() method, so it is not "
        f"known to run {type(recipe).__name__} ({kinds}); give it supports(recipe, device) "
        "(see scalestate.backends.SupportsRecipe), or use backend='emulation'"
    )


def resolve_backend(name: str, device: torch.device | None = None, *, recipe: Recipe | None = None) -> Backend:
    """The backend a manager uses for ``name``, checked for availability.

    ``"auto"`` picks the best backend that can run on ``device`` (default:
    CUDA if torch sees a GPU, else CPU), and that :func:`supports` ``recipe``
    there when one is given; it logs its choice on the ``scalestate`` logger.

    Raises:
        UnknownBackendError: no backend is registered under ``name``.
        BackendUnavailableError: it cannot run here, or not ``recipe``; the message says why.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "auto":
        backend = get_backend(name)
        check_backend(backend, name, device, recipe)
        return backend
    reasons = []
    for candidate in _AUTO_ORDER.get(device.type, ("emulation",)):
        if candidate not in _registry:
            reasons.append(f"{candidate}: not registered")
            continue
        try:  # a broken optional backend must not hide the ones after it
            backend = get_backend(candidate)
            ok, reason = backend.available(device)
            if ok and recipe is not None:
                ok, reason = supports(backend, recipe, device)
        except Exception as exc:
            reasons.append(f"{candidate}: failed to load: {type(exc).__name__}: {exc}")
            continue
        if ok:
            _log.info("scalestate: backend='auto' chose %r on %s (%s)", candidate, device, reason)
            return backend
        reasons.append(f"{candidate}: {reason}")
    what = "" if recipe is None else f" {type(recipe).__name__}"
    raise BackendUnavailableError(f"no backend can run{what} on {device}: " + "; ".join(reasons))


def check_backend(backend: Backend, label: str, device: torch.device, recipe: Recipe | None = None) -> None:
    """Raise :class:`BackendUnavailableError` with the reason unless ``backend`` (named ``label`` in
    messages) is available on ``device`` and, given ``recipe``, :func:`supports` it there."""
    ok, reason = backend.available(device)
    if not ok:
        raise BackendUnavailableError(
            f"backend {label!r} cannot run on {device}: {reason}. Use backend='auto' or backend='emulation'"
        )
    if recipe is not None:
        check_supports(backend, label, recipe, device)


def check_supports(backend: Backend, label: str, recipe: Recipe, device: torch.device) -> None:
    """Raise :class:`BackendUnavailableError` with the reason if ``backend`` does not :func:`supports` ``recipe``."""
    ok, reason = supports(backend, recipe, device)
    if not ok:
        raise BackendUnavailableError(
            f"backend {label!r} does not support {type(recipe).__name__} on {device}: {reason}"
        )
