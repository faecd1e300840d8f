"""Keeping scalestate's bookkeeping out of torch's selective activation checkpointing.

Design requirement: a region under selective activation checkpointing (SAC,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``) must give
the bits of the region without checkpointing, whatever its policy saves.
Torch's SAC runs the region's forward under a dispatch mode that numbers
every operation by its kind (the third ``aten.mul`` of the region, say) and
keeps the outputs the policy saves; the recompute runs under a second mode
that hands the k-th call of each kind the k-th output kept. So the recompute
must dispatch exactly the operations of its forward, in the same order, and
no kept output may be modified afterwards.

A cast cannot promise that: whether a weight cast runs at all depends on the
weight-cast cache (which an evaluation pass, another thread, another model
sharing the manager or ``invalidate_casts()`` may have changed between
forward and backward), a recorded cast dispatches its record and a recompute
does not, debug mode reads amaxes, and the emulation cast rounds in place.
Every cast therefore runs with SAC's two modes taken off this thread's
dispatch-mode stack (:func:`hidden_from_sac`): SAC neither numbers nor keeps
the cast's operations, and the recompute casts its recomputed input again,
with the step's scale, to the bits of the forward's cast. Every other mode
(a ``FakeTensorMode``, a FLOP counter, a user's mode pushed inside the
region) still sees them. What SAC does see of an FP8 layer is the rest of its
forward, the FP8 products above all, which are a deterministic function of
the casts and may be saved like any other operation.

Outside SAC the cost is one length check of the mode stack per cast.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["hidden_from_sac", "sac_active"]

#: SAC's forward (caching) and recompute (cached) modes; subclasses (xformers') count too.
_SAC_MODES: tuple[type[TorchDispatchMode], ...] = tuple(
    mode
    for mode in (
        getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
        getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
    )
    if isinstance(mode, type)
)


def _first_sac_mode(stack: list[TorchDispatchMode]) -> int | None:
    for i, mode in enumerate(stack):
        if isinstance(mode, _SAC_MODES):
            return i
    return None


def sac_active() -> bool:
    """Whether code run now on this thread runs under a SAC forward or recompute."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    return _first_sac_mode(_get_current_dispatch_mode_stack()) is not None


#: The block of :func:`hidden_from_sac` where no SAC mode is on the stack (reusable: it holds no state).
_NOTHING_HIDDEN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class _Hidden:
    """Takes SAC's modes off the stack for the block, keeping every other mode in its place."""

    def __init__(self, above: list[TorchDispatchMode]) -> None:
        #: The modes from the lowest SAC mode up to the top of the stack, bottom first.
        self._above = above
        self._kept = [mode for mode in above if not isinstance(mode, _SAC_MODES)]

    def __enter__(self) -> None:
        for _ in self._above:
            torch._C._pop_torch_dispatch_stack(None)
        for mode in self._kept:
            torch._C._push_on_torch_dispatch_stack(mode)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for _ in self._kept:
            torch._C._pop_torch_dispatch_stack(None)
        for mode in self._above:
            torch._C._push_on_torch_dispatch_stack(mode)


def hidden_from_sac() -> contextlib.AbstractContextManager[None]:
    """A block whose tensor operations selective activation checkpointing neither counts nor keeps.

    Run a computation in it when the region's forward and its recompute may
    not dispatch the same operations for it (a cache, a lazily built table, a
    record made in the forward only) or when it modifies its own results in
    place; its results then come from running it, in the forward and in the
    recompute alike. Every cast of a manager already runs in one; a backend
    or module library needs it only for work of its own beside the casts.
    Eager code only: in a ``torch.compile``\\d region the compiler applies the
    policy to its graph, and this block changes nothing.

    Example:
        >>> import functools, torch
        >>> from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        >>> from scalestate.sac import hidden_from_sac, sac_active
        >>> def region(x):
        ...     with hidden_from_sac():
        ...         inside = sac_active()
        ...     return x.sin(), inside, sac_active()
        >>> ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.sin.default])
        >>> _, inside, outside = checkpoint(region, torch.ones(2, requires_grad=True),
        ...                                 use_reentrant=False, context_fn=ctx)
        >>> inside, outside
        (False, True)
    """
    if not torch._C._len_torch_dispatch_stack() or not _SAC_MODES or torch.compiler.is_compiling():
        return _NOTHING_HIDDEN
    stack = _get_current_dispatch_mode_stack()
    first = _first_sac_mode(stack)
    if first is None:
        return _NOTHING_HIDDEN
    return _Hidden(stack[first:])
