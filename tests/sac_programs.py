"""Training programs for the selective-checkpointing tests: described by data, run twice, compared.

A :class:`Program` says everything a run does: the model (blocks of FP8
layers beside the high-precision ops users put around them: RMS norms made of
``linalg_vector_norm``, ``div`` and ``mul``, layer norms, attention, plain
``torch.nn.Linear``; a weight used twice; a weight stored ``(in, out)``), how
each block and the whole model are checkpointed (plain, reentrant, selective
with a policy, nested), the
recipe and backend, the phase style, and the events between passes:
evaluation passes of the model or of a copy sharing the manager (on this
thread or another, also between a forward and its backward), dropped casts,
and weight edits. :func:`run` runs it and records losses, gradients,
parameters and ``manager.state_dict()`` per step; :func:`plain` is the same
program without checkpointing and without what must not change it
(evaluations, dropped casts), which it must equal bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tcp
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

import scalestate as ss
from helpers import Checkpointed, backend_for
from scalestate import testing
from scalestate.testing import Block, OpLog

DIM = 32
RECIPES: dict[str, ss.Recipe] = {
    "delayed": ss.DelayedScaling(history_len=4),
    "current": ss.CurrentScaling(),
    "rowwise": ss.RowwiseScaling(),
    "block": ss.BlockScaling(block=8),  # 8-wide tiles: several per row of the 32-wide layers
    "mxfp8": ss.MXFP8Scaling(),
}
BACKENDS = ("emulation", "scaled_mm")
BLOCK_KINDS = ("mlp", "attn", "mixed", "tied", "relu", "transposed")
#: How a region is checkpointed. ``reentrant`` only at the top level (torch's own limits).
WRAPS = ("none", "plain", "reentrant", "sac", "ss_sac", "wrapper_sac")
SAC_WRAPS = ("sac", "ss_sac", "wrapper_sac")


# ------------------------------------------------------------------ programs
@attrs.frozen
class Policy:
    """What a selective region saves: ``ops=None`` every op, else the ops named (none if empty).

    ``every``: of the chosen ops, only every k-th call (counted per forward of the region);
    ``prefer``: ``PREFER_SAVE`` instead of ``MUST_SAVE``.
    """

    ops: frozenset[str] | None = None
    every: int = 1
    prefer: bool = False

    def __repr__(self) -> str:
        ops = "ALL" if self.ops is None else "{" + ", ".join(sorted(self.ops)) + "}"
        extra = (f", every={self.every}" if self.every > 1 else "") + (", prefer" if self.prefer else "")
        return f"Policy({ops}{extra})"

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        """A fresh SAC ``context_fn`` (its call counter starts at 0 for each forward)."""

        def contexts() -> tuple[Any, Any]:
            calls: dict[str, int] = {}

            def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tcp.CheckpointPolicy:
                name = str(op)
                if self.ops is not None and name not in self.ops:
                    return tcp.CheckpointPolicy.PREFER_RECOMPUTE
                calls[name] = calls.get(name, -1) + 1
                if calls[name] % self.every:
                    return tcp.CheckpointPolicy.PREFER_RECOMPUTE
                return tcp.CheckpointPolicy.PREFER_SAVE if self.prefer else tcp.CheckpointPolicy.MUST_SAVE

            return tcp.create_selective_checkpoint_contexts(policy)

        return contexts


@attrs.frozen
class Region:
    """How one region (a block, or the whole model) is checkpointed."""

    wrap: str = "none"
    policy: Policy | None = None

    def __repr__(self) -> str:
        return self.wrap if self.policy is None else f"{self.wrap}:{self.policy!r}"


@attrs.frozen
class Event:
    """Something done between passes.

    ``at``: ``(step, microbatch, where)``, ``where`` one of ``"before"`` (the
    microbatch's forward), ``"between"`` (its forward and backward),
    ``"after"`` (its backward), or microbatch ``-1`` with ``"step"`` (after the
    step). ``what``: ``"eval"`` (``target`` ``"model"`` or ``"copy"``, on
    ``thread`` or not), ``"invalidate"`` (``target`` ``"manager"`` or a layer
    index), ``"edit"`` (a layer index; ``how`` ``"inplace"`` or ``"data"``,
    the latter followed by ``manager.invalidate_casts()`` as documented).
    """

    at: tuple[int, int, str]
    what: str
    target: str | int = "model"
    thread: bool = False
    how: str = "inplace"

    @property
    def kept_in_plain(self) -> bool:
        """Weight edits change the program; evaluations and dropped casts must not."""
        return self.what == "edit"

    def __repr__(self) -> str:
        step, mb, where = self.at
        if self.what == "eval":
            detail = f"eval {self.target}" + (" in a thread" if self.thread else "")
        elif self.what == "invalidate":
            detail = f"invalidate_casts({self.target})"
        else:
            detail = f"edit layer {self.target} ({self.how})"
        return f"<{detail} at step {step} mb {mb} {where}>"


@attrs.frozen
class Program:
    recipe: str
    backend: str
    blocks: tuple[tuple[str, Region], ...]
    outer: Region = Region()
    phases: str = "blocks"  # "blocks" (manager.forward()/backward()) or "none"
    microbatches: int = 2
    steps: int = 3
    debug: bool = False
    events: tuple[Event, ...] = ()
    seed: int = 0
    #: ``torch.compile`` backend the model runs under (``fullgraph=True``), or ``None``: eager.
    compiler: str | None = None

    def plain(self) -> Program:
        """The same training without checkpointing, evaluations or dropped casts, eager."""
        return attrs.evolve(
            self,
            blocks=tuple((kind, Region()) for kind, _ in self.blocks),
            outer=Region(),
            debug=False,
            compiler=None,
            events=tuple(e for e in self.events if e.kept_in_plain),
        )


# ------------------------------------------------------------------ models
class RMSNorm(nn.Module):
    """RMS norm as model code often writes it: ``linalg_vector_norm``, ``div`` and ``mul``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
        return x / (rms + 1e-6) * self.weight


class MLP(nn.Module):
    def __init__(self, manager: ss.ScalingStateManager, name: str) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.up = ss.nn.Linear(DIM, 2 * DIM, manager=manager, name=f"{name}.up")
        self.down = ss.nn.Linear(2 * DIM, DIM, bias=False, manager=manager, name=f"{name}.down")

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mixed(nn.Module):
    """A plain ``torch.nn.Linear`` (``addmm``) beside an FP8 one, and a SiLU."""

    def __init__(self, manager: ss.ScalingStateManager, name: str) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.hp = nn.Linear(DIM, DIM)
        self.fc = ss.nn.Linear(DIM, DIM, bias=False, manager=manager, name=f"{name}.fc")

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(F.silu(self.hp(self.norm(x))))


class Tied(nn.Module):
    """One FP8 layer applied twice: its second weight cast in a forward is a cache hit."""

    def __init__(self, manager: ss.ScalingStateManager, name: str) -> None:
        super().__init__()
        self.fc = ss.nn.Linear(DIM, DIM, manager=manager, name=f"{name}.fc")

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(torch.relu(self.fc(x)) * 0.5)


class Transposed(nn.Module):
    """A weight stored ``(in, out)`` (transformers' ``Conv1D``), cast by ``ss.nn.linear(weight_transposed=True)``."""

    def __init__(self, manager: ss.ScalingStateManager, name: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / math.sqrt(DIM))
        self.bias = nn.Parameter(torch.zeros(DIM))
        self.handle = manager.register(f"{name}.conv1d")

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(ss.nn.linear(x, self.weight, self.bias, self.handle, weight_transposed=True))


def _relu(manager: ss.ScalingStateManager, name: str) -> nn.Module:
    """Two bias-free FP8 layers with ReLUs and nothing else: the casts are the only norms and divisions."""
    return nn.Sequential(
        ss.nn.Linear(DIM, DIM, bias=False, manager=manager, name=f"{name}.fc1"),
        nn.ReLU(),
        ss.nn.Linear(DIM, DIM, bias=False, manager=manager, name=f"{name}.fc2"),
        nn.ReLU(),
    )


def _attention(manager: ss.ScalingStateManager, name: str) -> nn.Module:
    block = Block(DIM, n_heads=2)
    for attr in ("qkv", "proj", "fc1", "fc2"):
        layer = getattr(block, attr)
        fp8 = ss.nn.Linear(layer.in_features, layer.out_features, manager=manager, name=f"{name}.{attr}")
        fp8.weight, fp8.bias = layer.weight, layer.bias
        setattr(block, attr, fp8)
    return block


#: Block kind -> its constructor ``(manager, name) -> module``.
_BLOCKS: dict[str, Callable[[ss.ScalingStateManager, str], nn.Module]] = {
    "mlp": MLP, "mixed": Mixed, "tied": Tied, "transposed": Transposed, "attn": _attention, "relu": _relu,
}
assert set(_BLOCKS) == set(BLOCK_KINDS)


def wrap(module: nn.Module, region: Region) -> nn.Module:
    """``module`` checkpointed as ``region`` says."""
    kind = region.wrap
    if kind == "none":
        return module
    if kind == "plain":
        return Checkpointed(module, functools.partial(tcp.checkpoint, use_reentrant=False))
    if kind == "reentrant":
        return Checkpointed(module, functools.partial(tcp.checkpoint, use_reentrant=True))
    assert region.policy is not None
    context_fn = region.policy.context_fn()
    if kind == "sac":
        return Checkpointed(module, functools.partial(tcp.checkpoint, use_reentrant=False, context_fn=context_fn))
    if kind == "ss_sac":
        return Checkpointed(module, functools.partial(ss.checkpoint, context_fn=context_fn))
    if kind == "wrapper_sac":
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context_fn)
    raise ValueError(kind)


def fp8_layers(model: nn.Module) -> list[ss.nn.Linear | Transposed]:
    """The model's FP8 layers, in construction order (what events name by index)."""
    return [m for m in model.modules() if isinstance(m, (ss.nn.Linear, Transposed))]


def build(program: Program, manager: ss.ScalingStateManager) -> nn.Module:
    torch.manual_seed(program.seed)
    blocks = [wrap(_BLOCKS[kind](manager, f"b{i}"), region) for i, (kind, region) in enumerate(program.blocks)]
    return wrap(nn.Sequential(*blocks), program.outer)


# ------------------------------------------------------------------ running
@attrs.define
class Trace:
    """What a run produced: per microbatch, losses; per step, gradients, parameters, manager state."""

    losses: list[Tensor] = attrs.Factory(list)
    input_grads: list[Tensor] = attrs.Factory(list)
    grads: list[list[Tensor]] = attrs.Factory(list)
    params: list[list[Tensor]] = attrs.Factory(list)
    states: list[dict[str, Any]] = attrs.Factory(list)


def inputs(program: Program) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(1000 + program.seed)
    return [
        [torch.randn(2, 4, DIM, generator=gen) * (1 + step) * (1 + 0.5 * mb) for mb in range(program.microbatches)]
        for step in range(program.steps)
    ]


def run(program: Program) -> Trace:
    """Train as ``program`` says and record everything the comparison needs."""
    recipe = RECIPES[program.recipe]
    manager = ss.ScalingStateManager(recipe, backend=backend_for(recipe, program.backend), debug=program.debug)
    model = build(program, manager)
    evaluated = copy.deepcopy(model, memo={id(manager): manager})  # an EMA-style copy sharing the manager
    forward = model if program.compiler is None else torch.compile(model, backend=program.compiler, fullgraph=True)
    layers = fp8_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(7)) * 50  # amaxes no training cast sees
    events: dict[tuple[int, int, str], list[Event]] = {}
    for event in program.events:
        events.setdefault(event.at, []).append(event)
    phases = program.phases == "blocks"

    def do(at: tuple[int, int, str]) -> None:
        for event in events.get(at, ()):
            _do(event, manager, model, evaluated, layers, probe)

    trace = Trace()
    for step, xs in enumerate(inputs(program)):
        xs = [x.requires_grad_() for x in xs]
        for mb, x in enumerate(xs):
            do((step, mb, "before"))
            with manager.forward() if phases else contextlib.nullcontext():
                loss = forward(x).float().square().mean() / program.microbatches
            do((step, mb, "between"))
            with manager.backward() if phases else contextlib.nullcontext():
                loss.backward()
            do((step, mb, "after"))
            trace.losses.append(loss.detach())
        trace.input_grads.append(torch.cat([x.grad.flatten() for x in xs]))
        trace.grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        manager.step()
        do((step, -1, "step"))
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.states.append(manager.state_dict())
    return trace


def _do(
    event: Event,
    manager: ss.ScalingStateManager,
    model: nn.Module,
    evaluated: nn.Module,
    layers: list[ss.nn.Linear | Transposed],
    probe: Tensor,
) -> None:
    if event.what == "eval":
        target = model if event.target == "model" else evaluated

        def evaluate() -> None:
            with torch.no_grad():
                target(probe)

        if event.thread:
            _in_thread(evaluate)
        else:
            evaluate()
    elif event.what == "invalidate":
        if event.target == "manager":
            manager.invalidate_casts()
        else:
            layers[int(event.target) % len(layers)].handle.invalidate_casts()
    elif event.what == "edit":
        weight = layers[int(event.target) % len(layers)].weight
        with torch.no_grad():
            if event.how == "inplace":
                weight.mul_(1.0 - 1.0 / 64)
            else:  # an edit PyTorch's version counter does not see: documented to need invalidate_casts()
                weight.data.mul_(1.0 - 1.0 / 32)
                manager.invalidate_casts()
    else:
        raise ValueError(event.what)


def _in_thread(fn: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        raise TimeoutError("the evaluation thread did not finish within 60 s")
    if errors:
        raise errors[0]


def differences(a: Trace, b: Trace) -> list[str]:
    """Where two traces differ (bitwise, :func:`scalestate.testing.differences`); empty if nowhere."""
    return testing.differences(attrs.asdict(a, recurse=False), attrs.asdict(b, recurse=False), name="trace")


# ------------------------------------------------------------------ the ops a forward dispatches
@functools.cache
def forward_ops() -> tuple[str, ...]:
    """Every op a training forward of any block dispatches, under any recipe and backend, casts included.

    A mode pushed outside a checkpointed region sees the casts' operations too
    (only selective checkpointing's own modes are kept from them), so these are
    the names a user's policy may give.
    """
    ops: set[str] = set()
    for recipe in RECIPES:
        for backend in BACKENDS:
            program = Program(recipe, backend, tuple((kind, Region()) for kind in BLOCK_KINDS), steps=1)
            manager = ss.ScalingStateManager(RECIPES[recipe], backend=backend_for(RECIPES[recipe], backend))
            model = build(program, manager)
            for _ in range(2):  # before and after the first step: just in time, then delayed
                x = inputs(program)[0][0].requires_grad_()
                with OpLog() as log:
                    y = model(x)
                ops |= set(log.ops)
                y.sum().backward()
                manager.step()
    ops.discard("aten.detach.default")  # selective checkpointing ignores it
    return tuple(sorted(ops))
