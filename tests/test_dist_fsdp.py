"""FSDP2 (``fully_shard``) with ss.nn layers: parity with DDP, meta-device init, FP8 all-gather.

Every multi-process case runs on gloo (CPU) through ``dist_harness.run_ranks``: one spawn
per world size runs every scenario and returns what the tests compare, so the spawn cost
(seconds) is paid twice in the whole file.

Tolerances: none. Every comparison is bitwise (``torch.equal``), losses included, at 2
and at 4 ranks: on gloo, FSDP2's gradient reduction and DDP's both sum each gradient
element over the ranks in one fixed order and divide by a power of two (exact), so
FSDP2 and DDP see the same weights at every step (measured: the largest loss
difference is 0 at both world sizes). The FP8 all-gather changes only the bytes on
the wire: it is compared bitwise with the high-precision all-gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import collectives, run_ranks
from torch import nn

import scalestate as ss

STEPS = 4
RECIPE = ss.DelayedScaling(history_len=4)
#: in -> hidden -> out: 24 and 6 rows shard evenly over 2 ranks; over 4, the 6 rows give
#: shards of 2, 2, 2 and 0 rows (FSDP pads them), which the FP8 all-gather must handle.
DIMS = (16, 24, 6)


# ------------------------------------------------------------------ building blocks
def _model(
    manager: ss.ScalingStateManager, *, fp8_all_gather: bool = False, bias: bool = False, device: str | None = None
) -> nn.Module:
    """A 2-layer MLP of ss.nn.Linear, the same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    i, h, o = DIMS
    net = nn.Sequential(nn.Linear(i, h, bias=bias, device=device), nn.ReLU(), nn.Linear(h, o, bias=bias, device=device))
    return ss.nn.convert(net, manager, fp8_all_gather=fp8_all_gather)


