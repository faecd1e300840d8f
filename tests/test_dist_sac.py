"""FSDP2 (``fully_shard``) with selective activation checkpointing, on 2 gloo ranks.

Each block (an RMS norm and two ``ss.nn.Linear``) is wrapped by
``checkpoint_wrapper`` with a SAC ``context_fn`` and sharded by ``fully_shard``,
as large-model trainers do, with and without the FP8 all-gather. FSDP2 sets
every unsharded weight anew at each all-gather (which drops the layer's cached
weight cast) and re-gathers before each block's recompute; an evaluation pass
between a forward and its backward gathers and reshards once more. Every run
must equal the same sharded training without checkpointing, bitwise, on every
rank: the loss of every microbatch, the scaling state after every step and the
final parameters. The emulation backend runs every case; the scaled_mm backend
(whose products take the gathered FP8 weight's transposed copy) a few. One
spawn runs every case.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import scalestate as ss
from sac_programs import Policy, RMSNorm

DIM = 32
STEPS = 3
#: name -> (policy or None for no checkpointing, evaluate between forward and backward)
CASES: dict[str, tuple[Policy | None, bool]] = {
    "plain": (None, False),
    "none_saved": (Policy(frozenset()), False),
    "all_saved": (Policy(), False),
    "norm_div_mul_mm": (
        Policy(frozenset({"aten.linalg_vector_norm.default", "aten.div.Tensor", "aten.mul.Tensor",
                          "aten.mm.default"})),
        False,
    ),
    "every_other": (Policy(every=2), False),
    "all_saved_eval_between": (Policy(), True),
    "norm_eval_between": (Policy(frozenset({"aten.linalg_vector_norm.default"})), True),
}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


#: Cases also run with the scaled_mm backend, whose products take the gathered FP8 weight's transposed copy.
SCALED_MM = ("plain", "all_saved", "all_saved_eval_between")


def _run(rank: int, fp8: bool, policy: Policy | None, evaluate: bool, backend: str = "emulation") -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend=backend)
    torch.manual_seed(0)
    model = ss.nn.convert(nn.Sequential(_Block(), _Block()), manager, fp8_all_gather=fp8)
    for i, block in enumerate(model):
        if policy is not None:
            block = model[i] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=policy.context_fn()
            )
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7)) * 50
    losses, states = [], []
    for step in range(STEPS):
        batch = torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + step)
        for mb in batch.split(4):
            with manager.forward():
                loss = model(mb).square().mean()
            if evaluate:
                with torch.no_grad():
                    model(probe)  # FSDP gathers and reshards again; evaluation records nothing
            with manager.backward():
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()
        sd = manager.state_dict()
        states.append((sd["amax_history"], sd["scale"]))
    params = [p.full_tensor().detach() for p in model.parameters()]
    return {"losses": torch.stack(losses), "states": states, "params": params}


def _worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for fp8 in (False, True):
        for name, (policy, evaluate) in CASES.items():
            out[(fp8, name)] = _run(rank, fp8, policy, evaluate)
        for name in SCALED_MM:
            out[(fp8, f"scaled_mm_{name}")] = _run(rank, fp8, *CASES[name], backend="scaled_mm")
    return out


def _assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert torch.equal(got["losses"], ref["losses"])
    for (h, s), (rh, rs) in zip(got["states"], ref["states"], strict=True):
        assert torch.equal(h, rh) and torch.equal(s, rs)
    for p, rp in zip(got["params"], ref["params"], strict=True):
        assert torch.equal(p, rp)


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_ranks(_worker, 2, timeout=240.0)


class TestFSDP2WithSelectiveCheckpointing:
    @pytest.mark.parametrize("fp8", [False, True], ids=["fp32_gather", "fp8_gather"])
    @pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
    def test_bitwise_the_run_without_checkpointing(self, ranks, fp8, case):
        """Losses, scaling state after every step and final parameters: bitwise, on both ranks."""
        for r in ranks:
            _assert_same(r[(fp8, case)], r[(fp8, "plain")])

    @pytest.mark.parametrize("fp8", [False, True], ids=["fp32_gather", "fp8_gather"])
    @pytest.mark.parametrize("case", [c for c in SCALED_MM if c != "plain"])
    def test_scaled_mm_backend(self, ranks, fp8, case):
        """The scaled_mm backend (torch's kernel; the FP8 gathered weight's transposed copy): bitwise."""
        for r in ranks:
            _assert_same(r[(fp8, f"scaled_mm_{case}")], r[(fp8, "scaled_mm_plain")])

    def test_scales_moved_and_ranks_agree(self, ranks):
        """The runs did train: delayed scales left 1 and both ranks hold the same state."""
        for fp8 in (False, True):
            (h0, s0), (h1, s1) = ranks[0][(fp8, "plain")]["states"][-1], ranks[1][(fp8, "plain")]["states"][-1]
            assert torch.equal(h0, h1) and torch.equal(s0, s1)
            assert (s0 != 1).all()
