"""``scalestate demo``: run the three trainings and print the report."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch

import scalestate as ss
from scalestate.demo.data import MODULES, corpus
from scalestate.demo.train import FULL_BLOCK, DemoConfig, RunResult, data_parallel, train
from scalestate.errors import ArgumentValueError, ScaleStateError
from scalestate.granularity import granularity_label

__all__ = ["compare", "run_demo"]


def _config(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig(
        steps=args.steps, microbatches=args.microbatches, microbatch_size=args.microbatch_size,
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
        lr=args.lr, seed=args.seed, backend=args.backend, recipe=args.recipe,
        history_len=args.history_len, block=args.block,
        moe_experts=args.experts if args.moe else 0, top_k=args.top_k,
    )
    flags = {
        "steps": "--steps", "microbatches": "--microbatches", "microbatch_size": "--microbatch-size",
        "seq_len": "--seq-len", "d_model": "--d-model", "n_layers": "--layers", "n_heads": "--heads",
        "history_len": "--history-len", "block": "--block", "top_k": "--top-k",
    }
    for field, flag in flags.items():
        value = getattr(cfg, field)
        if value is not None and value < 1:
            raise SystemExit(f"scalestate demo: {flag} must be >= 1; got {value}")
    if args.moe and not 1 <= cfg.top_k <= args.experts:
        raise SystemExit(f"scalestate demo: --top-k must be in 1 .. --experts ({args.experts}); got {cfg.top_k}")
    if cfg.d_model % cfg.n_heads:
        raise SystemExit(f"scalestate demo: --d-model ({cfg.d_model}) must be divisible by --heads ({cfg.n_heads})")
    return cfg


def compare(a: RunResult, b: RunResult) -> dict[str, bool]:
    """Bitwise (``torch.equal``) comparison of two FP8 runs."""
    if a.scaling is None or b.scaling is None:
        raise ArgumentValueError("compare() needs two FP8 runs (with scaling state)")
    return {
        "training losses": a.losses == b.losses,
        "parameters": a.params.keys() == b.params.keys()
        and all(torch.equal(a.params[k], b.params[k]) for k in a.params),
        "amax histories": torch.equal(a.scaling["amax_history"], b.scaling["amax_history"]),
        "scales": torch.equal(a.scaling["scale"], b.scaling["scale"]),
    }


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 if the checkpointed and plain FP8 runs match bitwise (and, data
    parallel, every rank holds the same state), else 1.

    ``args.ranks > 1`` starts that many processes (gloo, CPU) unless this process
    is already one of a group (``torchrun`` sets ``WORLD_SIZE``)."""
    cfg = _config(args)
    try:
        recipe = cfg.make_recipe()
        ss.ScalingStateManager(recipe, backend=cfg.backend, device="cpu")  # fail fast on a bad backend
    except ScaleStateError as exc:
        print(f"scalestate demo: {exc}", file=sys.stderr)
        return 2
    if args.ranks < 1:
        raise SystemExit(f"scalestate demo: --ranks must be >= 1; got {args.ranks}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from scalestate.demo.ranks import join_group

        with join_group():
            return _run(args, cfg, recipe)
    if args.ranks > 1:
        from scalestate.demo.ranks import launch

        return launch(args.ranks, _run_rank, args)
    return _run(args, cfg, recipe)


def _run_rank(args: argparse.Namespace) -> int:
    """One rank of ``--ranks N`` (its process group already made)."""
    cfg = _config(args)
    return _run(args, cfg, cfg.make_recipe())


def _run(args: argparse.Namespace, cfg: DemoConfig, recipe: ss.Recipe) -> int:
    rank, world = data_parallel()
    say: Callable[..., Any] = print if rank == 0 else _silent
    n_params = sum(p.numel() for p in _probe_model(cfg).parameters())
    text = corpus()
    chars = len(text)
    say(
        f"scalestate demo: {cfg.n_layers}-block decoder LM ({n_params / 1e6:.2f}M params), "
        f"{cfg.steps} steps of {cfg.microbatches} microbatches x {cfg.microbatch_size} "
        f"sequences x {cfg.seq_len} bytes\n"
        f"  data:    docstrings of {len(MODULES)} standard-library modules ({chars:,} chars), 95/5 split\n"
        f"  FP8:     {recipe!r}, backend {cfg.backend!r}\n"
        f"{_layout_line(cfg, recipe)}"
        f"{_moe_line(cfg)}"
        f"{_ranks_line(world)}"
        f"  torch {torch.__version__}, {torch.get_num_threads()} threads\n",
        flush=True,
    )
    quiet = args.quiet or rank != 0
    runs: list[RunResult] = []
    if not args.no_fp32:
        runs.append(train(cfg, fp8=False, checkpoint=False, label="fp32", text=text, show_progress=not quiet))
    ckpt = train(cfg, fp8=True, checkpoint=True, label="fp8 + checkpointing", text=text, show_progress=not quiet)
    plain = train(cfg, fp8=True, checkpoint=False, label="fp8, no checkpointing", text=text, show_progress=not quiet)
    runs += [ckpt, plain]

    marks = sorted({max(1, cfg.steps * k // 4) for k in (1, 2, 3, 4)})
    window = _window_len(marks)
    header = "".join(f"{'step ' + str(s):>11}" for s in marks)
    what = f"mean of the {window} steps up to each mark" if window > 1 else "the loss at each mark"
    say(f"  training loss ({what}) and held-out loss:")
    say(f"  {'run':<24}{header}{'held-out':>11}{'time':>9}")
    for r in runs:
        losses = "".join(f"{_window(r.losses, s, window):>11.4f}" for s in marks)
        say(f"  {r.label:<24}{losses}{r.val_loss:>11.4f}{r.seconds:>8.1f}s")
    if not args.no_fp32:
        ref = runs[0]
        delta = ckpt.val_loss - ref.val_loss
        low = "NVFP4" if isinstance(recipe, ss.NVFP4Scaling) else "FP8"
        say(f"\n  {low} vs fp32 held-out loss: {delta:+.4f} ({100 * delta / ref.val_loss:+.2f}%)")
    checks = compare(ckpt, plain)
    say("\n  checkpointed vs plain FP8, bitwise (torch.equal):")
    for what, ok in checks.items():
        say(f"    {what:<18} {'EQUAL' if ok else 'DIFFERENT'}")
    same_everywhere = True
    if world > 1:
        say(f"\n  every rank against rank 0 after the last step, bitwise (torch.equal), {world} ranks:")
        for r in runs:
            for what, ok in (r.across_ranks or {}).items():
                same_everywhere &= ok
                say(f"    {r.label:<24}{what:<16} {'IDENTICAL' if ok else 'DIFFERENT'} on every rank")
    if all(checks.values()) and same_everywhere:
        extra = f"; every one of the {world} ranks holds the same scaling state" if world > 1 else ""
        say(f"\nOK: activation checkpointing changed nothing, bit for bit{extra}.")
        return 0
    if not all(checks.values()):
        say("\nFAIL: the checkpointed run diverged from the plain run.")
    if not same_everywhere:
        say("\nFAIL: the ranks ended with different state.")
    return 1


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def _layout_line(cfg: DemoConfig, recipe: ss.Recipe) -> str:
    """Where the scales of a fine-grained recipe lie ("" for one scale per tensor)."""
    if isinstance(recipe, ss.RowwiseScaling):
        what = "one scale per row, along each product's contraction dimension"
    elif isinstance(recipe, ss.BlockScaling):
        b = recipe.block
        tiles, blocks = (granularity_label(recipe.granularity(role)) for role in (ss.Role.INPUT, ss.Role.WEIGHT))
        what = f"{tiles} (inputs, output gradients), {blocks} (weights)"
        if cfg.block is None and b < FULL_BLOCK:
            what += f"; {b}, not {FULL_BLOCK}: --d-model is {cfg.d_model}"
    elif isinstance(recipe, ss.MXFP8Scaling):
        what = "one E8M0 power of two per 32 elements along each product's contraction dimension"
    elif isinstance(recipe, ss.NVFP4Scaling):
        what = (
            "E2M1 values, one E4M3 scale per 16 elements (16 x 16 weight blocks) and one float32 per tensor; "
            "random Hadamard transform and stochastic rounding from the manager's seed\n"
            f"  kept:    {'blocks.0 and ' if cfg.n_layers > 1 else ''}head in high precision "
            "(NVIDIA's recipe keeps the first and last layers)"
        )
    else:
        return ""
    return f"  scales:  {what}\n"


def _moe_line(cfg: DemoConfig) -> str:
    if not cfg.moe_experts:
        return ""
    return (
        f"  MoE:     every block's MLP is {cfg.moe_experts} experts, top-{cfg.top_k} per token "
        "(ss.nn.GroupedLinear: one slot per expert; router in high precision)\n"
    )


def _ranks_line(world: int) -> str:
    if world == 1:
        return ""
    return f"  ranks:   {world} (DistributedDataParallel, gloo); losses shown are rank 0's\n"


#: Steps averaged at each mark of the loss table, at most.
_WINDOW = 10


def _window_len(marks: list[int]) -> int:
    """Steps averaged at each mark: 10, or fewer where marks are closer, so that no step counts at two."""
    gaps = [marks[0], *(b - a for a, b in pairwise(marks))]
    return min(_WINDOW, *gaps)


def _window(losses: list[float], upto: int, window: int) -> float:
    recent = losses[max(0, upto - window) : upto]
    return sum(recent) / len(recent)


def _probe_model(cfg: DemoConfig) -> torch.nn.Module:
    from scalestate.testing import TinyLM

    with torch.device("meta"):
        return TinyLM(
            d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, seq_len=cfg.seq_len, moe=cfg.moe()
        )


