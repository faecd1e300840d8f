"""`scalestate inspect` on grouped experts: one line per layer and role, idle experts named."""

from __future__ import annotations

import torch

import scalestate as ss
from scalestate.cli import main


def _state(tmp_path) -> str:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    experts = ss.nn.GroupedLinear(4, 16, 16, manager=manager, name="moe")
    head = ss.nn.Linear(16, 16, manager=manager, name="head")
    for _ in range(2):
        with manager.forward():
            y = head(experts(torch.randn(12, 16), [4, 0, 8, 0]))
        with manager.backward():
            y.square().mean().backward()
        manager.step()
    torch.save(manager.state_dict(), tmp_path / "s.pt")
    return str(tmp_path / "s.pt")


def test_inspect_groups_experts(tmp_path, capsys) -> None:
    path = _state(tmp_path)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    moe = [r for r in rows if "moe." in r]
    assert len(moe) == 3 and all("moe.{0..3} (4 slots)" in r for r in moe)  # one per role
    assert all("no-amax[1,3]" in r for r in moe), out  # the experts that never received a token
    assert " .. " in moe[0]  # the spread of the used experts' scales (1 for the idle ones)
    assert len([r for r in rows if "head" in r]) == 3
    assert "15 slots" in out  # the header still counts every slot

    assert main(["inspect", "--per-expert", path]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert len([r for r in rows if "moe." in r]) == 12


SMALL = ["--steps", "3", "--quiet", "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--microbatch-size", "2", "--microbatches", "2"]


def test_demo_moe_reports_bitwise_parity(capsys) -> None:
    """`scalestate demo --moe`: MoE blocks (experts and top-k said), FP8 against fp32, checkpointing bitwise."""
    assert main(["demo", "--moe", "--experts", "4", "--top-k", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "MoE:     every block's MLP is 4 experts, top-2 per token" in out
    assert "FP8 vs fp32 held-out loss" in out and out.count("EQUAL") == 4 and "OK:" in out


def test_demo_moe_refuses_bad_top_k(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit, match=r"--top-k must be in 1 \.\. --experts"):
        main(["demo", "--moe", "--experts", "4", "--top-k", "5", *SMALL])


def test_tiny_lm_moe_converts_experts_not_router() -> None:
    from scalestate.testing import MoE, TinyLM

    model = TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16, moe=(4, 2))
    router = model.blocks[0].moe.router
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    ss.nn.convert(model, manager)
    block = model.blocks[1]
    assert isinstance(block.moe, MoE) and block.moe.router is not None
    assert isinstance(block.moe.up, ss.nn.GroupedLinear) and model.blocks[0].moe.router is router
    assert "blocks.1.moe.down.3" in manager.handles and not any("router" in n for n in manager.handles)


def test_default_names_skip_taken_ones_in_order() -> None:
    """Default slot names: "linear", "linear_1", ... in order, skipping names taken meanwhile, per manager
    (the search resumes where it stopped, so a name is found in constant time: benchmarks/naming.py)."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    other = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    names = [ss.nn.Linear(2, 2, manager=manager, device="meta").handle.name for _ in range(3)]
    manager.register("linear_3")
    manager.register("linear_5")
    names += [ss.nn.Linear(2, 2, manager=manager, device="meta").handle.name for _ in range(2)]
    assert names == ["linear", "linear_1", "linear_2", "linear_4", "linear_6"]
    assert ss.nn.Linear(2, 2, manager=other, device="meta").handle.name == "linear"
    assert ss.nn.GroupedLinear(2, 2, 2, manager=manager).name == "grouped_linear"
