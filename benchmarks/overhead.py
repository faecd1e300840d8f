"""Per-call overhead of scalestate, measured side by side in one run.

Prints, on one CPU thread by default:

1. eager forward + backward of a tiny layer (16 x 16, 16 rows):
   ``torch.nn.Linear`` against ``ss.nn.Linear`` (emulation backend; delayed
   scaling after warm-up, and current scaling), as microseconds and ratios,
   and the same tensor operations written out by hand with no framework
   around them (at this size each operation's dispatch dominates: this row
   is the floor the operations themselves set), and delayed scaling with
   ``collect_stats=True``;
2. the same under ``torch.compile`` (inductor; compile time excluded);
3. the cost of ``collect_stats=True`` on a 1024 x 1024 layer (1024 rows);
4. ``manager.step()`` at 10, 1,000 and 10,000 slots (a slot is one
   (name, role) row), with the number of tensor operations it dispatches;
   and at 30,000 slots (10,000 ``ss.nn.Linear``) after a training pass, with
   every weight's cast cached against none (``invalidate_casts()`` first): a
   step voids cached casts by their epoch, so their number must not matter;
5. registration: 300 ``register()`` calls at 200 slots against at 10,000.

Timings are medians over ``--repeats`` rounds that alternate between the
compared variants, so machine noise hits both alike.

    python benchmarks/overhead.py
    python benchmarks/overhead.py --no-compile --repeats 11
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import scalestate as ss
from scalestate.testing import OpLog


def _per_call_us(fn: Callable[[], Any], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _side_by_side(fns: dict[str, Callable[[], Any]], iters: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each function, rounds alternating between them."""
    for fn in fns.values():  # warm-up
        _per_call_us(fn, max(iters // 10, 10))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_per_call_us(fn, iters))
    return {name: statistics.median(times) for name, times in samples.items()}


def _layers(compiled: bool, size: int = 16, stats_only: bool = False) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    x = torch.randn(size, size, requires_grad=True)
    ref = torch.nn.Linear(size, size)
    fns: dict[str, Callable[[], None]] = {}
    ref_call = torch.compile(ref) if compiled else ref
    fns["torch.nn.Linear"] = lambda: ref_call(x).sum().backward()
    variants = [("delayed", ss.DelayedScaling(), False), ("current", ss.CurrentScaling(), False)]
    if not compiled:
        variants.append(("delayed, collect_stats", ss.DelayedScaling(), True))
    if stats_only:
        variants = [variants[0], variants[2]]
    for label, recipe, collect in variants:
        manager = ss.ScalingStateManager(recipe, backend="emulation", collect_stats=collect)
        layer = ss.nn.Linear(size, size, manager=manager)
        call = torch.compile(layer) if compiled else layer
        for _ in range(3):  # give delayed scaling its history
            call(x).sum().backward()
            manager.step()

        def run(call: Callable[[torch.Tensor], torch.Tensor] = call) -> None:
            call(x).sum().backward()

        fns[f"ss.nn.Linear ({label})"] = run
    if not compiled and not stats_only:
        fns["same ops, hand-written"] = _hand_written()
    return fns


def _hand_written() -> Callable[[], None]:
    """The tensor operations of ss.nn.Linear's eager step (delayed scaling, cached weight), written
    out with no framework around them: what this machine's per-operation cost alone allows."""
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w, b = torch.randn(16, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    scales, acc = torch.ones(3), torch.zeros(3)

    def cast(t: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        amax = torch.linalg.vector_norm(t, float("inf"))
        scale = scales[row].clone()
        data = (t * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        torch.maximum(acc[row], amax, out=acc[row])
        return data, torch.reciprocal(scale)

    wd, ws = cast(w.detach(), 1)

    class Mm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xd: Any, xs: Any) -> Any:
            ctx.save_for_backward(xd, xs)
            return torch.mm(xd.float() * xs, (wd.float() * ws).t()) + b

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            xd, xs = ctx.saved_tensors
            gd, gs = cast(g, 2)
            gx = torch.mm(gd.float() * gs, wd.float() * ws)
            gw = torch.mm((gd.float() * gs).t(), xd.float() * xs)
            return gx, gw, g.sum(0), None, None

    def run() -> None:
        xd, xs = cast(x.detach(), 0)  # the weight's cast is cached: its amax is already recorded
        Mm.apply(x, w, b, xd, xs).sum().backward()

    return run


def _print_layers(title: str, times: dict[str, float]) -> None:
    base = times["torch.nn.Linear"]
    print(f"\n{title}")
    print(f"  {'layer':<36}{'us / iter':>12}{'ratio':>9}")
    for name, us in times.items():
        print(f"  {name:<36}{us:>12.1f}{us / base:>8.2f}x")


def _step(slots: int, iters: int, repeats: int) -> tuple[float, int]:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    for i in range(slots):
        manager.register(f"layer{i}", roles=(ss.Role.INPUT,))
    manager.step()
    with OpLog() as log:
        manager.step()
    return _side_by_side({"step": manager.step}, iters, repeats)["step"], len(log)


def _step_cached(layers: int, repeats: int) -> tuple[float, float]:
    """Median ms of step() after a training pass of ``layers`` Linears: every weight cached, and none."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    model = [ss.nn.Linear(4, 4, manager=manager, name=f"l{i}") for i in range(layers)]
    x = torch.randn(2, 4)
    times: dict[bool, list[float]] = {True: [], False: []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.errors.MissingStepWarning)  # one pass per layer, by design
        for r in range(repeats + 1):
            for cached in (True, False) if r % 2 else (False, True):
                for layer in model:
                    layer(x).sum().backward()
                if not cached:
                    manager.invalidate_casts()
                # Freeing 10,000 casts just before makes the allocator consolidate them at the step's
                # first large allocation: settle it in both cases, so that the step itself is measured.
                gc.collect()
                for _ in range(3):
                    torch.zeros(3 * layers, 16).abs_().amax()
                start = time.perf_counter()
                manager.step()
                if r:  # round 0 warms up
                    times[cached].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[True]), statistics.median(times[False])


def _registration(existing: int, new: int = 300) -> float:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    for i in range(existing):
        manager.register(f"old{i}", roles=(ss.Role.INPUT,))
    start = time.perf_counter()
    for i in range(new):
        manager.register(f"new{i}", roles=(ss.Role.INPUT,))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--iters", type=int, default=1000, help="calls per timing round")
    parser.add_argument("--repeats", type=int, default=7, help="alternating timing rounds (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"scalestate {ss.__version__}, torch {torch.__version__}, {args.threads} CPU thread(s)")

    _print_layers(
        "eager forward + backward, 16 x 16 layer, 16 rows",
        _side_by_side(_layers(compiled=False), args.iters, args.repeats),
    )
    if not args.no_compile:
        print("\n(compiling...)", flush=True)
        _print_layers(
            "torch.compile (inductor) forward + backward, same layer",
            _side_by_side(_layers(compiled=True), args.iters, args.repeats),
        )

    _print_layers(
        "collect_stats on a 1024 x 1024 layer, 1024 rows, eager forward + backward",
        _side_by_side(_layers(compiled=False, size=1024, stats_only=True), max(args.iters // 100, 5), args.repeats),
    )

    print("\nmanager.step()")
    print(f"  {'slots':>8}{'us / step':>12}{'tensor ops':>12}")
    for slots in (10, 1_000, 10_000):
        us, ops = _step(slots, max(args.iters // 10, 20), args.repeats)
        print(f"  {slots:>8}{us:>12.1f}{ops:>12}")

    cached, none = _step_cached(10_000, args.repeats)
    print(f"  30,000 slots after a pass: every weight cached {cached:.2f} ms, none {none:.2f} ms "
          f"(x{cached / none:.2f}; goal: cached casts add nothing)")

    small, large = _registration(200), _registration(10_000)
    print("\nregister(): 300 calls")
    print(f"  at 200 slots {small:.2f} ms, at 10,000 slots {large:.2f} ms ({large / small:.2f}x)")


if __name__ == "__main__":
    main()
