"""Tensor parallelism: ss.nn.Linear sharded by DTensor's parallelize_module on a 2-rank CPU mesh.

Every rank that holds a shard of one logical tensor casts it with one scale, the
unsharded tensor's, and records the whole tensor's amax; training then follows the
unsharded model. One spawn (gloo, 2 ranks) runs every scenario; each rank trains the
unsharded reference itself (a manager with ``group=None``) and returns what the tests
compare.

Bitwise and tolerant parts. The scaling state (histories, scales) is compared bitwise.
The loss is linear in the output (``(y * c).sum()``): its gradient does not depend on
the output's bits, which the row-parallel layer sums in another order than the
unsharded product (torch's all-reduce of two partial products), so gradients, weights
and hence amaxes follow the unsharded run bit for bit; the loss itself differs by that
rounding, and so does the model's input gradient (column-parallel: two ranks' partial
products, all-reduced). Measured on a 2-core CPU: losses within 2.1e-7 of the largest
loss and input gradients within 2.1e-7 of their largest entry (both asserted at 1e-5 and
1e-6), parameters bitwise equal (asserted within 1e-6 relative); with sequence
parallelism, scales within 2.1e-7 relative (asserted 1e-6). With a loss whose gradient
does depend on the output's bits (mean squared error, measured apart), that rounding
reaches the output gradient's amax and the scales differ by up to 1.5e-7 relative.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tcp
from dist_harness import run_ranks
from torch import Tensor, nn

import scalestate as ss
from sac_programs import Policy

RECIPES = {"delayed": ss.DelayedScaling(history_len=4), "current": ss.CurrentScaling()}
STEPS = 5
LR = 0.005
#: Losses (relative to the largest |loss| of the run) and parameters (relative to their largest entry).
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-6

#: (name, recipe, backend, bias, manager group, checkpointed: False, True or a selective policy) of each
#: colwise/rowwise training run.
RUNS = [
    ("delayed-bias", "delayed", "emulation", True, "world", False),
    ("delayed-nobias", "delayed", "emulation", False, "world", False),
    ("current-bias", "current", "emulation", True, "world", False),
    ("current-nobias", "current", "emulation", False, "world", False),
    ("delayed-scaled_mm", "delayed", "scaled_mm", True, "world", False),
    ("delayed-unreduced", "delayed", "emulation", True, None, False),
    ("current-unreduced", "current", "emulation", False, None, False),
    ("delayed-checkpoint", "delayed", "emulation", True, "world", True),
    ("delayed-sac-all", "delayed", "emulation", True, "world", Policy()),
    ("delayed-sac-casts", "delayed", "emulation", True, "world",
     Policy(frozenset({"aten.linalg_vector_norm.default", "aten.mm.default", "aten.mul.Tensor"}))),
    ("delayed-sac-all-scaled_mm", "delayed", "scaled_mm", True, "world", Policy()),
]
#: The runs that checkpoint, and the run without checkpointing each must equal.
CHECKPOINTED = {"delayed-checkpoint": "delayed-bias", "delayed-sac-all": "delayed-bias",
                "delayed-sac-casts": "delayed-bias", "delayed-sac-all-scaled_mm": "delayed-scaled_mm"}


# ------------------------------------------------------------------ what each rank runs
def _mlp(manager: ss.ScalingStateManager, bias: bool, dims: tuple[int, ...] = (32, 64, 16)) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        if i:
            model.add_module(f"act{i}", nn.ReLU())
        model.add_module(f"fc{i + 1}", nn.Linear(a, b, bias=bias))
    return ss.nn.convert(model, manager)


def _data(shape: tuple[int, ...], out: int) -> list[tuple[Tensor, Tensor]]:
    """Inputs whose range grows every step (so that scales move), and fixed loss weights."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(shape, generator=gen) * (1 + 0.5 * i), torch.randn(*shape[:-1], out, generator=gen))
        for i in range(STEPS)
    ]


