"""The demo's FP8 time against its fp32 time, measured side by side in one run.

Trains the demo's model (``scalestate demo``'s ``DemoConfig``, plain FP8
without activation checkpointing, as the demo's third run) and the same
model in fp32, in turn, ``--rounds`` times, after one warm-up run of each,
and prints every round's seconds and ratio, then the median, the lowest and
the highest ratio. The goal this tracks: the FP8 run takes at most twice
the fp32 run's time.

Wall time on a shared or virtual machine moves by 5 to 10% from round to
round. ``--cpu-time`` measures instead with one thread and the process's CPU
time, which time the machine spends elsewhere does not count in: a steadier
ratio (within about 3%) for comparing two versions of the code, though not
the one users see with all threads.

    python benchmarks/demo_ratio.py                       # 5 rounds of 20 steps, all threads, wall time
    python benchmarks/demo_ratio.py --cpu-time --rounds 3 --steps 10
    python benchmarks/demo_ratio.py --recipe current --backend scaled_mm
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

from scalestate.demo.train import RECIPE_NAMES, DemoConfig, train


def cpu_seconds() -> float:
    """User and system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(cfg: DemoConfig, fp8: bool, clock: str) -> float:
    """Seconds one training run of ``cfg`` takes on ``clock`` (``"wall"`` or ``"cpu"``)."""
    now = time.perf_counter if clock == "wall" else cpu_seconds
    start = now()
    train(cfg, fp8=fp8, checkpoint=False, label="fp8" if fp8 else "fp32", show_progress=False)
    return now() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="fp32 and FP8 runs in turn, this many times (>= 1)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (>= 1)")
    parser.add_argument("--recipe", default="delayed", choices=RECIPE_NAMES, help="the demo's --recipe")
    parser.add_argument("--backend", default="emulation", help="the demo's --backend (default: emulation)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, process CPU time (see above)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1; got {args.rounds} and {args.steps}")
    clock = "cpu" if args.cpu_time else "wall"
    if args.cpu_time:
        torch.set_num_threads(1)
    cfg = DemoConfig(steps=args.steps, recipe=args.recipe, backend=args.backend)
    print(
        f"demo model, {args.steps} steps per run, recipe {args.recipe!r}, backend {args.backend!r}, "
        f"{torch.get_num_threads()} threads, {clock} time; warming up...",
        flush=True,
    )
    timed(cfg, fp8=False, clock=clock)
    timed(cfg, fp8=True, clock=clock)
    ratios = []
    print(f"{'round':>5}  {'fp32 (s)':>9}  {'FP8 (s)':>9}  {'FP8 / fp32':>10}", flush=True)
    for i in range(1, args.rounds + 1):
        fp32 = timed(cfg, fp8=False, clock=clock)
        fp8 = timed(cfg, fp8=True, clock=clock)
        ratios.append(fp8 / fp32)
        print(f"{i:>5}  {fp32:>9.2f}  {fp8:>9.2f}  {ratios[-1]:>9.3f}x", flush=True)
    median = statistics.median(ratios)
    print(f"FP8 / fp32: median x{median:.3f}, lowest x{min(ratios):.3f}, highest x{max(ratios):.3f} (goal: at most x2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
