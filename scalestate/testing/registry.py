"""A backend registered for the length of a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from scalestate.backends import BackendFactory, register_backend, unregister_backend

__all__ = ["registered_backend"]


@contextlib.contextmanager
def registered_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> Iterator[str]:
    """Register ``factory`` as ``name`` for the ``with`` block, and unregister it afterwards.

    The registry is the one table scalestate keeps for the whole process, so a
    test that registers a backend leaves it behind for every later test
    unless it takes it out again; this does, whatever the block raises. With
    ``replace=True`` and a built-in name, leaving the block restores the
    built-in backend (see :func:`scalestate.backends.unregister_backend`).
    A replaced name that is not built in is removed, not restored.

    Yields:
        ``name``.

    Example:
        >>> import scalestate as ss
        >>> from scalestate.backends.emulation import EmulationBackend
        >>> from scalestate.testing import registered_backend
        >>> with registered_backend("mine", EmulationBackend):
        ...     ss.ScalingStateManager(ss.DelayedScaling(), backend="mine").backend.name
        'emulation'
        >>> "mine" in ss.backends.available_backends()
        False
    """
    register_backend(name, factory, replace=replace)
    try:
        yield name
    finally:
        unregister_backend(name)
