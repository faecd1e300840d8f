"""Cross-rank reduction (invariant 10): one collective per step, slots paired by name, clear
errors instead of hangs, DDP with microbatches and checkpointing, distributed checkpoints.

Every multi-process case runs on gloo (CPU) through ``dist_harness.run_ranks``, under a
timeout, so that a hang fails its test within seconds. Several checks share one spawn.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import collectives, run_ranks
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

import scalestate as ss
from scalestate.errors import PhaseError, ReductionError, ScaleStateError, SlotMismatchError

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT
RECIPES = {
    "delayed": ss.DelayedScaling(history_len=4),
    "current": ss.CurrentScaling(),
    # the per-tensor amaxes ride the one all-reduce; the RHT signs must be equal on every rank
    "nvfp4": ss.NVFP4Scaling(global_scale="delayed", history_len=4),
}


def _by_slot(manager: ss.ScalingStateManager) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """The state per (name, role): rows differ between ranks that registered in other orders."""
    sd = manager.state_dict()
    return {
        (name, role): {"history": sd["amax_history"][i], "scale": sd["scale"][i], "step_amax": sd["step_amax"][i]}
        for i, (name, role) in enumerate(sd["slots"])
    }


# ------------------------------------------------------------------ single process
class TestGroupArgument:
    def test_default_is_no_reduction_without_torch_distributed(self):
        assert not dist.is_initialized()
        assert ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation").group is None
        assert ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", group=None).group is None

    @pytest.mark.parametrize("bad", ["world", 3, (None, 0)])
    def test_bad_group_names_what_it_takes(self, bad):
        with pytest.raises(ScaleStateError, match="ProcessGroup, a 1-D DeviceMesh, a \\(DeviceMesh, dim\\) pair"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", group=bad)

    def test_reduce_flag_is_checked(self, delayed):
        with pytest.raises(ss.errors.SlotError, match="reduce must be True or False"):
            delayed.register("fc", roles=(I,), reduce="no")  # type: ignore[arg-type]

    def test_single_process_step_issues_no_collective(self, delayed):
        h = delayed.register("fc", roles=(I,))
        with delayed.forward():
            h.quantize(torch.randn(4), I)
        _, names = collectives(delayed.step)
        assert names == []


# ------------------------------------------------------------------ reduction
def _reduction_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. The default group; ranks register in different orders and see different data.
    m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    assert m.group is not None
    names = ["a", "b", "c"]
    order = names if rank % 2 == 0 else names[::-1]
    handles = {name: m.register(name, roles=(I, G)) for name in order}
    local_rank_only = m.register(f"expert{rank}", roles=(I,), reduce=False)
    steps = []
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        for k, name in enumerate(names):
            with m.forward():
                handles[name].quantize(torch.randn(8, generator=gen) * (rank + 1) * (k + 1) * (step + 1), I)
            handles[name].quantize(torch.randn(8, generator=gen) * (world - rank), G)
        with m.forward():
            local_rank_only.quantize(torch.full((4,), float(rank + 1 + step)), I)
        local = {key: v["step_amax"].clone() for key, v in _by_slot(m).items()}
        _, issued = collectives(m.step)
        after = _by_slot(m)
        steps.append({"local": local, "after": after, "collectives": issued})
    out["steps"] = steps
    out["local_scale"] = local_rank_only.scale(I)

    # 2. A DeviceMesh as the group.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    mm = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation", group=mesh)
    h = mm.register("fc", roles=(I,))
    with mm.forward():
        h.quantize(torch.full((4,), float(rank + 1)), I)
    mm.step()
    out["mesh_history"] = h.amax_history(I)
    try:  # an explicit group cannot be pickled; a deep copy reduces over the same group
        import pickle

        pickle.dumps(mm)
    except TypeError as e:
        out["pickle_error"] = str(e)
    twin = __import__("copy").deepcopy(mm)
    with twin.forward():
        twin.handles["fc"].quantize(torch.full((4,), float(10 * (rank + 1))), I)
    twin.step()
    out["twin_history"] = twin.handles["fc"].amax_history(I)
    if world == 4:  # a 2-D mesh: reduce over "dp" only
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        try:
            ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation", group=mesh2)
        except ScaleStateError as e:
            out["mesh2d_error"] = str(e)
        md = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation", group=(mesh2, "dp"))
        h = md.register("fc", roles=(I,))
        with md.forward():
            h.quantize(torch.full((4,), float(rank + 1)), I)
        md.step()
        out["dp_history"] = h.amax_history(I)

    # 3. A NaN seen on one rank only reaches every rank (a MAX reduction alone may drop it).
    for nan_rank in range(2):
        mnan = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        h = mnan.register("fc", roles=(I,))
        for step in range(2):
            with mnan.forward():
                bad = step == 1 and rank == nan_rank
                h.quantize(torch.full((4,), float("nan") if bad else 2.0 + step), I)
            mnan.step()
        out[f"nan_history_{nan_rank}"] = h.amax_history(I)
        out[f"nan_scale_{nan_rank}"] = h.scale(I)

    # The "raise" policy refuses the step on every rank, also where the NaN was not seen.
    mr = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite="raise")
    h = mr.register("fc", roles=(I,))
    with mr.forward():
        h.quantize(torch.full((4,), float("nan") if rank == world - 1 else 1.0), I)
    try:
        mr.step()
    except ss.errors.NonFiniteAmaxError as e:
        out["raise_error"] = str(e)

    # 4. group=None: nothing reduced, no collective.
    mn = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", group=None)
    h = mn.register("fc", roles=(I,))
    with mn.forward():
        h.quantize(torch.full((4,), float(rank + 1)), I)
    _, out["none_collectives"] = collectives(mn.step)
    out["none_history"] = h.amax_history(I)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_one_all_reduce_per_step_and_identical_state(world):
    results = run_ranks(_reduction_worker, world)
    for step in range(3):
        per_rank = [r["steps"][step] for r in results]
        first = per_rank[0]["collectives"] if step == 0 else None
        for r in per_rank:
            if step == 0:  # the one slot agreement (all_gather_object: sizes, then the lists), then the reduction
                assert r["collectives"] == ["gloo:all_gather", "gloo:all_gather", "gloo:all_reduce"]
            else:
                assert r["collectives"] == ["gloo:all_reduce"], f"step {step}: {r['collectives']}"
        assert first is None or first[-1] == "gloo:all_reduce"
        shared = [key for key in per_rank[0]["after"] if not key[0].startswith("expert")]
        assert len(shared) == 6
        for key in shared:
            expected = max(r["local"][key] for r in per_rank)
            assert expected > 0
            for rank, r in enumerate(per_rank):
                assert torch.equal(r["after"][key]["history"], per_rank[0]["after"][key]["history"]), (key, rank)
                assert torch.equal(r["after"][key]["scale"], per_rank[0]["after"][key]["scale"]), (key, rank)
                assert torch.equal(r["after"][key]["history"][-1], expected), (key, rank)
        for rank, r in enumerate(per_rank):  # rank-local slots keep their own amax
            assert r["after"][(f"expert{rank}", "input")]["history"][-1].item() == rank + 1 + step
    for r in results:
        assert r["raise_error"].startswith("step 0: non-finite amax recorded for 1 slot(s): 'fc' INPUT (nan)")
    for nan_rank in range(2):  # the NaN step is skipped on every rank: history not rolled, scale kept
        for r in results:
            assert r[f"nan_history_{nan_rank}"].tolist() == [0.0, 0.0, 0.0, 2.0]
            assert torch.equal(r[f"nan_scale_{nan_rank}"], results[0][f"nan_scale_{nan_rank}"])
    scales = [r["local_scale"] for r in results]
    assert len({s.item() for s in scales}) == world  # one per rank: not reduced
    for r in results:
        assert r["mesh_history"][-1].item() == world
        assert r["twin_history"][-1].item() == 10 * world
        assert "cannot pickle a manager built with group=" in r["pickle_error"]
        assert "manager.state_dict()" in r["pickle_error"]
        assert r["none_collectives"] == []
    assert sorted(r["none_history"][-1].item() for r in results) == [float(i + 1) for i in range(world)]
    if world == 4:  # dp groups of mesh (2, 2) with dims (dp, tp): ranks {0, 2} and {1, 3}
        assert [r["dp_history"][-1].item() for r in results] == [3.0, 4.0, 3.0, 4.0]
        assert "mesh['dp'] or (mesh, 'dp')" in results[0]["mesh2d_error"]


# ------------------------------------------------------------------ mismatches
def _mismatch_worker(rank: int, world: int) -> dict[str, str]:
    errors = {}
    cases = {
        "slots": (ss.DelayedScaling(), ["a", "b"] if rank == 0 else ["a", "c"]),
        "extra": (ss.DelayedScaling(), ["a"] + (["late"] if rank == world - 1 else [])),
        "recipe": (ss.DelayedScaling(history_len=4 + (rank == 1)), ["a"]),
    }
    for case, (recipe, names) in cases.items():
        m = ss.ScalingStateManager(recipe, backend="emulation")
        for name in names:
            h = m.register(name, roles=(I,))
            with m.forward():
                h.quantize(torch.ones(2), I)
        start = time.monotonic()
        try:
            m.step()
        except SlotMismatchError as e:
            errors[case] = str(e)
        errors[case + "_seconds"] = f"{time.monotonic() - start:.2f}"
    return errors


def test_mismatched_slots_raise_on_every_rank_without_a_hang():
    results = run_ranks(_mismatch_worker, 2)
    for rank, r in enumerate(results):
        assert "'b' INPUT on ranks [0], not on [1]" in r["slots"]
        assert "'c' INPUT on ranks [1], not on [0]" in r["slots"]
        assert "reduce=False" in r["slots"] and f"rank {rank}" in r["slots"]
        assert "'late' INPUT on ranks [1], not on [0]" in r["extra"]
        assert "different recipes" in r["recipe"] and "'history_len': 5" in r["recipe"]
        for case in ("slots", "extra", "recipe"):
            assert float(r[case + "_seconds"]) < 5.0  # an answer, not a timeout


def _late_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Slots registered after the first step on one rank only: an error everywhere, not a hang.
    m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    h = m.register("a", roles=(I,))
    with m.forward():
        h.quantize(torch.ones(2), I)
    m.step()
    if rank == 1:
        m.register("late", roles=(I,))
    start = time.monotonic()
    try:
        m.step()
    except SlotMismatchError as e:
        out["one_error"], out["one_seconds"] = str(e), time.monotonic() - start
    # The same slots registered late on every rank: agreed again and reduced in that very step.
    m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    h = m.register("a", roles=(I,))
    with m.forward():
        h.quantize(torch.ones(2), I)
    m.step()
    late = m.register("late", roles=(I,))
    with m.forward():
        late.quantize(torch.full((2,), float(rank + 1)), I)
    _, out["all_collectives"] = collectives(m.step)
    out["all_history"] = late.amax_history(I)
    _, out["after_collectives"] = collectives(m.step)
    # One rank's step refused by a PhaseError: the others learn it at once, and all recover.
    m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    h = m.register("fc", roles=(I, G))
    with m.forward() if rank == 1 else torch.no_grad():  # rank 0: its forward counted as evaluation
        h.quantize(torch.ones(2), I)
    h.quantize(torch.ones(2), G)
    start = time.monotonic()
    try:
        m.step()
    except (PhaseError, ReductionError) as e:
        out["refused_error"] = f"{type(e).__name__}: {e}"
    out["refused_seconds"] = time.monotonic() - start
    m.discard_step()
    with m.forward():
        h.quantize(torch.full((2,), float(rank + 1)), I)
    m.step()
    out["recovered_history"] = h.amax_history(I)
    return out


def test_late_registration_and_refusals_never_hang():
    results = run_ranks(_late_worker, 2)
    for rank, r in enumerate(results):
        assert "'late' INPUT on ranks [1], not on [0]" in r["one_error"] and r["one_seconds"] < 5.0
        # the one all-reduce (flag raised), the agreement on the new slots, their reduction
        assert r["all_collectives"] == ["gloo:all_reduce", "gloo:all_gather", "gloo:all_gather", "gloo:all_reduce"]
        assert r["all_history"][-1].item() == 2.0
        assert r["after_collectives"] == ["gloo:all_reduce"]
        expected = "PhaseError" if rank == 0 else "ReductionError"
        assert r["refused_error"].startswith(expected), r["refused_error"]
        assert r["refused_seconds"] < 5.0
        assert r["recovered_history"][-1].item() == 2.0
    assert "another rank of group" in results[1]["refused_error"] and "discard_step() on every rank" in results[1][
        "refused_error"
    ]


# ------------------------------------------------------------------ failures
def _failure_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    h = m.register("fc", roles=(I,))
    for step in range(2):
        with m.forward():
            h.quantize(torch.ones(4), I)
        if step == 1 and rank == 1:
            if mode == "dies":
                os._exit(3)
            if mode == "raises":
                raise ValueError("a bad batch on rank 1")
            time.sleep(8)  # "stalls": never reaches step() within the group's timeout
            return {}
        start = time.monotonic()
        try:
            m.step()
        except ReductionError as e:
            return {"error": str(e), "seconds": time.monotonic() - start, "usable_iteration": m.iteration}
    return {}


@pytest.mark.parametrize("mode", ["dies", "raises", "stalls"])
def test_a_failed_rank_makes_the_others_fail_fast_naming_step_and_group(mode):
    results = run_ranks(_failure_worker, 2, mode, pg_timeout=3.0, timeout=60.0, allow_failures=True)
    r = results[0]
    assert "error" in r, r
    assert r["error"].startswith("step 1: the cross-rank reduction") and "ranks [0, 1], backend gloo" in r["error"]
    assert "every rank must call manager.step()" in r["error"]
    assert r["seconds"] < 3.0 + 5.0
    assert r["usable_iteration"] == 1


# ------------------------------------------------------------------ DDP
def _ddp_model(manager: ss.ScalingStateManager) -> nn.Module:
    torch.manual_seed(0)
    model = ss.nn.convert(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)), manager
    )
    for i in (0, 2):  # activation checkpointing on the first two layers
        model[i] = checkpoint_wrapper(model[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def _ddp_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for label, recipe in RECIPES.items():
        m = ss.ScalingStateManager(recipe, backend="emulation")
        out[f"{label}/rht_signs"] = m.rht_signs()
        model = DDP(_ddp_model(m))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        steps = []
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * rank + step)
            for mb in range(3):
                x = torch.randn(4, 16, generator=gen) * (1 + step) * (1 + rank)
                sync = model.no_sync() if mb < 2 else contextlib.nullcontext()
                with sync:
                    with m.forward():
                        loss = model(x).square().mean()
                    with m.backward():
                        loss.backward()
            local = {key: v["step_amax"].clone() for key, v in _by_slot(m).items()}
            opt.step()
            opt.zero_grad()
            _, issued = collectives(m.step)
            params = torch.cat([p.detach().flatten() for p in model.parameters()])
            steps.append({"local": local, "after": _by_slot(m), "params": params, "collectives": issued})
        out[label] = steps
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_microbatches_and_checkpointing(world):
    results = run_ranks(_ddp_worker, world, timeout=180.0)
    for label in RECIPES:
        assert all(torch.equal(r[f"{label}/rht_signs"], results[0][f"{label}/rht_signs"]) for r in results)
        for step in range(4):
            per_rank = [r[label][step] for r in results]
            for rank, r in enumerate(per_rank):
                assert torch.equal(r["params"], per_rank[0]["params"]), (label, step, rank)
                # the first step also agrees on the slots (two all_gathers), as in the test above
                want = ["gloo:all_reduce"] if step else ["gloo:all_gather", "gloo:all_gather", "gloo:all_reduce"]
                assert r["collectives"] == want, (label, step, rank, r["collectives"])
            for key in per_rank[0]["after"]:
                expected = max(r["local"][key] for r in per_rank)
                for rank, r in enumerate(per_rank):
                    assert torch.equal(r["after"][key]["history"], per_rank[0]["after"][key]["history"])
                    assert torch.equal(r["after"][key]["scale"], per_rank[0]["after"][key]["scale"])
                    assert torch.equal(r["after"][key]["history"][-1], expected), (label, step, key, rank)


# ------------------------------------------------------------------ DCP
def _dcp_train(rank: int, m: ss.ScalingStateManager, model: nn.Module, opt: Any, steps: range) -> list[Any]:
    seen = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(4, 16, generator=gen) * (1 + step)
        with m.forward():
            loss = model(x).square().mean()
        with m.backward():
            loss.backward()
        opt.step()
        opt.zero_grad()
        m.step()
        seen.append((loss.detach(), m.state_dict(), torch.cat([p.detach().flatten() for p in model.parameters()])))
    return seen


def _unordered(rank: int) -> ss.ScalingStateManager:
    """A manager whose ranks register the same slots in different orders."""
    m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    names = ["a", "b", "c"] if rank % 2 == 0 else ["c", "b", "a"]
    for name in names:
        m.register(name, roles=(I,))
    return m


def _dcp_worker(rank: int, world: int, path: str, phase: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    def fresh() -> tuple[ss.ScalingStateManager, nn.Module, Any]:
        m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        model = DDP(_ddp_model(m))
        return m, model, torch.optim.AdamW(model.parameters(), lr=0.01)

    if phase == "save":
        m, model, opt = fresh()
        _dcp_train(rank, m, model, opt, range(3))
        unordered = _unordered(rank)
        for step in range(2):
            with unordered.forward():
                for k, name in enumerate("abc"):
                    unordered.handles[name].quantize(torch.full((2,), float((k + 1) * (10**step) + rank)), I)
            unordered.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "fp8": m}, checkpoint_id=path)
        # alone in its checkpoint, so that DCP spreads its keys over the ranks that save them
        dcp.save({"fp8": unordered}, checkpoint_id=path + "-unordered")
        saved = m.state_dict()
        return {
            "saved": saved,
            "unordered": _by_slot(unordered),
            "continued": _dcp_train(rank, m, model, opt, range(3, 6)),
        }
    m, model, opt = fresh()
    unordered = _unordered(rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "fp8": m}
    dcp.load(state, checkpoint_id=path)
    dcp.load({"fp8": unordered}, checkpoint_id=path + "-unordered")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = m.state_dict()
    if phase == "load_only":
        return {"loaded": loaded, "unordered": _by_slot(unordered)}
    return {
        "loaded": loaded,
        "unordered": _by_slot(unordered),
        "continued": _dcp_train(rank, m, model, opt, range(3, 6)),
    }


def test_distributed_checkpoint_resumes_bitwise_and_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_dcp_worker, 2, path, "save", timeout=120.0)
    loaded = run_ranks(_dcp_worker, 2, path, "load", timeout=120.0)
    for rank in range(2):
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(loaded[rank]["loaded"][key], saved[rank]["saved"][key])
        assert loaded[rank]["loaded"]["iteration"] == 3
        for (la, sa, pa), (lb, sb, pb) in zip(saved[rank]["continued"], loaded[rank]["continued"], strict=True):
            assert torch.equal(la, lb) and torch.equal(pa, pb)
            assert torch.equal(sa["amax_history"], sb["amax_history"]) and torch.equal(sa["scale"], sb["scale"])
    wider = run_ranks(_dcp_worker, 4, path, "load_only", timeout=120.0)
    for r in wider:
        for key in ("amax_history", "scale"):
            assert torch.equal(r["loaded"][key], saved[0]["saved"][key])
    # Ranks that registered in different orders: every slot gets its own values back.
    for r in [*loaded, *wider]:
        for key, values in saved[0]["unordered"].items():
            assert torch.equal(r["unordered"][key]["history"], values["history"]), key
            assert torch.equal(r["unordered"][key]["scale"], values["scale"]), key
    assert saved[0]["unordered"][("a", "input")]["history"][-1].item() == 11.0
