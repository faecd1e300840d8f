"""`ss.nn.Linear` in compiled code: one call that dynamo puts in the graph whole.

Dynamo traces Python one bytecode at a time and every tensor operation
through fake tensors: a per-tensor FP8 linear layer traced through the
manager's cast path (phase, slot, backend, three casts, three products) cost
it about 0.2 s, several times what the rest of a transformer block costs. So,
where nothing about a cast depends on state dynamo must guard on, compiled
code calls :class:`CompiledLinearFunction` instead: dynamo records the call
without tracing into it, and AOT autograd traces it (at Python's own speed,
on functional tensors) into the same operations the manager's compiled cast
path makes. The graph inductor receives, and so every bit, is the same.

What may change from call to call (the phase, which decides whether forward
casts record) is read in traced code and passed in as constants, so dynamo
guards on it as before. Everything else the function reads is fixed for the
layer's life: its slots, their per-tensor specs, the manager's backend once
settled, whether statistics are kept. The state's buffers and each slot's
row index are passed in as tensors: graph inputs, which the function reads
and writes as the manager's compiled casts do (see
:mod:`scalestate._engine.rows`).

Per-tensor recipes on the ``emulation`` and ``scaled_mm`` backends take this
path; fine-grained and NVFP4 recipes, other backends, ``collect_stats``,
FSDP's FP8 weights, transposed weights and tensor parallelism trace the
manager's cast path as before.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor

from scalestate._engine.binding import settle_during_trace
from scalestate._engine.rows import newest_at, read_at, write_at
from scalestate.backends import Backend, CastRequest
from scalestate.handle import ScalingHandle
from scalestate.nn.function import linear_backward, linear_forward
from scalestate.phase import CastKind
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["CompiledLinearFunction", "compiled_linear"]

#: The handles of layers compiled through this path, by token (weakly: a handle's layer owns it).
_HANDLES: weakref.WeakValueDictionary[int, ScalingHandle] = weakref.WeakValueDictionary()
_TOKENS: weakref.WeakKeyDictionary[ScalingHandle, int] = weakref.WeakKeyDictionary()
_NEXT_TOKEN = itertools.count()
#: The roles of a linear layer's slots, in the order the function takes their row indices.
_ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


def _plan(handle: ScalingHandle) -> int | None:
    """The handle's token if its layer can take :class:`CompiledLinearFunction`, else ``None``.

    Run for real while dynamo traces (not traced: its result is a constant of
    the graph, guarded by the handle's identity), as it reads only what is
    fixed for the handle's life.
    """
    manager = handle.manager
    slots = handle._slots
    if manager._state.stats or any(role not in slots for role in _ROLES):
        return None
    if any(slots[role].spec.granularity is not None for role in _ROLES):
        return None
    key = getattr(manager._binding.backend, "_products_key", None)
    if key is None or key() is None:
        return None
    token = _TOKENS.get(handle)
    if token is None:
        import torch._dynamo  # tracing: already imported

        torch._dynamo.allow_in_graph(CompiledLinearFunction)  # type: ignore[no-untyped-call]  # untyped in torch
        token = _TOKENS[handle] = next(_NEXT_TOKEN)
        _HANDLES[token] = handle
    return token


# What torch.compiler.assume_constant_result(fn) does (scalestate._engine.binding marks its own the same way).
_plan._dynamo_marked_constant = True  # type: ignore[attr-defined]  # the compiler's own mark


def compiled_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle, transpose: bool, out_dtype: torch.dtype
) -> Tensor | None:
    """``x @ weight.T + bias`` (2-d ``x``) through :class:`CompiledLinearFunction`, or ``None`` where the
    layer does not take it (the caller then traces the manager's cast path)."""
    manager = handle.manager
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter)  # not FSDP's FP8 weights
    if not (plain and x.is_floating_point() and weight.is_floating_point()):
        return None
    settle_during_trace(manager._binding, x.device)  # as the manager's first cast would
    token = _plan(handle)
    if token is None:
        return None
    caster, st = manager._caster, manager._state
    records = [caster._kind(handle._slots[role], False, True) is CastKind.RECORD for role in _ROLES[:2]]
    rows = st._rows
    history = st._history if caster._delayed else None
    out: Tensor = CompiledLinearFunction.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        x, weight, bias, st._scales, st._step_amax, history,
        *(rows.index(handle._slots[role].row) for role in _ROLES), token, *records, transpose, out_dtype,
    )
    return out


def _cast(
    backend: Backend, handle: ScalingHandle, role: Role, x: Tensor, buffers: tuple[Tensor, Tensor, Tensor | None],
    index: Tensor, record: bool, transpose: bool,
) -> Quantized:
    """The cast the manager's compiled path makes (`scalestate._engine.casting`): the slot's scale and
    accumulator read through its row index, the just-in-time flag from its newest history entry
    (delayed scaling), the backend's cast, the accumulator written back."""
    scales, step_amax, history = buffers
    acc = read_at(step_amax, index) if record else None
    jit: bool | Tensor = True if history is None else newest_at(history, index) <= 0
    q = backend.cast(CastRequest(x.detach(), handle._slots[role].spec, read_at(scales, index), jit, acc, transpose))
    if acc is not None:
        write_at(step_amax, index, acc)
    return q


class CompiledLinearFunction(torch.autograd.Function):
    """:func:`scalestate.nn.linear` of a per-tensor layer as one autograd Function whose arguments are
    tensors and constants only: what dynamo can put in a graph without tracing it. It casts (and
    records) x and the weight, multiplies, and in backward casts the output gradient, as
    :class:`~scalestate.nn.function.FP8LinearFunction` with the manager's casts does."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        scales: Tensor,
        step_amax: Tensor,
        history: Tensor | None,
        index_x: Tensor,
        index_w: Tensor,
        index_g: Tensor,
        token: int,
        record_x: bool,
        record_w: bool,
        transpose: bool,
        out_dtype: torch.dtype,
    ) -> Tensor:
        handle = _HANDLES[token]
        backend = handle.manager._binding.backend
        buffers = (scales, step_amax, history)
        qx = _cast(backend, handle, Role.INPUT, x, buffers, index_x, record_x, transpose)
        qw = _cast(backend, handle, Role.WEIGHT, weight, buffers, index_w, record_w, transpose)
        # Not saved for backward: the buffers change in place (each cast records) before it runs.
        ctx.grad_cast = (backend, handle, buffers, index_g)
        return linear_forward(ctx, x, weight, bias, qx, qw, backend, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        backend, handle, buffers, index_g = ctx.grad_cast

        def cast_grad(g: Tensor, transpose: bool) -> Quantized:
            return _cast(backend, handle, Role.GRAD_OUTPUT, g, buffers, index_g, True, transpose)

        return *linear_backward(ctx, grad_out, cast_grad), *(None,) * 11