def _train(
    model: nn.Module,
    manager: ss.ScalingStateManager,
    data: list[tuple[Tensor, Tensor]],
    *,
    shard: Any = None,
    checkpoint: bool | Policy = False,
) -> dict[str, Any]:
    """STEPS optimizer steps of two microbatches each: the losses, the input gradients, and
    the scales after every step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if isinstance(checkpoint, Policy):  # selective: the shard casts' amax reductions run inside the region
        forward = functools.partial(tcp.checkpoint, model, use_reentrant=False, context_fn=checkpoint.context_fn())
    else:
        forward = functools.partial(tcp.checkpoint, model, use_reentrant=False) if checkpoint else model
    losses, grads, scales = [], [], []
    for x, c in data:
        for xm, cm in zip(x.split(x.shape[0] // 2), c.split(c.shape[0] // 2), strict=True):
            if shard is not None:
                xm, cm = shard(xm), shard(cm)
            xm = xm.clone().requires_grad_()
            with manager.forward():
                loss = (forward(xm) * cm).sum()
            with manager.backward():
                loss.backward()
            losses.append(loss.detach().clone())
            grads.append(xm.grad)
        opt.step()
        opt.zero_grad()
        manager.step()
        scales.append(manager.buffers()["scale"].clone())
    return {"losses": torch.stack(losses), "input_grads": torch.stack(grads), "scales": scales}


def _state(manager: ss.ScalingStateManager) -> dict[tuple[str, str], tuple[Tensor, Tensor]]:
    return {
        (name, role.name): (h.amax_history(role), h.scale(role))
        for name, h in manager.handles.items()
        for role in h.roles
    }


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {
        name: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
        for name, p in model.named_parameters()
    }


def _colrow(rank: int, world: int, run: tuple[Any, ...], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _, recipe, backend, bias, group, checkpoint = run
    data = _data((8, 32), 16)
    ref_m = ss.ScalingStateManager(RECIPES[recipe], backend=backend, group=None, collect_stats=True)
    ref = _mlp(ref_m, bias)
    ref_out = _train(ref, ref_m, data)
    kwargs = {} if group == "world" else {"group": None}
    tp_m = ss.ScalingStateManager(RECIPES[recipe], backend=backend, collect_stats=True, **kwargs)
    tp = parallelize_module(_mlp(tp_m, bias), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    tp_out = _train(tp, tp_m, data, checkpoint=checkpoint)
    local = {n: tuple(p.to_local().shape) for n, p in tp.named_parameters()}
    return {
        "ref": ref_out, "tp": tp_out, "ref_state": _state(ref_m), "tp_state": _state(tp_m),
        "ref_params": _params(ref), "tp_params": _params(tp), "local_shapes": local,
        "ref_stats": ref_m.stats().slots(), "tp_stats": tp_m.stats().slots(),
    }


def _sequence_parallel(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """Megatron-style sequence parallelism: 3-d activations sharded along the sequence."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    data = _data((4, 8, 32), 32)
    ref_m = ss.ScalingStateManager(RECIPES["delayed"], backend="emulation", group=None, collect_stats=True)
    ref_out = _train(_mlp(ref_m, True, (32, 32, 64, 32)), ref_m, data)
    tp_m = ss.ScalingStateManager(RECIPES["delayed"], backend="emulation", collect_stats=True)
    plan = {
        "fc1": SequenceParallel(),
        "fc2": ColwiseParallel(input_layouts=Shard(1)),
        "fc3": RowwiseParallel(output_layouts=Shard(1)),
    }
    tp = parallelize_module(_mlp(tp_m, True, (32, 32, 64, 32)), mesh, plan)
    tp_out = _train(tp, tp_m, data, shard=lambda t: t.chunk(world, dim=1)[rank])
    return {
        "ref": ref_out, "tp": tp_out, "ref_state": _state(ref_m), "tp_state": _state(tp_m),
        "ref_stats": ref_m.stats().slots(), "tp_stats": tp_m.stats().slots(),
    }


