"""Pipeline parallelism: ``torch.distributed.pipelining``'s ``Schedule1F1B`` on gloo ranks.

Two pipeline stages, each a small stack of ``ss.nn.Linear`` layers with its
own ``ScalingStateManager``, run 4 microbatches per step for 5 AdamW steps:
on 2 ranks (a pure pipeline: a stage's slots exist on one rank only, so its
manager is made with ``group=None``) and on 4 ranks (2 stages x 2
data-parallel replicas on a 2-D DeviceMesh; each stage's manager reduces over
its replicas only, ``group=(mesh, "dp")``). The reference is one process, one
manager, the whole model, the same data, each microbatch's forward then
backward, gradients accumulated, then ``opt.step()`` and ``manager.step()``.
After every step, every slot's amax history and scale, every weight and every
microbatch's loss equal the reference's bitwise (``torch.equal``); nothing
needs a tolerance.

The schedule interleaves forwards and backwards of different microbatches
inside one ``schedule.step()`` call, so the loop cannot open a phase block
per microbatch. It sets none (the manager classifies each cast itself: a
forward with grad enabled is recorded, gradient casts in autograd's backward
are recorded, checkpoint recomputes there are not), or wraps the whole
``schedule.step()`` in one ``manager.forward()`` block; both are tested, with
and without activation checkpointing. (``manager.backward()`` around it raises
``PhaseError`` at the first forward cast.)

The stages are given their microbatch shapes (``input_args``, and
``output_args`` that require grad): without them, ``PipelineStage`` infers
shapes in its first step by running a forward and backward with grad enabled
on placeholder tensors (``torch.empty`` on later stages), which are training
casts to the manager, so their garbage amaxes would enter the histories.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as tcp
from dist_harness import run_ranks
from torch import Tensor, nn

import scalestate as ss

STEPS = 5
MICROBATCHES = 4
STAGES = 2
DIM = 32
ROWS = 16  # rows per step and data-parallel replica: 4 microbatches of 4
RECIPES = {"delayed": ss.DelayedScaling(history_len=4), "current": ss.CurrentScaling()}
BACKENDS = ("emulation", "scaled_mm")
#: How the loop drives the manager around ``schedule.step()``:
#: ``"plain"``: no phase; ``"checkpointed"``: no phase, every layer under non-reentrant
#: checkpointing (the recompute runs inside the schedule's backward); ``"forward_block"``:
#: checkpointed, with the whole ``schedule.step()`` inside one ``manager.forward()`` block.
LOOPS = ("plain", "checkpointed", "forward_block")
CONFIGS = [(r, b, loop) for r in sorted(RECIPES) for b in BACKENDS for loop in LOOPS]
TIMEOUT = 150.0  # seconds per multi-process run; both runs together take about 30 s on 2 cores


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = tcp.checkpoint(self.inner, x, use_reentrant=False)
        return out


def build_stage(manager: ss.ScalingStateManager, stage: int, *, checkpointed: bool = False) -> nn.Sequential:
    """Stage ``stage``: Linear, ReLU, Linear, with the same initial weights wherever it is built."""
    torch.manual_seed(100 + stage)
    layers: list[nn.Module] = [
        ss.nn.Linear(DIM, DIM, manager=manager, name=f"stage{stage}.fc0"),
        nn.ReLU(),
        ss.nn.Linear(DIM, DIM, manager=manager, name=f"stage{stage}.fc1"),
    ]
    if checkpointed:
        layers = [_Checkpointed(layer) for layer in layers]
    return nn.Sequential(*layers)


def batches(replica: int) -> list[tuple[Tensor, Tensor]]:
    """Per step, one data-parallel replica's input (its range grows with the step) and target."""
    gen = torch.Generator().manual_seed(7 + replica)
    return [
        (torch.randn(ROWS, DIM, generator=gen) * (1 + step), torch.randn(ROWS, DIM, generator=gen))
        for step in range(STEPS)
    ]


def loss_fn(y: Tensor, target: Tensor) -> Tensor:
    return ((y - target) ** 2).mean()


