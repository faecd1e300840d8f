"""Long-run health of FP8 training: the demo model for 1,000 steps, FP8 beside fp32.

Trains the demo's ``TinyLM`` (``scalestate demo``'s ``DemoConfig`` defaults:
4 blocks, d_model 128, 4 microbatches x 8 sequences x 64 bytes per step,
AdamW at 3e-3 with 10% warmup) twice, from the same seed on the same batches,
one step of each in turn: in fp32, and in FP8 (delayed scaling, emulation
backend, unless ``--recipe`` / ``--backend`` say otherwise). Every ``--every``
steps it prints one line:

* the training loss of both runs (mean over the interval) and the gap, as a
  difference and in % of fp32;
* the held-out loss of both (the demo's evaluation: 4 batches of 16 held-out
  sequences) and its gap in %;
* cumulative counts over the FP8 run's training casts: *non-finite casts*
  (casts whose input held a NaN or an Inf) and *saturated elements* per role
  (``I``\\ nput / ``W``\\ eight / ``G``\\ rad-output): elements clipped at the
  format's max, ``|x * scale| > fp8_max``, with ``scale`` the one the cast used;
* elapsed time and an estimate of the time left.

At the end: the final held-out loss of both, the relative gap, PASS or FAIL
against the target (held-out FP8 loss within 1% of fp32, ``--target``), the
count totals per role with the number of casts and elements they are out of,
and the wall time. Exit status 0 on PASS, 1 on FAIL.

The counts are taken only in this script, by wrapping the FP8 manager's
backend ``cast`` on the instance: the wrapper calls the real cast, then reads
its request and result (``request.x``, ``request.spec.fp8_max``, the returned
``Quantized.scale``) and changes nothing, so FP8 training is bitwise what it is
unwrapped. The role of a cast is found from the row of ``request.scale`` in
``manager.buffers()["scale"]`` (a view of that row, per the backend contract).
Weight casts are cached (one per weight per step), so weights count once per
step; evaluation casts are not counted.

The demo's ``train()`` has no per-step hook, so the loop is written out here,
with the demo's data, split, model, optimizer, schedule and phase blocks
(``scalestate.demo.data``, ``scalestate.testing.TinyLM``, ``DemoConfig``), and
without activation checkpointing (which the demo shows to be bitwise the same
FP8 training) or data parallelism. On 2 shared CPU cores the 1,000 steps take
tens of minutes.

    python benchmarks/long_run.py
    python benchmarks/long_run.py --steps 300 --every 50
    python benchmarks/long_run.py --recipe current
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Literal

import attrs
import torch
from torch import Tensor

import scalestate as ss
from scalestate.backends import CastRequest
from scalestate.demo.data import batches, corpus, encode
from scalestate.demo.train import DemoConfig
from scalestate.errors import ScaleStateError
from scalestate.testing import CastSpy, TinyLM

_ROLES = ("input", "weight", "grad_output")  # ss.Role values


@attrs.define
class _RoleCounts:
    """Cumulative tallies of one role's casts."""

    casts: int = 0
    elements: int = 0
    #: Casts whose input held a NaN or an Inf.
    nonfinite_casts: int = 0
    #: Elements with ``|x * scale| > fp8_max``: clipped to the format's max.
    saturated: int = 0
    #: Casts with at least one saturated element.
    saturated_casts: int = 0
    #: Largest ``max|x * scale| / fp8_max`` of a cast with finite input (above 1: clipped).
    peak: float = 0.0


class CastCounter:
    """Tallies what each cast of the manager's backend did, per role (a :class:`scalestate.testing.CastSpy`).

    Reads requests and results only; the cast itself is the backend's own.
    """

    def __init__(self, manager: ss.ScalingStateManager) -> None:
        self.manager = manager
        self.counts = {role: _RoleCounts() for role in (*_ROLES, "unknown")}
        #: ``False`` while evaluating: casts pass through uncounted.
        self.enabled = True
        self._slot_roles: list[str] = [role.value for _, role in manager.slots]  # the buffers' row order
        # Watching for the rest of the script: the manager is this script's own.
        CastSpy(manager, on_cast=self._counted, keep=False).__enter__()

    def _counted(self, request: CastRequest, q: ss.Quantized) -> None:
        if self.enabled:
            self._tally(request, q)

    def _role_of(self, request: CastRequest) -> str:
        scales = self.manager.buffers()["scale"]
        row, rest = divmod(request.scale.data_ptr() - scales.data_ptr(), scales.element_size())
        if rest or not 0 <= row < len(self._slot_roles):
            return "unknown"
        return self._slot_roles[row]

    @torch.no_grad()
    def _tally(self, request: CastRequest, q: ss.Quantized) -> None:
        x = request.x if request.x.dtype == torch.float32 else request.x.float()
        fp8_max = request.spec.fp8_max
        c = self.counts[self._role_of(request)]
        c.casts += 1
        c.elements += x.numel()
        if not x.numel():
            return
        amax = torch.linalg.vector_norm(x, float("inf"))  # NaN if x holds a NaN, inf if an Inf
        finite = bool(torch.isfinite(amax))
        # the largest |x * scale| the backend saturates: float32 rounding is monotone in |x|
        peak = float(amax * q.scale) / fp8_max
        c.nonfinite_casts += not finite
        c.peak = max(c.peak, peak) if finite else c.peak
        if peak > 1 or not finite:  # only then can an element be clipped: count them
            saturated = int(torch.count_nonzero((x * q.scale).abs_() > fp8_max))
            c.saturated += saturated
            c.saturated_casts += saturated > 0

    def nonfinite(self) -> int:
        """Non-finite casts so far, all roles."""
        return sum(c.nonfinite_casts for c in self.counts.values())

    def saturated(self, role: str) -> int:
        """Saturated elements so far of ``role``."""
        return self.counts[role].saturated