def _direct(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """ss.nn.linear called on DTensors directly: output placements, and the errors."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    m = ss.ScalingStateManager(RECIPES["delayed"], backend="emulation", group=None)
    layer = ss.nn.Linear(8, 4, manager=m, name="fc")
    w, b = layer.weight.detach(), layer.bias.detach()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def dt(t: Tensor, *placements: Any) -> Any:
        return distribute_tensor(t, mesh, list(placements))

    out: dict[str, Any] = {"placements": {}, "errors": {}}
    cases = {
        "column": (dt(x, Replicate()), dt(w, Shard(0)), dt(b, Shard(0))),
        "row": (dt(x, Shard(1)), dt(w, Shard(1)), dt(b, Replicate())),
        "row_nobias": (dt(x, Shard(1)), dt(w, Shard(1)), None),
        "rows_of_x": (dt(x, Shard(0)), dt(w, Replicate()), dt(b, Replicate())),
        "replicated": (dt(x, Replicate()), dt(w, Replicate()), dt(b, Replicate())),
    }
    for name, (xd, wd, bd) in cases.items():
        y = ss.nn.linear(xd, wd, bd, layer.handle)
        out["placements"][name] = (tuple(y.placements), y.full_tensor())
    out["unsharded"] = ss.nn.linear(x, w, b, layer.handle)
    out["unsharded_nobias"] = ss.nn.linear(x, w, None, layer.handle)
    bad = {
        "input_and_weight_rows": (dt(x, Shard(0)), dt(w, Shard(0)), None),
        "partial_input": (DTensor.from_local(x, mesh, [Partial()]), dt(w, Shard(0)), None),
        "plain_input": (x, dt(w, Shard(0)), None),
        "bias_placement": (dt(x, Replicate()), dt(w, Shard(0)), dt(b, Replicate())),
    }
    # NaN in rank 1's shard only: gloo's all-reduce MAX would drop it; the recorded amax is NaN on both ranks.
    nan_layer = ss.nn.Linear(8, 4, bias=False, manager=m, name="nan")
    x_nan = x.clone()
    x_nan[0, 7] = float("nan")
    with m.forward():
        ss.nn.linear(dt(x_nan, Shard(1)), dt(nan_layer.weight.detach(), Shard(1)), None, nan_layer.handle)
    sd = m.state_dict()
    out["nan_amax"] = sd["step_amax"][[tuple(s) for s in sd["slots"]].index(("nan", "input"))]
    # A replicated DTensor weight stepped by a foreach optimizer (torch bumps no version counter
    # of a DTensor there) between two casts of one scale epoch: the second cast sees the new values.
    rep = ss.nn.Linear(8, 4, bias=False, manager=m, name="rep")
    rep.weight = nn.Parameter(dt(rep.weight.detach(), Replicate()))
    xr = dt(x, Shard(0))
    with torch.no_grad():
        first = ss.nn.linear(xr, rep.weight, None, rep.handle).full_tensor()
    rep.weight.grad = dt(torch.ones(4, 8), Replicate())
    torch.optim.SGD([rep.weight], lr=0.5, foreach=True).step()
    with torch.no_grad():
        second = ss.nn.linear(xr, rep.weight, None, rep.handle).full_tensor()
    fresh_m = ss.ScalingStateManager(RECIPES["delayed"], backend="emulation", group=None)
    fresh = ss.nn.Linear(8, 4, bias=False, manager=fresh_m, name="rep")
    with torch.no_grad():
        fresh.weight.copy_(rep.weight.full_tensor())
        out["replicated_stepped"] = (first, second, fresh(x))
    for name, (xd, wd, bd) in bad.items():
        try:
            ss.nn.linear(xd, wd, bd, layer.handle)
        except ss.errors.CastError as e:
            out["errors"][name] = str(e)
        else:
            out["errors"][name] = None
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {run[0]: _colrow(rank, world, run, mesh) for run in RUNS}
    out["sequence_parallel"] = _sequence_parallel(rank, world, mesh)
    out["direct"] = _direct(rank, world, mesh)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, timeout=180.0)


# ------------------------------------------------------------------ the checks
NAMES = [run[0] for run in RUNS if not run[5]]


class TestColumnRowParallel:
    """fc1 ColwiseParallel, fc2 RowwiseParallel, trained 5 steps against the unsharded model."""

    def test_layers_are_sharded(self, ranks):
        """The weights really are split: rank-local shards hold half of each weight."""
        shapes = ranks[0]["delayed-bias"]["local_shapes"]
        assert shapes == {"fc1.weight": (32, 32), "fc1.bias": (32,), "fc2.weight": (16, 32), "fc2.bias": (16,)}

    @pytest.mark.parametrize("name", NAMES)
    def test_scaling_state_bitwise(self, ranks, name):
        """Every slot's amax history and scale equal the unsharded run's, bitwise, on every rank."""
        for rank in ranks:
            ref, tp = rank[name]["ref_state"], rank[name]["tp_state"]
            assert ref.keys() == tp.keys()
            for key, (history, scale) in ref.items():
                assert torch.equal(history, tp[key][0]), (name, key, history, tp[key][0])
                assert torch.equal(scale, tp[key][1]), (name, key)
            moved = rank[name]["ref"]["scales"]
            assert not torch.equal(moved[0], moved[-1])  # the scales did change from step to step

    @pytest.mark.parametrize("name", NAMES)
    def test_scales_agree_across_ranks_every_step(self, ranks, name):
        """After every step, both ranks hold the same scales, and so did the reference."""
        for step in range(STEPS):
            a, b = (rank[name]["tp"]["scales"][step] for rank in ranks)
            assert torch.equal(a, b)
            assert torch.equal(a, ranks[0][name]["ref"]["scales"][step])

    @pytest.mark.parametrize("name", NAMES)
    def test_training_matches_unsharded(self, ranks, name):
        """Losses within 1e-5 of the largest loss, parameters within 1e-6 relative."""
        for rank in ranks:
            run = rank[name]
            ref_l, tp_l = run["ref"]["losses"], run["tp"]["losses"]
            torch.testing.assert_close(tp_l, ref_l, rtol=0, atol=LOSS_RTOL * ref_l.abs().max().item())
            for pname, p in run["ref_params"].items():
                q = run["tp_params"][pname]
                torch.testing.assert_close(q, p, rtol=0, atol=PARAM_RTOL * p.abs().max().item())

    @pytest.mark.parametrize("name", NAMES)
    def test_input_gradients(self, ranks, name):
        """The model's input gradient (column-parallel: the all-reduced partial products) within 1e-6."""
        for rank in ranks:
            ref, tp = rank[name]["ref"]["input_grads"], rank[name]["tp"]["input_grads"]
            torch.testing.assert_close(tp, ref, rtol=0, atol=PARAM_RTOL * ref.abs().max().item())


class TestStats:
    """collect_stats=True: stats() of the sharded model equal the unsharded model's, counts included."""

    @pytest.mark.parametrize("name", [run[0] for run in RUNS])
    def test_stats_equal_unsharded(self, ranks, name):
        """Every slot's SlotStats (scale, amaxes, cast_elements, saturated and underflow fractions), on every rank."""
        for rank in ranks:
            ref, tp = rank[name]["ref_stats"], rank[name]["tp_stats"]
            assert [(s.name, s.role) for s in ref] == [(s.name, s.role) for s in tp]
            for want, got in zip(ref, tp, strict=True):
                assert got == want, (name, want, got)

    def test_counts_are_the_whole_tensors(self, ranks):
        """The comparison means something: each slot counted every element of its whole tensor, every microbatch."""
        counts = {(s.name, s.role.name): s.cast_elements for s in ranks[0]["delayed-bias"]["tp_stats"]}
        rows = 8  # of the step: two microbatches of 4 rows; the weight is cast once per microbatch
        assert counts == {
            ("fc1", "INPUT"): rows * 32, ("fc1", "WEIGHT"): 2 * 64 * 32, ("fc1", "GRAD_OUTPUT"): rows * 64,
            ("fc2", "INPUT"): rows * 64, ("fc2", "WEIGHT"): 2 * 16 * 64, ("fc2", "GRAD_OUTPUT"): rows * 16,
        }
        fractions = [s.saturated_fraction for s in ranks[0]["delayed-bias"]["tp_stats"]]
        assert all(f is not None and f < 0.5 for f in fractions)

    def test_sequence_parallel_counts(self, ranks):
        """Sequence-sharded activations: every slot counts the whole tensor's elements, as the unsharded model."""
        for rank in ranks:
            run = rank["sequence_parallel"]
            want = [(s.name, s.role, s.cast_elements) for s in run["ref_stats"]]
            assert [(s.name, s.role, s.cast_elements) for s in run["tp_stats"]] == want


class TestLogicalAmax:
    """Casts of shards record the amax of the whole tensor, whatever the manager reduces."""

    def test_nan_in_one_shard(self, ranks):
        """A NaN in one rank's shard makes the amax NaN on every rank (an all-reduce MAX may drop it)."""
        for rank in ranks:
            assert torch.isnan(rank["direct"]["nan_amax"])

    @pytest.mark.parametrize("name", ["delayed-unreduced", "current-unreduced"])
    def test_without_step_reduction(self, ranks, name):
        """A manager with group=None (no step all-reduce) still matches the unsharded state bitwise."""
        for rank in ranks:
            ref, tp = rank[name]["ref_state"], rank[name]["tp_state"]
            for key, (history, scale) in ref.items():
                assert torch.equal(history, tp[key][0]) and torch.equal(scale, tp[key][1]), (name, key)


class TestCheckpointed:
    @pytest.mark.parametrize("name", sorted(CHECKPOINTED))
    def test_recompute_parity(self, ranks, name):
        """Checkpointing the TP model, plainly or selectively (every op, or the casts' own ops, saved),
        changes nothing: state, losses and weights bitwise."""
        for rank in ranks:
            plain, ckpt = rank[CHECKPOINTED[name]], rank[name]
            assert torch.equal(plain["tp"]["losses"], ckpt["tp"]["losses"])
            for key, (history, scale) in plain["tp_state"].items():
                assert torch.equal(history, ckpt["tp_state"][key][0]) and torch.equal(scale, ckpt["tp_state"][key][1])
            for pname, p in plain["tp_params"].items():
                assert torch.equal(p, ckpt["tp_params"][pname])


class TestSequenceParallel:
    """fc1 SequenceParallel (replicated weight, sequence-sharded input), fc2 colwise, fc3 rowwise."""

    def test_scales_agree_across_ranks(self, ranks):
        """Both ranks hold the same scales after every step."""
        for step in range(STEPS):
            a, b = (rank["sequence_parallel"]["tp"]["scales"][step] for rank in ranks)
            assert torch.equal(a, b)

    def test_matches_unsharded(self, ranks):
        """Sum of the ranks' losses = the unsharded loss; the scales within 1e-6 relative.

        The replicated weight's gradient is the sum of two ranks' partial
        products (another rounding), so its weights, and the amaxes that follow,
        match within rounding instead of bitwise."""
        ref = ranks[0]["sequence_parallel"]["ref"]
        total = sum(rank["sequence_parallel"]["tp"]["losses"] for rank in ranks)
        torch.testing.assert_close(total, ref["losses"], rtol=0, atol=LOSS_RTOL * ref["losses"].abs().max().item())
        for step, scales in enumerate(ranks[0]["sequence_parallel"]["tp"]["scales"]):
            torch.testing.assert_close(scales, ref["scales"][step], rtol=1e-6, atol=0)


class TestDirectCalls:
    """ss.nn.linear on DTensors: the placements torch's F.linear gives, and clear errors."""

    def test_output_placements(self, ranks):
        """Column -> Shard(-1), row -> Partial, rows of x -> Shard(0), replicated -> Replicate; same values."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        got = ranks[0]["direct"]["placements"]
        want = {
            "column": (Shard(1),), "row": (Partial(),), "row_nobias": (Partial(),),
            "rows_of_x": (Shard(0),), "replicated": (Replicate(),),
        }
        assert {k: v[0] for k, v in got.items()} == want
        for name, (_, value) in got.items():
            unsharded = ranks[0]["direct"]["unsharded_nobias" if name == "row_nobias" else "unsharded"]
            torch.testing.assert_close(value, unsharded, rtol=1e-6, atol=1e-6, msg=name)

    def test_replicated_weight_never_stale(self, ranks):
        """A foreach optimizer step on a replicated DTensor weight within one scale epoch: the next cast sees it."""
        for rank in ranks:
            first, second, fresh = rank["direct"]["replicated_stepped"]
            assert not torch.equal(first, second)
            assert torch.equal(second, fresh)

    @pytest.mark.parametrize(
        ("case", "words"),
        [
            ("input_and_weight_rows", ["unsupported placements: input Shard(dim=0), weight Shard(dim=0)", "Colwise"]),
            ("partial_input", ["the input is a partial sum", "Redistribute it to Replicate() or Shard(...)"]),
            ("plain_input", ["the input is a plain tensor", "parallelize_module"]),
            ("bias_placement", ["the bias has placements (Replicate(),)", "must be (Shard(dim=0),)"]),
        ],
    )
    def test_errors_say_what_and_how(self, ranks, case, words):
        """Unsupported operands raise CastError naming what was got and what to do."""
        message = ranks[0]["direct"]["errors"][case]
        assert message is not None, f"{case}: no error"
        for w in words:
            assert w in message, message
