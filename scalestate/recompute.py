"""`scalestate.checkpoint`: activation checkpointing that marks its recompute explicitly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.utils.checkpoint

from scalestate.errors import ArgumentValueError
from scalestate.phase import recompute_region, training_forward_region

__all__ = ["checkpoint"]

ContextFn = Callable[[], tuple[ContextManager[Any], ContextManager[Any]]]


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: ContextFn | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose recompute every manager knows for one.

    Plain torch checkpointing already works with scalestate: a recompute runs
    inside autograd's backward, where it is recognised. Use this instead when
    that recognition is not available, e.g. a backward driven by code outside
    autograd's engine, or to be explicit. Non-reentrant by default, as torch
    recommends.

    Args:
        fn: the region to checkpoint.
        *args: its inputs.
        use_reentrant: passed to torch; the reentrant forward (which torch runs
            under ``no_grad``) is marked as a training forward.
        context_fn: non-reentrant only, as in torch (e.g. selective activation
            checkpointing contexts); composed with the recompute mark. Inside a
            ``torch.compile``d region the call is torch's own, unmarked: the
            compiler replays the recompute from its graph.
        **kwargs: passed to torch (``preserve_rng_state``, ``determinism_check``, ...).

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> layer = ss.nn.Linear(8, 8, manager=m)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> ss.checkpoint(layer, x).sum().backward()
    """
    if use_reentrant:
        if context_fn is not None:
            raise ArgumentValueError("context_fn is only supported with use_reentrant=False (as in torch)")
        calls = 0
        training = torch.is_grad_enabled()  # torch runs the first call under no_grad either way

        def marked(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            mark: ContextManager[None]
            if calls > 1:
                mark = recompute_region()
            elif training:
                mark = training_forward_region()
            else:
                mark = contextlib.nullcontext()
            with mark:
                return fn(*a, **k)

        return torch.utils.checkpoint.checkpoint(marked, *args, use_reentrant=True, **kwargs)

    if torch.compiler.is_compiling():
        # Inside a compiled region the compiler replays the recompute from its graph, where no
        # cast runs again: nothing to mark (and the compiler takes only its own context_fns).
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def contexts() -> tuple[ContextManager[Any], ContextManager[Any]]:
        forward_ctx, recompute_ctx = (
            context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return forward_ctx, _both(recompute_ctx, recompute_region())

    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )


@contextlib.contextmanager
def _both(first: ContextManager[Any], second: ContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield
