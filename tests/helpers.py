"""Training harness shared by the parity tests.

``train`` runs a model for a few optimizer steps with microbatches, an AdamW
optimizer that moves the weights, and data whose range grows every step (so
scales really move), and records everything the invariants compare;
``assert_bitwise`` compares two such records with
:func:`scalestate.testing.assert_same`. What the library's users need as well
(the comparison, the op log, the cast spy, SQNR, the model) lives in
:mod:`scalestate.testing`; this file keeps what only these tests use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.utils.checkpoint as tcp
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

import scalestate as ss
from scalestate.backends import Backend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.testing import Block, assert_same

DIM = 32

#: Recipes of the parity suite whose products torch's scaled_mm cannot run: on CPU (torch 2.13)
#: it has tensor-wise and row-wise kernels only; on CUDA its block kernels take 1 x 128 tiles
#: (the suite's are 1 x 8) and its MX kernel needs sm100.
NEEDS_FALLBACK = (ss.BlockScaling, ss.MXFP8Scaling, ss.NVFP4Scaling)


class ScaledMMWithFallback(ScaledMMBackend):
    """``ScaledMMBackend(fallback="emulation")``, equal (and hashing equal) to every other one.

    The parity tests cache their reference runs per ``(recipe, backend)`` with
    ``functools.cache``; each test still gets an instance of its own, as some
    tests patch its methods.
    """

    def __init__(self) -> None:
        super().__init__(fallback="emulation")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return "ScaledMMBackend(fallback='emulation')"


def backend_for(recipe: ss.Recipe, name: str) -> str | Backend:
    """What the parity tests pass as ``backend=`` for ``recipe`` on the CPU backend ``name``.

    The name itself, except scaled_mm with a recipe of :data:`NEEDS_FALLBACK`:
    ``ScaledMMBackend(fallback="emulation")``, whose products fall back to the
    emulated ones where torch's kernel cannot run them (without it, a manager
    refuses the pair when it binds the backend).
    """
    if name != "scaled_mm" or not isinstance(recipe, NEEDS_FALLBACK):
        return name
    return ScaledMMWithFallback()


def checkpointer(mechanism: str, manager: ss.ScalingStateManager | None = None) -> Callable[[nn.Module], nn.Module]:
    """Wrap a module so its forward is checkpointed by ``mechanism``."""

    def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tcp.CheckpointPolicy:
        saved = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm_v2.default)
        return tcp.CheckpointPolicy.MUST_SAVE if op in saved else tcp.CheckpointPolicy.PREFER_RECOMPUTE

    calls: dict[str, Callable[..., Tensor]] = {
        "reentrant": functools.partial(tcp.checkpoint, use_reentrant=True),
        "non_reentrant": functools.partial(tcp.checkpoint, use_reentrant=False),
        "selective": functools.partial(
            tcp.checkpoint,
            use_reentrant=False,
            context_fn=functools.partial(tcp.create_selective_checkpoint_contexts, sac_policy),
        ),
        "ss": ss.checkpoint,
        "ss_reentrant": functools.partial(ss.checkpoint, use_reentrant=True),
    }
    if mechanism == "wrapper":
        return lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mechanism == "wrapper_reentrant":
        return lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT)
    call = calls[mechanism]
    return lambda m: Checkpointed(m, call)


MECHANISMS = (
    "reentrant", "non_reentrant", "selective", "wrapper", "wrapper_reentrant", "ss", "ss_reentrant",
)


class Checkpointed(nn.Module):
    """``call(inner, x)``: ``inner`` run through a checkpoint function."""

    def __init__(self, inner: nn.Module, call: Callable[..., Tensor]) -> None:
        super().__init__()
        self.inner, self.call = inner, call

    def forward(self, x: Tensor) -> Tensor:
        return self.call(self.inner, x)


class Model(nn.Module):
    """``n_blocks`` blocks (or one Linear) with optional checkpointing.

    ``granularity``: ``"none"``, ``"model"`` (one region around everything),
    ``"block"`` (a region per block), ``"nested"`` (a region per block inside
    one around everything).
    """

    def __init__(
        self,
        manager: ss.ScalingStateManager,
        *,
        kind: str = "block",
        n_blocks: int = 2,
        mechanism: str = "non_reentrant",
        granularity: str = "none",
    ) -> None:
        super().__init__()
        if kind == "linear":
            layers: list[nn.Module] = [ss.nn.Linear(DIM, DIM, manager=manager, name="fc")]
        elif kind == "mlp":  # bias-free ReLU MLP: compiled code computes its bits exactly as eager
            mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.ReLU(), nn.Linear(2 * DIM, DIM, bias=False))
            layers = [ss.nn.convert(mlp, manager)]
        else:  # the demo's transformer block: attention and MLP of ss.nn.Linear, layer norms, residuals
            blocks = ss.nn.convert(nn.Sequential(*(Block(DIM, n_heads=2) for _ in range(n_blocks))), manager)
            layers = list(blocks)
        wrap = checkpointer(mechanism, manager)
        if granularity in ("block", "nested"):
            layers = [wrap(layer) for layer in layers]
        body: nn.Module = nn.Sequential(*layers)
        if granularity in ("model", "nested"):
            body = wrap(body)
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


@attrs.define
class Record:
    """Everything a run produced, per step."""

    manager: ss.ScalingStateManager | None = None
    model: nn.Module | None = None
    outputs: list[Tensor] = attrs.Factory(list)
    input_grads: list[Tensor] = attrs.Factory(list)
    weight_grads: list[dict[str, Tensor]] = attrs.Factory(list)
    params: list[dict[str, Tensor]] = attrs.Factory(list)
    histories: list[Tensor] = attrs.Factory(list)
    scales: list[Tensor] = attrs.Factory(list)
    #: Pending amaxes after each step (and after its evaluation pass, if any).
    step_amaxes: list[Tensor] = attrs.Factory(list)
    #: Compiled runs: graphs dynamo compiled after the warm-up steps (by its own counters).
    compiles_after_warmup: int | None = None


def data(steps: int, microbatches: int, *, kind: str = "block", seed: int = 1) -> list[list[Tensor]]:
    """Per step, per microbatch, an input whose range grows with the step."""
    gen = torch.Generator().manual_seed(seed)
    shape = {"linear": (4, DIM), "mlp": (8, DIM)}.get(kind, (2, 8, DIM))
    return [
        [torch.randn(shape, generator=gen) * (1 + step) * (1 + 0.5 * mb) for mb in range(microbatches)]
        for step in range(steps)
    ]


def train(
    recipe: ss.Recipe,
    backend: str | Backend,
    *,
    kind: str = "block",
    mechanism: str = "non_reentrant",
    granularity: str = "none",
    steps: int = 5,
    microbatches: int = 2,
    explicit_phases: bool = True,
    schedule: str = "plain",
    dtype: torch.dtype = torch.float32,
    manager_kwargs: dict[str, Any] | None = None,
    evaluate: bool = False,
    uncached: bool = False,
    order: list[int] | None = None,
    lr: float = 0.05,
    device: str = "cpu",
    compile_kwargs: dict[str, Any] | None = None,
    warmup_steps: int = 2,
) -> Record:
    """Train from a fixed seed and record outputs, grads, params and scaling state per step.

    ``schedule``: ``"plain"`` (forward then backward per microbatch),
    ``"1f1b"`` (forward of microbatch i+1 before backward of i), or
    ``"manual_recompute"`` (forward under no_grad, then an explicit
    begin_recompute() re-run with grad and backward, as pipeline engines do).
    ``evaluate``: a no_grad validation pass after every step.
    ``uncached``: drop cached weight casts before every forward.
    ``order``: the order in which each step's microbatches run.
    ``lr``: AdamW learning rate (0 keeps the weights fixed).
    ``device``: where the model and data live.
    ``compile_kwargs``: run the model through ``torch.compile(model, **compile_kwargs)``;
    after ``warmup_steps`` steps any recompilation is an error.
    """
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(recipe, backend=backend, **(manager_kwargs or {}))
    rec = Record(manager=manager)
    model = Model(manager, kind=kind, mechanism=mechanism, granularity=granularity).to(device, dtype)
    rec.model = model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    run = torch.compile(model, **compile_kwargs) if compile_kwargs is not None else model

    def fwd(x: Tensor) -> tuple[Tensor, Tensor]:
        if uncached:
            manager.invalidate_casts()
        if explicit_phases:
            with manager.forward():
                y = run(x)
        else:
            y = run(x)
        return y, (y.float() ** 2).mean()

    def bwd(loss: Tensor) -> None:
        if explicit_phases:
            with manager.backward():
                loss.backward()
        else:
            loss.backward()

    graphs_at_warmup = 0
    for step, step_inputs in enumerate(data(steps, microbatches, kind=kind)):
        if compile_kwargs is not None and step == warmup_steps:
            graphs_at_warmup = _compiled_graphs()
            torch._dynamo.config.error_on_recompile = True
        if order is not None:
            step_inputs = [step_inputs[i] for i in order]
        xs = [x.to(device, dtype).requires_grad_() for x in step_inputs]
        if schedule == "plain":
            for x in xs:
                y, loss = fwd(x)
                bwd(loss)
                rec.outputs.append(y.detach().clone())
        elif schedule == "1f1b":
            pending = [fwd(xs[0])]
            for x in xs[1:]:
                pending.append(fwd(x))
                y, loss = pending.pop(0)
                bwd(loss)
                rec.outputs.append(y.detach().clone())
            y, loss = pending.pop(0)
            bwd(loss)
            rec.outputs.append(y.detach().clone())
        elif schedule == "manual_recompute":
            for x in xs:
                manager.begin_forward()
                with torch.no_grad():
                    y_fwd = model(x)
                manager.begin_recompute()
                y = model(x)
                manager.begin_backward()
                loss = (y.float() ** 2).mean()
                loss.backward()
                assert torch.equal(y_fwd, y.detach())
                rec.outputs.append(y_fwd.clone())
        else:
            raise ValueError(schedule)
        rec.input_grads.append(torch.cat([x.grad.flatten() for x in xs]))
        rec.weight_grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        manager.step()
        if evaluate:
            with torch.no_grad():
                run(step_inputs[0].to(device, dtype) * 50)
        sd = manager.state_dict()
        rec.params.append({k: p.detach().clone() for k, p in model.named_parameters()})
        rec.histories.append(sd["amax_history"])
        rec.scales.append(sd["scale"])
        rec.step_amaxes.append(sd["step_amax"])
    if compile_kwargs is not None:
        torch._dynamo.config.error_on_recompile = False
        rec.compiles_after_warmup = _compiled_graphs() - graphs_at_warmup
    return rec


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _strip(name: str) -> str:
    """Parameter names without checkpoint wrapper prefixes, so runs compare by layer."""
    for junk in ("_checkpoint_wrapped_module.", "inner."):
        name = name.replace(junk, "")
    return name


def _series(rec: Record) -> dict[str, list[Any]]:
    """What :func:`assert_bitwise` compares: every per-step series of a run, parameters named by layer."""
    return {
        "outputs": rec.outputs,
        "input_grads": rec.input_grads,
        "weight_grads": [{_strip(k): v for k, v in d.items()} for d in rec.weight_grads],
        "params": [{_strip(k): v for k, v in d.items()} for d in rec.params],
        "amax_history": rec.histories,
        "scale": rec.scales,
    }


def assert_bitwise(a: Record, b: Record) -> None:
    """Every recorded tensor of two runs is ``torch.equal``, and every series is as long in both."""
    assert_same(_series(a), _series(b), name="run")


# ---------------------------------------------------------------- the cuda backend's comparisons
#: The recipes of the parity suite, one of each kind of scaling.
RECIPES = {
    "delayed": ss.DelayedScaling(history_len=4),
    "current": ss.CurrentScaling(),
    "rowwise": ss.RowwiseScaling(),
    # 8-element tiles and 8 x 8 weight blocks, not the default 128: the tests' layers are
    # DIM = 32 wide (64 and 128 inside the MLPs), so each row holds 4 or more tiles and each
    # weight 16 or more blocks, and the scales really differ within a tensor (with 128 a
    # row would be one tile, i.e. row-wise again, and a weight one block, i.e. per tensor).
    "block": ss.BlockScaling(block=8),
    # MX blocks are fixed at 32 elements: one per DIM-wide row, 2 or 4 per MLP row.
    "mxfp8": ss.MXFP8Scaling(),
    # NVFP4 with everything on: a delayed per-tensor level (so histories move), the random
    # Hadamard transform and stochastic rounding (so their state is what the invariants test).
    "nvfp4": ss.NVFP4Scaling(global_scale="delayed", history_len=4),
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Per FP8 format, the smallest NaN code without the sign bit: E4M3 has one (S.1111.111), E5M2 three (S.11111.xx).
_NAN_MIN = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7D}


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise, shapes and dtypes equal, every NaN encoding counted as one value (torch's CPU
    conversion and NVIDIA's give a negative NaN different FP8 bytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in _FP8:
        ca, cb = a.view(torch.uint8), b.view(torch.uint8)
        na, nb = (ca.to(torch.int32) & 0x7F) >= _NAN_MIN[a.dtype], (cb.to(torch.int32) & 0x7F) >= _NAN_MIN[a.dtype]
        return torch.equal(na, nb) and torch.equal(ca[~na], cb[~nb])
    if a.dtype == torch.float8_e8m0fnu:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
    return torch.equal(a, b)


def assert_same_quantized(got: ss.Quantized, want: ss.Quantized, what: str = "") -> None:
    """Every tensor of two casts' results :func:`same_bits`, in the same layout."""
    got_t, got_layout = got.flatten()
    want_t, want_layout = want.flatten()
    assert got_layout == want_layout, what
    for i, (g, w) in enumerate(zip(got_t, want_t, strict=True)):
        assert g.device == w.device, f"{what}: tensor {i} is on {g.device}, not {w.device}"
        assert same_bits(g, w), f"{what}: tensor {i} of the Quantized differs: {g} vs {w}"


def random_step_state(n: int, history_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(history, step_amax, scales, fp8_max, counts)`` of ``n`` slots for a step update: random
    histories (every 7th all zero), step amaxes with zeros, NaN, infinities and subnormals, both
    formats' maxima, random non-finite counts."""
    gen = torch.Generator().manual_seed(history_len)
    history = (torch.rand(n, history_len, generator=gen) * 10) ** 8
    history[::7] = 0.0
    step = (torch.rand(n, generator=gen) * 10) ** 6
    step[::5] = 0.0
    step[1::11] = float("nan")
    step[2::13] = float("inf")
    step[3::17] = 1e-40
    scales = torch.rand(n, generator=gen) + 0.5
    fp8_max = torch.where(torch.arange(n) % 3 == 0, 57344.0, 448.0)
    counts = torch.randint(0, 5, (n,), generator=gen)
    return history, step, scales, fp8_max, counts