@attrs.define
class _Run:
    """One of the two trainings, advanced a step at a time."""

    label: str
    model: TinyLM
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    manager: ss.ScalingStateManager | None
    losses: list[float] = attrs.field(factory=list)
    seconds: float = 0.0

    def step(self, step_batch: Tensor, microbatches: int) -> None:
        """One optimizer step over ``step_batch``, as the demo's ``train()`` makes it."""
        start = time.perf_counter()
        manager = self.manager
        total = 0.0
        for mb in step_batch.chunk(microbatches):
            with manager.forward() if manager else contextlib.nullcontext():
                loss = self.model.loss(mb) / microbatches
            with manager.backward() if manager else contextlib.nullcontext():
                torch.autograd.backward(loss)
            total += loss.item()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if manager:
            manager.step()
        self.losses.append(total)
        self.seconds += time.perf_counter() - start


def _make_run(cfg: DemoConfig, *, fp8: bool) -> _Run:
    """Model, optimizer and schedule of the demo's ``train()``; the same initial weights for both runs."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, seq_len=cfg.seq_len)
    manager = None
    if fp8:
        manager = ss.ScalingStateManager(cfg.make_recipe(), backend=cfg.backend, device="cpu")
        ss.nn.convert(model, manager)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    return _Run("fp8" if fp8 else "fp32", model, opt, sched, manager)


@torch.no_grad()
def _held_out(model: TinyLM, val: Tensor) -> float:
    """Mean loss over the held-out batches: an evaluation pass, so FP8 records nothing."""
    model.eval()
    loss = sum(model.loss(b).item() for b in val) / len(val)
    model.train()
    return loss


def _held_out_uncounted(run: _Run, counter: CastCounter, val: Tensor) -> float:
    """:func:`_held_out` of the FP8 run with its casts left out of the counts.

    The weight casts it makes would be cached and reused, uncounted, by the
    next training step: they are dropped, so that training casts every weight
    itself (the same bits from the same weight and scale).
    """
    counter.enabled = False
    try:
        return _held_out(run.model, val)
    finally:
        counter.enabled = True
        if run.manager is not None:
            run.manager.invalidate_casts()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def _pct(a: float, ref: float) -> float:
    return 100 * (a - ref) / ref


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of each run (default 1000)")
    parser.add_argument("--every", type=int, default=100, help="print a line every N steps (default 100)")
    parser.add_argument(
        "--backend", default="emulation", help="scalestate backend of the FP8 run (default emulation)"
    )
    parser.add_argument(
        "--recipe", choices=("delayed", "current"), default="delayed",
        help="FP8 scaling: ss.DelayedScaling (default) or ss.CurrentScaling",
    )
    parser.add_argument(
        "--eval-batches", type=int, default=16,
        help="held-out batches of 16 sequences per evaluation (default 16; the demo uses 4, a noisy estimate)",
    )
    parser.add_argument(
        "--target", type=float, default=1.0,
        help="PASS if the final held-out FP8 loss is within this %% of fp32's (default 1.0)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.every < 1 or args.eval_batches < 1:
        parser.error(
            f"--steps, --every and --eval-batches must be >= 1; got {args.steps}, {args.every}, {args.eval_batches}"
        )
    recipe: Literal["delayed", "current"] = args.recipe
    cfg = DemoConfig(steps=args.steps, backend=args.backend, recipe=recipe)
    try:
        fp8 = _make_run(cfg, fp8=True)
    except ScaleStateError as exc:
        parser.error(str(exc))
    fp32 = _make_run(cfg, fp8=False)
    assert fp8.manager is not None  # made with fp8=True
    counter = CastCounter(fp8.manager)

    tokens = encode(corpus())
    cut = int(tokens.numel() * 0.95)
    train_tokens, val_tokens = tokens[:cut], tokens[cut:]
    data = batches(
        train_tokens, steps=cfg.steps, batch=cfg.microbatches * cfg.microbatch_size,
        seq_len=cfg.seq_len, seed=cfg.seed + 1,
    )
    val = batches(val_tokens, steps=args.eval_batches, batch=16, seq_len=cfg.seq_len, seed=cfg.seed + 2)

    n_params = sum(p.numel() for p in fp32.model.parameters())
    print(
        f"long run: TinyLM ({cfg.n_layers} blocks, d_model {cfg.d_model}, {n_params / 1e6:.2f}M params), "
        f"{cfg.steps} steps of {cfg.microbatches} x {cfg.microbatch_size} sequences x {cfg.seq_len} bytes, "
        f"fp32 beside FP8\n"
        f"  FP8: {fp8.manager.recipe!r}, backend {cfg.backend!r}\n"
        f"  scalestate {ss.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"  loss: training loss, mean over the interval; held-out: {val.shape[0]} x {val.shape[1]} "
        f"held-out sequences; gap: FP8 - fp32\n"
        f"  counts are cumulative over FP8 training casts; sat I/W/G: saturated elements of "
        f"INPUT / WEIGHT / GRAD_OUTPUT casts\n",
        flush=True,
    )
    print(
        f"{'step':>5} {'fp32':>8} {'fp8':>8} {'gap':>8} {'gap %':>7} | {'held fp32':>9} {'held fp8':>9} "
        f"{'gap %':>7} | {'non-fin':>7} {'sat I/W/G':>17} | {'elapsed':>8} {'eta':>8}",
        flush=True,
    )
    held_a = held_b = float("nan")
    start = time.perf_counter()
    for i, step_batch in enumerate(data, start=1):
        fp32.step(step_batch, cfg.microbatches)
        fp8.step(step_batch, cfg.microbatches)
        if i == 1 and counter.counts["input"].casts == 0:
            raise SystemExit("long_run: the cast counter saw no INPUT casts; the backend wrapper is not in the path")
        if i % args.every and i != cfg.steps:
            continue
        window = i - (i - 1) // args.every * args.every
        a, b = (sum(r.losses[-window:]) / window for r in (fp32, fp8))
        held_a, held_b = _held_out(fp32.model, val), _held_out_uncounted(fp8, counter, val)
        elapsed = time.perf_counter() - start
        eta = elapsed / i * (cfg.steps - i)
        sat = "/".join(str(counter.saturated(r)) for r in _ROLES)
        print(
            f"{i:>5} {a:>8.4f} {b:>8.4f} {b - a:>+8.4f} {_pct(b, a):>+6.2f}% | {held_a:>9.4f} {held_b:>9.4f} "
            f"{_pct(held_b, held_a):>+6.2f}% | {counter.nonfinite():>7} {sat:>17} | "
            f"{_duration(elapsed):>8} {_duration(eta):>8}",
            flush=True,
        )
    wall = time.perf_counter() - start

    final_a, final_b = held_a, held_b  # the last line's: taken after the last step
    gap = _pct(final_b, final_a)
    ok = abs(gap) <= args.target
    print(f"\nfinal held-out loss after {cfg.steps} steps: fp32 {final_a:.4f}, FP8 {final_b:.4f}")
    print(f"relative gap: {gap:+.3f}% (target: within {args.target:g}%): {'PASS' if ok else 'FAIL'}")
    print("\nFP8 training casts, totals:")
    print(f"  {'role':<12}{'casts':>9}{'elements':>15}{'non-finite':>12}{'saturated':>11}{'fraction':>11}"
          f"{'casts with any':>16}{'peak':>8}")
    for role, c in counter.counts.items():
        if role == "unknown" and not c.casts:
            continue
        fraction = c.saturated / c.elements if c.elements else 0.0
        print(f"  {role:<12}{c.casts:>9}{c.elements:>15,}{c.nonfinite_casts:>12}{c.saturated:>11}"
              f"{fraction:>11.2e}{c.saturated_casts:>16}{c.peak:>8.3f}")
    total = sum(c.saturated for c in counter.counts.values())
    print(f"  total: {counter.nonfinite()} non-finite casts, {total} saturated elements")
    print("  (peak: the largest max|x * scale| / fp8_max of one cast; above 1, that cast clipped)")
    print(
        f"\nwall time {_duration(wall)} ({wall:.0f} s): fp32 training {fp32.seconds:.0f} s, "
        f"FP8 training {fp8.seconds:.0f} s (counting included), "
        f"{fp8.seconds / fp32.seconds:.2f}x"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
