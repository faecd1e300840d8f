"""Watching what runs: the tensor operations dispatched, and the casts a backend is asked for."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from scalestate import Quantized, ScalingStateManager
from scalestate.backends import Backend, CastRequest, GroupedCastRequest

__all__ = ["CastSpy", "OpLog", "saved_for_backward_bytes"]


class OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """The tensor operations dispatched while it is active, by name, in order.

    A ``TorchDispatchMode``: it sees every operation that reaches the
    dispatcher (``aten`` overloads, as ``"aten.mm.default"``), on any device,
    including those inside a backend's cast, and runs each unchanged. Use it to
    count operations (a step that must not grow with the slots, a cast with no
    loop over tiles), or to look for host reads
    (``"aten._local_scalar_dense.default"`` is what ``.item()`` and
    ``float(t)`` dispatch).

    Args:
        when: log an operation only while ``when()`` is true (with
            :attr:`CastSpy.casting`: only the operations outside a backend's
            casts).

    Example:
        >>> import torch
        >>> from scalestate.testing import OpLog
        >>> with OpLog() as log:
        ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> log.ops
        ['aten.ones.default', 'aten.ones.default', 'aten.mm.default']
        >>> log.count("aten.mm.default"), len(log)
        (1, 3)
    """

    def __init__(self, *, when: Callable[[], bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init__ is untyped
        #: The name of each operation logged (``str`` of its overload), in order.
        self.ops: list[str] = []
        self._when = when

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._when is None or self._when():
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, op: object) -> int:
        """How many times ``op`` (a name such as ``"aten.mm.default"``, or the overload) was logged."""
        return self.ops.count(str(op))

    def __len__(self) -> int:
        return len(self.ops)


class CastSpy:
    """Every cast a backend is asked for while the spy is active: each request, and what it returned.

    The spy wraps the backend instance's ``cast`` method (the backend's own
    code still does every cast) and puts it back on exit. Give it a manager
    (the spy watches its :attr:`~scalestate.ScalingStateManager.backend` as
    of entering: a manager made with ``backend="auto"`` that moves to another
    device afterwards, by ``to()`` or by a first cast elsewhere, may choose a
    new instance, which the spy does not see), or a backend instance (to watch
    every manager given that instance, including those a helper makes).

    A :class:`~scalestate.backends.CastRequest` holds every decision the
    manager made for a cast: ``request.scale`` (the slot's scale, or what a
    just-in-time cast starts from), ``request.jit``, ``request.record`` (the
    accumulator the amax goes into, ``None`` for a cast that records nothing)
    and ``request.x``, the tensor cast (a detached view: compare storage with
    :meth:`casts_of`). A backend's grouped casts (``cast_grouped``, which
    grouped layers such as :class:`scalestate.nn.GroupedLinear` call) are kept
    apart, in :attr:`grouped_requests`; ``on_cast`` sees per-tensor casts only.

    Args:
        target: the manager or backend to watch.
        on_cast: called with each request and its result, after the cast.
        keep: keep every request and result in :attr:`requests` and
            :attr:`results` (``False`` for a long run that only counts in
            ``on_cast``).

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.testing import CastSpy
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> layer = ss.nn.Linear(8, 8, manager=manager)
        >>> with CastSpy(manager) as spy:
        ...     for _ in range(4):  # four microbatches of one step
        ...         with manager.forward():
        ...             y = layer(torch.randn(2, 8))
        >>> spy.casts_of(layer.weight), len(spy.requests)  # the weight once, the input every time
        (1, 5)
    """

    def __init__(
        self,
        target: ScalingStateManager | Backend,
        *,
        on_cast: Callable[[CastRequest, Quantized], None] | None = None,
        keep: bool = True,
    ) -> None:
        self._target = target
        #: The backend watched (for a manager: its backend when the spy was entered last).
        self.backend: Backend = target.backend if isinstance(target, ScalingStateManager) else target
        #: Each request, in order (while ``keep``).
        self.requests: list[CastRequest] = []
        #: What each request returned, in the same order (while ``keep``).
        self.results: list[Quantized] = []
        #: True while the backend's cast runs (for :class:`OpLog`'s ``when``).
        self.casting = False
        self._on_cast = on_cast
        self._keep = keep
        #: Each grouped request (a backend's ``cast_grouped``, see
        #: :class:`~scalestate.backends.GroupedCastRequest`), in order (while ``keep``).
        self.grouped_requests: list[GroupedCastRequest] = []
        #: Per open with-block: whether the instance had a ``cast`` of its own, and the ``cast`` replaced.
        self._replaced: list[tuple[bool, Callable[[CastRequest], Quantized]]] = []
        self._replaced_grouped: list[tuple[bool, Any]] = []

    def __enter__(self) -> CastSpy:
        if isinstance(self._target, ScalingStateManager) and not self._replaced:
            self.backend = self._target.backend
        real = self.backend.cast

        @functools.wraps(real)
        def cast(request: CastRequest) -> Quantized:
            self.casting = True
            try:
                q = real(request)
            finally:
                self.casting = False
            if self._keep:
                self.requests.append(request)
                self.results.append(q)
            if self._on_cast is not None:
                self._on_cast(request, q)
            return q

        # An instance attribute shadows the class's method; deleting it on exit restores the method.
        self._replaced.append(("cast" in vars(self.backend), real))
        self.backend.cast = cast  # type: ignore[method-assign]  # instance patch, undone in __exit__
        real_grouped = getattr(self.backend, "cast_grouped", None)
        self._replaced_grouped.append(("cast_grouped" in vars(self.backend), real_grouped))
        if real_grouped is not None:

            @functools.wraps(real_grouped)
            def cast_grouped(request: GroupedCastRequest) -> tuple[Quantized, ...]:
                self.casting = True
                try:
                    qs: tuple[Quantized, ...] = real_grouped(request)
                finally:
                    self.casting = False
                if self._keep:
                    self.grouped_requests.append(request)
                return qs

            self.backend.cast_grouped = cast_grouped  # type: ignore[attr-defined]  # instance patch, undone on exit
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        had_own, real = self._replaced.pop()
        if had_own:
            self.backend.cast = real  # type: ignore[method-assign,assignment]  # what the instance had before
        else:
            del self.backend.cast
        had_grouped, real_grouped = self._replaced_grouped.pop()
        if had_grouped:
            self.backend.cast_grouped = real_grouped  # type: ignore[attr-defined]
        elif real_grouped is not None:
            del self.backend.cast_grouped  # type: ignore[attr-defined]

    def casts_of(self, tensor: Tensor) -> int:
        """How many of the requests cast ``tensor`` (a request whose ``x`` starts at its storage address)."""
        ptr = tensor.data_ptr()
        return sum(1 for r in self.requests if r.x.data_ptr() == ptr)


def saved_for_backward_bytes(step: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for backward while ``step()`` runs (parameters excluded).

    Example:
        >>> import torch
        >>> from scalestate.testing import saved_for_backward_bytes
        >>> layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
        >>> saved_for_backward_bytes(lambda: layer(x).sum().backward())  # the float32 input
        128
    """
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total