class _CountingAllGather:
    """FSDP2's default all-gather (``FSDPModule.set_custom_all_gather``), counting the bytes it gathers."""

    def __init__(self, sink: list[int]) -> None:
        self.sink = sink

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.sink.append(output_tensor.numel() * output_tensor.element_size())
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _shard(model: nn.Module, *, bf16: bool = False, sink: list[int] | None = None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
            if sink is not None:
                layer.set_custom_all_gather(_CountingAllGather(sink))  # type: ignore[operator]
    fully_shard(model, **kw)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    """This rank's batch of a step (2 microbatches); its range grows, so that scales move."""
    return torch.randn(8, DIMS[0], generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + step)


def _train(
    manager: ss.ScalingStateManager,
    model: nn.Module,
    rank: int,
    *,
    ddp: bool = False,
    phases: bool = False,
    per_step: Callable[[Callable[[], None]], Any] | None = None,
) -> dict[str, Any]:
    """SGD, STEPS steps of 2 microbatches, gradients synchronized once per step; losses and state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[torch.Tensor] = []
    traces = []

    def step(k: int) -> None:
        for i, mb in enumerate(_batch(rank, k).split(4)):
            last = i == 1
            if ddp:
                sync = contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]
            else:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
                sync = contextlib.nullcontext()
            with sync:
                with manager.forward() if phases else contextlib.nullcontext():
                    loss = model(mb).float().square().mean()
                with manager.backward() if phases else contextlib.nullcontext():
                    loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()

    for k in range(STEPS):
        if per_step is None:
            step(k)
        else:
            traces.append(per_step(lambda k=k: step(k))[1])  # type: ignore[misc]
    sd = manager.state_dict()
    return {
        "losses": torch.stack(losses),
        "history": sd["amax_history"],
        "scale": sd["scale"],
        "slots": sd["slots"],
        "traces": traces,
        "stats": manager.stats().slots(),
    }


def _probe(model: nn.Module) -> torch.Tensor:
    """An evaluation forward on the same input on every rank."""
    with torch.no_grad():
        return model(torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(7))).float()


def _fsdp(manager: ss.ScalingStateManager, rank: int, **kw: Any) -> dict[str, Any]:
    fp8 = kw.pop("fp8_all_gather", False)
    bf16 = kw.pop("bf16", False)
    bias = kw.pop("bias", False)
    sink: list[int] = []
    model = _shard(_model(manager, fp8_all_gather=fp8, bias=bias), bf16=bf16, sink=sink)
    seen: list[tuple[str, torch.dtype, torch.Tensor]] = []

    def look(module: nn.Module, args: Any) -> None:  # the unsharded weight, as the layer's forward sees it
        if not seen:
            seen.append((type(module.weight).__name__, module.weight.dtype, module.weight.float().clone()))

    model[0].register_forward_pre_hook(look)
    out = _train(manager, model, rank, **kw)
    out["unsharded"] = seen[0]
    out["gathered_bytes"] = sum(sink)
    before = manager.state_dict()
    out["probe"] = _probe(model)
    after = manager.state_dict()
    out["probe_recorded"] = any(not torch.equal(before[k], after[k]) for k in ("step_amax", "amax_history", "scale"))
    return out


def _materialized_on_meta(rank: int, world: int) -> dict[str, Any]:
    """Built, converted and sharded on meta, then to_empty(cpu), initialized, set to the CPU model's weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    m = ss.ScalingStateManager(RECIPE, backend="emulation")
    sink: list[int] = []
    model = _shard(_model(m, fp8_all_gather=True, device="meta"), sink=sink)
    model.to_empty(device="cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
    reference = _model(ss.ScalingStateManager(RECIPE, backend="emulation", group=None)).state_dict()
    mesh = init_device_mesh("cpu", (world,))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(reference[name], mesh, [Shard(0)]))
    out = _train(m, model, rank)
    out["device"] = str(m.device)
    out["gathered_bytes"] = sum(sink)
    return out


def _dcp_roundtrip(rank: int, path: str) -> dict[str, Any]:
    """A trained FP8-all-gather model saved with DCP loads into another one (whose casts were cached) exactly."""
    import torch.distributed.checkpoint as dcp

    def build(steps: int) -> nn.Module:
        m = ss.ScalingStateManager(RECIPE, backend="emulation")
        model = _shard(_model(m, fp8_all_gather=True, bias=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for k in range(steps):
            model(_batch(rank, k)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            m.step()
        return model

    saved = build(steps=2)
    state = saved.state_dict()
    dcp.save({"model": state}, checkpoint_id=path)
    loaded = build(steps=1)
    before = _probe(loaded)
    state = loaded.state_dict()
    dcp.load({"model": state}, checkpoint_id=path)
    loaded.load_state_dict(state)
    return {
        "types": sorted({type(v.to_local()).__name__ for v in state.values()}),
        "changed": not torch.equal(before, _probe(loaded)),
        "same": all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(saved.parameters(), loaded.parameters(), strict=True)
        ),
    }


def _worker(rank: int, world: int, path: str) -> dict[str, Any]:
    def new(collect_stats: bool = False) -> ss.ScalingStateManager:
        # group: the default (world) group
        return ss.ScalingStateManager(RECIPE, backend="emulation", collect_stats=collect_stats)

    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    m = new(collect_stats=True)
    out["ddp"] = _train(m, DDP(_model(m)), rank, ddp=True)
    m = new(collect_stats=True)
    out["ddp_fp8"] = _train(m, DDP(_model(m, fp8_all_gather=True)), rank, ddp=True)
    out["fsdp"] = _fsdp(new(collect_stats=True), rank)
    out["fsdp_phases"] = _fsdp(new(collect_stats=True), rank, phases=True)
    out["fp8"] = _fsdp(new(collect_stats=True), rank, fp8_all_gather=True)
    out["fp8_phases"] = _fsdp(new(collect_stats=True), rank, fp8_all_gather=True, phases=True)
    out["bf16"] = _fsdp(new(), rank, bf16=True, per_step=collectives)
    out["bf16_fp8"] = _fsdp(new(), rank, bf16=True, fp8_all_gather=True, per_step=collectives)
    out["meta_fp8"] = _materialized_on_meta(rank, world)
    if world == 2:
        def current() -> ss.ScalingStateManager:
            return ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation", collect_stats=True)

        out["current"] = _fsdp(current(), rank, bf16=True)
        out["current_fp8"] = _fsdp(current(), rank, bf16=True, fp8_all_gather=True)
        out["checkpointed_fp8"] = _checkpointed(new(collect_stats=True), rank)
        out["bias"] = _fsdp(new(), rank, bf16=True, bias=True)
        out["bias_fp8"] = _fsdp(new(), rank, bf16=True, bias=True, fp8_all_gather=True)
        out["no_group_error"] = _no_group_error(rank)
        out["dcp"] = _dcp_roundtrip(rank, path)
        out["fallback"] = _fallback(rank, fp8=False)
        out["fallback_fp8"] = _fallback(rank, fp8=True)
        state = out["fallback"]["after_poison"]
        out["loaded"] = _loaded(rank, False, state)
        out["loaded_fp8"] = _loaded(rank, True, state)
        out["edited"] = _edited_between_casts(rank, fp8=False)
        out["edited_fp8"] = _edited_between_casts(rank, fp8=True)
    return out


def _edited_between_casts(rank: int, fp8: bool) -> dict[str, Any]:
    """Weights edited in place after a cast of the same scale epoch (an EMA swap for evaluation).

    FSDP2 refills the unsharded weight at every all-gather with its version counter
    preserved, often at the same address; the next forward must still see the edit.
    """
    m = ss.ScalingStateManager(RECIPE, backend="emulation")
    model = _train_plain(m, rank, fp8, steps=1)
    before = _probe(model)  # cast and cached at this epoch
    outputs = []
    for _ in range(3):  # several tries: the freed and refilled storage lands at one address or another
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)
        edited = _probe(model)
        m.invalidate_casts()
        outputs.append((edited, _probe(model)))
    return {"before": before, "outputs": outputs}


def _checkpointed(manager: ss.ScalingStateManager, rank: int) -> dict[str, Any]:
    """FP8 all-gather with every layer under non-reentrant activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = _model(manager, fp8_all_gather=True)
    for i in (0, 2):
        model[i] = checkpoint_wrapper(model[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    from torch.distributed.fsdp import fully_shard

    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    return _train(manager, model, rank, phases=True)


def _fallback(rank: int, fp8: bool) -> dict[str, Any]:
    """on_nonfinite="fallback": step 2 sees an infinite weight (then restored), which zeroes the weight's history.

    The layers are then scaled just in time again until a finite step: the FP8 all-gather
    must reduce the shards' amaxes again, so that every rank casts with one scale.
    """
    m = ss.ScalingStateManager(RECIPE, backend="emulation", on_nonfinite="fallback")
    model = _shard(_model(m, fp8_all_gather=fp8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probes, cleared, after_poison = [], None, None
    for k in range(4):
        saved = [p.detach().clone() for p in model.parameters()]
        if k == 2:
            with torch.no_grad():
                model[0].weight.add_(float("inf"))
        model(_batch(rank, k)).float().square().mean().backward()
        with torch.no_grad():
            if k == 2:  # a skipped optimizer step: the good weights back
                for p, good in zip(model.parameters(), saved, strict=True):
                    p.copy_(good)
            else:
                opt.step()
        opt.zero_grad()
        m.step()
        if k == 2:
            cleared = m.handles["0"].amax_history(ss.Role.WEIGHT)
            after_poison = m.state_dict()
        probes.append(_probe(model))
    sd = m.state_dict()
    return {
        "probes": torch.stack(probes),
        "cleared": cleared,
        "history": sd["amax_history"],
        "scale": sd["scale"],
        "slots": sd["slots"],
        "after_poison": after_poison,
    }


def _loaded(rank: int, fp8: bool, state: dict[str, Any]) -> dict[str, Any]:
    """A state without the weight's history, loaded at the manager's own iteration, after a cached cast."""
    m = ss.ScalingStateManager(RECIPE, backend="emulation")
    model = _train_plain(m, rank, fp8, steps=state["iteration"])
    before = _probe(model)  # the slot has history: gathered with its scale, cast cached
    m.load_state_dict(state)
    return {"before": before, "after": _probe(model)}


def _train_plain(manager: ss.ScalingStateManager, rank: int, fp8: bool, steps: int) -> nn.Module:
    model = _shard(_model(manager, fp8_all_gather=fp8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for k in range(steps):
        model(_batch(rank, k)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        manager.step()
    return model


def _no_group_error(rank: int) -> str:
    m = ss.ScalingStateManager(RECIPE, backend="emulation", group=None)
    model = _shard(_model(m, fp8_all_gather=True))
    try:
        model(torch.randn(2, DIMS[0]))
    except ss.errors.ScaleStateError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("dcp")), timeout=240.0)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("dcp")), timeout=300.0)


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["slots"] == b["slots"]
    assert torch.equal(a["history"], b["history"])
    assert torch.equal(a["scale"], b["scale"])


# ------------------------------------------------------------------ tests
class TestFSDP2MatchesDDP:
    @pytest.mark.parametrize("world", [2, 4])
    @pytest.mark.parametrize("run", ["fsdp", "fsdp_phases", "fp8", "fp8_phases", "ddp_fp8"])
    def test_bitwise_on_every_rank(self, two, four, world, run):
        """FSDP2 (phase blocks or not, FP8 all-gather or not; uneven shards at 4 ranks) == DDP: state and losses."""
        results = two if world == 2 else four
        for rank, r in enumerate(results):
            _same_state(r[run], r["ddp"])
            _same_state(r[run], results[0][run])
            got, want = r[run]["losses"], r["ddp"]["losses"]
            print(f"{world} ranks, {run} vs DDP, rank {rank}: largest loss difference {(got - want).abs().max():.3g}")
            assert torch.equal(got, want)

    def test_scales_moved(self, two):
        """The comparison means something: scales changed at every step and differ between slots."""
        scale = two[0]["ddp"]["scale"]
        assert not (scale == 1).any()
        assert (two[0]["ddp"]["history"] > 0).all()


class TestMetaDevice:
    def test_materialized_model_trains_like_one_built_on_cpu(self, two, four):
        """Built on meta, converted, sharded, to_empty + init: state on CPU, training bitwise a CPU-built model's."""
        for results in (two, four):
            for r in results:
                assert r["meta_fp8"]["device"] == "cpu"
                _same_state(r["meta_fp8"], r["fp8"])
                assert torch.equal(r["meta_fp8"]["losses"], r["fp8"]["losses"])


class TestFP8AllGather:
    @pytest.mark.parametrize("world", [2, 4])
    def test_half_the_bytes_of_bf16(self, two, four, world):
        """With bf16 parameters, the FP8 all-gather moves exactly half the bytes (no bias: weights only)."""
        results = two if world == 2 else four
        for r in results:
            bf16, fp8 = r["bf16"]["gathered_bytes"], r["bf16_fp8"]["gathered_bytes"]
            print(f"{world} ranks: all-gather bytes over {STEPS} steps: bf16 {bf16}, fp8 {fp8}")
            assert bf16 > 0 and fp8 * 2 == bf16
            # The fp32 runs compared bitwise above gathered FP8 (a quarter of fp32's bytes).
            assert r["fp8"]["gathered_bytes"] * 4 == r["fsdp"]["gathered_bytes"] == r["meta_fp8"]["gathered_bytes"] * 4

    def test_bias_gathers_in_its_own_dtype(self, two):
        """A bias is gathered in bf16 beside the FP8 weight, in the same all-gather: only the weight bytes halve."""
        for r in two:
            _same_state(r["bias_fp8"], r["bias"])
            assert torch.equal(r["bias_fp8"]["losses"], r["bias"]["losses"])
            saved = r["bias"]["gathered_bytes"] - r["bias_fp8"]["gathered_bytes"]
            assert saved == r["bf16_fp8"]["gathered_bytes"]  # the FP8 weight bytes: half of bf16's

    @pytest.mark.parametrize("world", [2, 4])
    def test_same_training_as_the_bf16_all_gather(self, two, four, world):
        """The shard is rounded to bf16 before the cast: state, losses and outputs bitwise as without FP8 all-gather."""
        results = two if world == 2 else four
        for r in results:
            _same_state(r["bf16_fp8"], r["bf16"])
            assert torch.equal(r["bf16_fp8"]["losses"], r["bf16"]["losses"])
            assert torch.equal(r["bf16_fp8"]["probe"], r["bf16"]["probe"])
            assert torch.equal(r["fp8"]["probe"], r["fsdp"]["probe"])

    def test_outputs_identical_across_ranks_and_evaluation_records_nothing(self, two, four):
        """Every rank computes the same output from the gathered FP8 weight; an evaluation pass records nothing."""
        for results in (two, four):
            for r in results:
                assert torch.equal(r["bf16_fp8"]["probe"], results[0]["bf16_fp8"]["probe"])
                assert not r["bf16_fp8"]["probe_recorded"] and not r["fp8"]["probe_recorded"]

    def test_one_extra_all_reduce_per_weight_before_the_first_step_only(self, two, four):
        """Just-in-time scaling (no history): one all-reduce per weight in the first step; none later."""
        for results in (two, four):
            for r in results:
                plain, fp8 = r["bf16"]["traces"], r["bf16_fp8"]["traces"]
                assert fp8[0].count("gloo:all_reduce") - plain[0].count("gloo:all_reduce") == 2  # two weights
                assert [n for n in fp8[0] if n != "gloo:all_reduce"] == [n for n in plain[0] if n != "gloo:all_reduce"]
                assert fp8[1:] == plain[1:]  # from the first step on: the very same collectives

    def test_current_scaling(self, two):
        """CurrentScaling (every cast just in time): shard amaxes reduced; bitwise the bf16 all-gather's training."""
        for r in two:
            _same_state(r["current_fp8"], r["current"])
            assert torch.equal(r["current_fp8"]["losses"], r["current"]["losses"])
            assert r["current_fp8"]["stats"] == r["current"]["stats"]

    @pytest.mark.parametrize("world", [2, 4])
    @pytest.mark.parametrize("run", ["fp8", "fp8_phases", "fsdp", "fsdp_phases", "ddp_fp8"])
    def test_stats_equal_ddp(self, two, four, world, run):
        """collect_stats=True: every slot's stats (cast counts, saturation, underflow) equal DDP's, on every rank."""
        results = two if world == 2 else four
        for r in results:
            assert [(s.name, s.role) for s in r[run]["stats"]] == [(s.name, s.role) for s in r["ddp"]["stats"]]
            for want, got in zip(r["ddp"]["stats"], r[run]["stats"], strict=True):
                assert got == want, (run, want, got)

    def test_stats_count_the_whole_weight_once_per_use(self, two, four):
        """The comparison means something: the WEIGHT slots count the whole weight once per microbatch
        (not the shard, not the cast made before the all-gather), however unevenly it is sharded."""
        i, h, o = DIMS
        for results in (two, four):
            for r in results:
                weights = {s.name: s.cast_elements for s in r["fp8_phases"]["stats"] if s.role is ss.Role.WEIGHT}
                assert weights == {"0": 2 * h * i, "2": 2 * o * h}
        for r in two:  # recompute, and FSDP's re-gather inside backward, count nothing
            assert r["checkpointed_fp8"]["stats"] == r["fp8_phases"]["stats"]

    def test_activation_checkpointing(self, two):
        """Recompute (and FSDP's re-gather inside backward) records nothing: bitwise the run without checkpointing."""
        for r in two:
            _same_state(r["checkpointed_fp8"], r["fp8_phases"])
            assert torch.equal(r["checkpointed_fp8"]["losses"], r["fp8_phases"]["losses"])

    def test_needs_a_reducing_manager(self, two):
        """With group=None the shards' scales could differ: every rank refuses, before any all-gather."""
        for r in two:
            assert "fp8_all_gather" in r["no_group_error"] and "group=None" in r["no_group_error"]
            assert "fp8_all_gather=False" in r["no_group_error"]

    def test_the_unsharded_weight(self, two):
        """The layer sees a GatheredFP8Weight of the parameter dtype; other ops see its values (FP8-rounded)."""
        for r in two:
            name, dtype, values = r["bf16_fp8"]["unsharded"]
            plain_name, plain_dtype, plain_values = r["bf16"]["unsharded"]
            assert (name, dtype) == ("GatheredFP8Weight", torch.bfloat16)
            assert (plain_name, plain_dtype) == ("Parameter", torch.bfloat16)
            assert type(values) is torch.Tensor and values.dtype == torch.float32
            # E4M3 keeps 3 mantissa bits: relative error <= 2**-4 (values far above the subnormal range)
            torch.testing.assert_close(values, plain_values, rtol=2**-4, atol=1e-6)
            assert not torch.equal(values, plain_values)


class TestHistoryLost:
    def test_fallback_step_gathers_with_one_scale(self, two):
        """After a fallback step zeroed the weight's history, all ranks cast their shards with one scale."""
        for r in two:
            assert not r["fallback_fp8"]["cleared"].any()  # the comparison means something: history gone
            assert torch.equal(r["fallback_fp8"]["probes"], two[0]["fallback_fp8"]["probes"])
            assert torch.equal(r["fallback_fp8"]["probes"], r["fallback"]["probes"])
            _same_state(r["fallback_fp8"], r["fallback"])
            _same_state(r["fallback_fp8"], two[0]["fallback_fp8"])

    def test_load_without_history_at_the_same_iteration(self, two):
        """A loaded state whose weight slot has no history (same iteration, casts cached): one scale again."""
        for r in two:
            assert not torch.equal(r["loaded"]["before"], r["loaded"]["after"])
            for key in ("before", "after"):
                assert torch.equal(r["loaded_fp8"][key], two[0]["loaded_fp8"][key])
                assert torch.equal(r["loaded_fp8"][key], r["loaded"][key])


class TestEditedWeights:
    @pytest.mark.parametrize("fp8", [False, True])
    def test_an_in_place_edit_between_casts_of_one_epoch_is_seen(self, two, fp8):
        """After an in-place edit (no step), the next forward casts the edited weight, not a cached cast."""
        for r in two:
            result = r["edited_fp8" if fp8 else "edited"]
            previous = result["before"]
            for edited, recast in result["outputs"]:
                assert torch.equal(edited, recast)  # the same as a cast with every cache dropped
                assert not torch.equal(edited, previous)
                previous = edited


class TestCheckpoint:
    def test_distributed_checkpoint_round_trip(self, two):
        """DCP saves FP8-all-gather weights as plain shards and loads them into a model that already cached casts."""
        for r in two:
            assert r["dcp"] == {"types": ["Tensor"], "changed": True, "same": True}