def snapshot(manager: ss.ScalingStateManager) -> dict[str, Tensor]:
    """Every slot's scale and amax history, by ``name/ROLE/what``."""
    out: dict[str, Tensor] = {}
    for name, handle in manager.handles.items():
        for role in handle.roles:
            out[f"{name}/{role.name}/scale"] = handle.scale(role)
            out[f"{name}/{role.name}/history"] = handle.amax_history(role)
    return out


def weights(module: nn.Module, stage: int) -> dict[str, Tensor]:
    """Parameters by stage and layer, without checkpoint wrapper prefixes."""
    return {f"{stage}.{k.replace('inner.', '')}": p.detach().clone() for k, p in module.named_parameters()}


# ------------------------------------------------------------------ pipeline
def pipeline(rank: int, world_size: int, configs: list[tuple[str, str, str]]) -> dict[Any, Any]:
    """One rank: stage ``rank`` of a 2-stage pipeline, or on 4 ranks stage x data-parallel replica."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    out: dict[Any, Any] = {}
    if world_size == STAGES:
        stage, replica, pp_group, dp_group, group = rank, 0, None, None, None
        out["default_group"] = default_group_error(stage)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        dp = world_size // STAGES
        mesh = init_device_mesh("cpu", (STAGES, dp), mesh_dim_names=("pp", "dp"))
        stage, replica = divmod(rank, dp)
        pp_group, dp_group, group = mesh.get_group("pp"), mesh.get_group("dp"), (mesh, "dp")
    out["stage"], out["replica"] = stage, replica
    mb = torch.zeros(ROWS // MICROBATCHES, DIM)
    for recipe, backend, loop in configs:
        manager = ss.ScalingStateManager(RECIPES[recipe], backend, group=group)
        module = build_stage(manager, stage, checkpointed=loop != "plain")
        # Static shapes (see the module docstring): outputs need gradients, and so do later stages' inputs.
        pstage = PipelineStage(
            module, stage, STAGES, torch.device("cpu"),
            input_args=(mb if stage == 0 else mb.clone().requires_grad_(),),
            output_args=(mb.clone().requires_grad_(),),
            group=pp_group,
        )
        schedule = Schedule1F1B(pstage, MICROBATCHES, loss_fn=loss_fn)
        opt = torch.optim.AdamW(module.parameters(), lr=0.05)
        rec: dict[str, list[Any]] = {"state": [], "weights": [], "losses": []}
        for x, target in batches(replica):
            losses: list[Tensor] = []
            args = (x,) if stage == 0 else ()
            kwargs: dict[str, Any] = {"target": target, "losses": losses} if stage == STAGES - 1 else {}
            if loop == "forward_block":
                with manager.forward():
                    schedule.step(*args, **kwargs)
            else:
                schedule.step(*args, **kwargs)
            if dp_group is not None:  # data parallel: average the replicas' gradients
                for p in module.parameters():
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dist.get_world_size(dp_group))
            opt.step()
            opt.zero_grad()
            manager.step()
            rec["state"].append(snapshot(manager))
            rec["weights"].append(weights(module, stage))
            rec["losses"].append([loss.detach().clone() for loss in losses])
        out[(recipe, backend, loop)] = rec
    return out


def default_group_error(stage: int) -> str:
    """What step() says when a pure pipeline's stage managers keep the default group (both stages)."""
    manager = ss.ScalingStateManager(RECIPES["delayed"], "emulation")
    build_stage(manager, stage)
    try:
        manager.step()
    except ss.errors.SlotMismatchError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def pure_pipeline() -> list[dict[Any, Any]]:
    return run_ranks(pipeline, STAGES, CONFIGS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def pipeline_x_data_parallel() -> list[dict[Any, Any]]:
    return run_ranks(pipeline, 2 * STAGES, CONFIGS, timeout=TIMEOUT)


# ----------------------------------------------------------------- reference
@functools.cache
def reference(recipe: str, backend: str, replicas: int) -> dict[str, list[Any]]:
    """The same model, data and microbatches in this process: one manager, no pipeline, no reduction.

    Gradients are combined as the ranks combine them: each replica's sum over
    its microbatches divided by their number (as the schedule does), then the
    replicas' sum divided by their number (as the all-reduce does).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        manager = ss.ScalingStateManager(RECIPES[recipe], backend, group=None)
        stages = [build_stage(manager, s) for s in range(STAGES)]
        model = nn.Sequential(*stages)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        data = [batches(r) for r in range(replicas)]
        rec: dict[str, list[Any]] = {"state": [], "weights": [], "losses": []}
        for step in range(STEPS):
            grads: list[list[Tensor]] = []
            losses: list[list[Tensor]] = []
            for r in range(replicas):
                x, target = data[r][step]
                losses.append([])
                for xm, tm in zip(x.tensor_split(MICROBATCHES), target.tensor_split(MICROBATCHES), strict=True):
                    loss = loss_fn(model(xm), tm)
                    loss.backward()
                    losses[r].append(loss.detach())
                grads.append([p.grad.div_(MICROBATCHES) for p in model.parameters()])
                opt.zero_grad()
            for i, p in enumerate(model.parameters()):
                total = grads[0][i]
                for r in range(1, replicas):
                    total = total + grads[r][i]
                p.grad = total / replicas if replicas > 1 else total
            opt.step()
            opt.zero_grad()
            manager.step()
            rec["state"].append(snapshot(manager))
            rec["weights"].append({k: v for s, st in enumerate(stages) for k, v in weights(st, s).items()})
            rec["losses"].append(losses)
        return rec
    finally:
        torch.set_num_threads(threads)


def assert_matches_reference(ranks: list[dict[Any, Any]], config: tuple[str, str, str]) -> None:
    """Every rank's slots, weights and losses equal the single-process reference's, bitwise, after every step."""
    ref = reference(*config[:2], replicas=len(ranks) // STAGES)
    for out in ranks:
        rec, stage, replica = out[config], out["stage"], out["replica"]
        where = f"stage {stage}, replica {replica}"
        for step in range(STEPS):
            state = rec["state"][step]
            assert len(state) == 2 * 3 * 2, f"{where}: expected 2 layers x 3 roles, got {sorted(state)}"
            for key, value in state.items():
                assert key.startswith(f"stage{stage}."), f"{where}: slot {key} of another stage"
                assert torch.equal(value, ref["state"][step][key]), f"{where}: {key} differs after step {step}"
            for key, value in rec["weights"][step].items():
                assert torch.equal(value, ref["weights"][step][key]), f"{where}: weight {key} differs after step {step}"
            got = rec["losses"][step]
            if stage == STAGES - 1:
                assert len(got) == MICROBATCHES
                for i, (a, b) in enumerate(zip(got, ref["losses"][step][replica], strict=True)):
                    assert torch.equal(a, b), f"{where}: loss of microbatch {i} differs at step {step}"
            else:
                assert got == []


def _id(config: tuple[str, str, str]) -> str:
    return "-".join(config)


class TestPurePipeline:
    """2 ranks, one stage each; each stage's manager has group=None."""

    @pytest.mark.parametrize("config", CONFIGS, ids=_id)
    def test_bitwise_equal_to_single_process(self, pure_pipeline, config):
        """Histories, scales, weights and losses equal the single-process run's after every step."""
        assert_matches_reference(pure_pipeline, config)

    def test_default_group_across_stages_is_a_clear_error(self, pure_pipeline):
        """Stage managers left on the default group fail in step() on both ranks, naming the slots."""
        for out in pure_pipeline:
            msg = out["default_group"]
            assert "registered different slots" in msg, msg
            assert "'stage0.fc0' INPUT on ranks [0], not on [1]" in msg, msg
            assert "'stage1.fc0' INPUT on ranks [1], not on [0]" in msg, msg


class TestPipelineWithDataParallel:
    """4 ranks on a (pp=2, dp=2) mesh; each stage's manager reduces over its dp replicas."""

    @pytest.mark.parametrize("config", CONFIGS, ids=_id)
    def test_bitwise_equal_to_single_process(self, pipeline_x_data_parallel, config):
        """Both replicas of a stage hold the single-process run's histories and scales, bitwise, after every step."""
        assert_matches_reference(pipeline_x_data_parallel, config)
