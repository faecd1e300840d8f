"""Mixture of experts across gloo ranks: replicated experts reduced like any slot, expert parallelism rank-local.

Each multi-process case runs under ``dist_harness.run_ranks``'s timeout, so a
hang (a rank waiting on an expert that ran elsewhere) fails in seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

import scalestate as ss
from scalestate.testing import assert_same

E, IN, OUT, TOKENS, STEPS, WORLD = 4, 32, 32, 12, 3, 2
RECIPES = {"delayed": ss.DelayedScaling(history_len=4), "mxfp8": ss.MXFP8Scaling()}
#: Experts no token of a rank reaches, per step and rank: an expert empty everywhere (step 1),
#: and experts empty on one rank only (step 2).
EXCLUDED = [[(), ()], [(3,), (3,)], [(1,), (0, 2)]]


def _tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step`` and the expert each is routed to."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(TOKENS, IN, generator=gen) * (1 + step)
    allowed = torch.tensor([e for e in range(E) if e not in EXCLUDED[step][rank]])
    return x, allowed[torch.randint(0, len(allowed), (TOKENS,), generator=gen)]


def _by_expert(x: torch.Tensor, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(expert, stable=True)
    return x[order], torch.bincount(expert, minlength=E)


def _state(layer: ss.nn.GroupedLinear) -> dict[str, list[torch.Tensor]]:
    """Each expert's histories and scales (by slot name) and weight."""
    return {
        h.name: [t.clone() for role in ss.Role for t in (h.amax_history(role), h.scale(role))]
        + [layer.weight[i].detach().clone()]
        for i, h in enumerate(layer.handles)
    }


def _train_step(manager: ss.ScalingStateManager, layer, opt, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, sizes in batches:
        with manager.forward():
            y = layer(x, sizes)
        with manager.backward():
            ((y**2).sum() * 0.01).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    manager.step()


def _layer(manager, n: int, name: str, **kwargs) -> ss.nn.GroupedLinear:
    torch.manual_seed(0)
    full = ss.nn.GroupedLinear(E, IN, OUT, manager=ss.ScalingStateManager(ss.DelayedScaling()), name="init")
    layer = ss.nn.GroupedLinear(n, IN, OUT, manager=manager, name=name, **kwargs)
    first = kwargs.get("first_expert", 0)
    with torch.no_grad():
        layer.weight.copy_(full.weight[first : first + n])
    return layer


def _worker(rank: int, world: int, recipe_name: str) -> dict[str, list]:
    recipe = RECIPES[recipe_name]
    # Replicated experts (data parallel): every rank holds every expert; slots are reduced at step().
    rep_manager = ss.ScalingStateManager(recipe, backend="emulation")
    rep = _layer(rep_manager, E, "rep")
    # Expert parallelism: this rank holds experts 2 * rank, 2 * rank + 1, registered rank-local.
    local = E // world
    ep_manager = ss.ScalingStateManager(recipe, backend="emulation")
    ep = _layer(ep_manager, local, "ep", reduce=False, first_expert=local * rank)
    opt = torch.optim.SGD(ep.parameters(), lr=0.1)
    out: dict[str, list] = {"rep": [], "ep": []}
    for step in range(STEPS):
        x, expert = _tokens(step, rank)
        xs, counts = _by_expert(x, expert)
        _train_step(rep_manager, rep, None, [(xs, counts)])
        out["rep"].append(_state(rep))
        # Dispatch: counts first, then the tokens, each rank's experts' rows to that rank.
        recv_counts = torch.empty(world, local, dtype=counts.dtype)
        dist.all_to_all_single(recv_counts, counts.view(world, local).contiguous())
        received = torch.empty(int(recv_counts.sum()), IN)
        dist.all_to_all_single(
            received, xs,
            output_split_sizes=recv_counts.sum(1).tolist(), input_split_sizes=counts.view(world, local).sum(1).tolist(),
        )
        # Rows arrive source-major; the experts take them expert-major (source order within each expert).
        pieces = received.split(recv_counts.flatten().tolist())
        ordered = torch.cat([pieces[src * local + e] for e in range(local) for src in range(world)])
        _train_step(ep_manager, ep, opt, [(ordered, recv_counts.sum(0))])
        out["ep"].append(_state(ep))
    return out


def _reference(recipe: ss.Recipe) -> dict[str, list]:
    """One process: the ranks' tokens as microbatches (replicated) or gathered per expert (expert parallel)."""
    manager = ss.ScalingStateManager(recipe, backend="emulation")
    rep = _layer(manager, E, "rep")
    ep_manager = ss.ScalingStateManager(recipe, backend="emulation")
    ep = _layer(ep_manager, E, "ep")
    opt = torch.optim.SGD(ep.parameters(), lr=0.1)
    out: dict[str, list] = {"rep": [], "ep": []}
    for step in range(STEPS):
        data = [_tokens(step, rank) for rank in range(WORLD)]
        _train_step(manager, rep, None, [_by_expert(x, expert) for x, expert in data])
        out["rep"].append(_state(rep))
        rows = [torch.cat([x[expert == e] for x, expert in data]) for e in range(E)]
        _train_step(ep_manager, ep, opt, [(torch.cat(rows), [len(r) for r in rows])])
        out["ep"].append(_state(ep))
    return out


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_experts_across_ranks_equal_one_process(recipe_name: str) -> None:
    """Replicated experts: every rank's state is the one-process run's, bitwise, with experts empty on one
    rank (reduced at step, no hang). Expert parallelism over all_to_all_single: each expert's state and
    weight after each step, on the rank holding it, is the one-process run's, bitwise."""
    ranks = run_ranks(_worker, WORLD, recipe_name, timeout=120.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a float32 product's bits may depend on the thread count
    try:
        want = _reference(RECIPES[recipe_name])
    finally:
        torch.set_num_threads(threads)
    for rank, got in enumerate(ranks):
        assert_same(got["rep"], want["rep"], name=f"replicated, rank {rank}")
        for step in range(STEPS):
            mine = {name: want["ep"][step][name] for name in got["ep"][step]}
            assert len(mine) == E // WORLD
            assert_same(got["ep"][step], mine, name=f"expert parallel, rank {rank}, step {step}")
    # Expert 3 received no token in step 1: its history did not move then.
    hist = [state["ep.3"][0] for state in want["ep"]]
    assert torch.equal(hist[0], hist[1]) and not torch.equal(hist[1], hist[2])
