"""Cost per layer of default slot names: ``ss.nn.Linear(..., manager=m)`` without ``name=``.

Builds N small layers with default names ("linear", "linear_1", ...) and N with
explicit unique names, in one run, for each N, and prints microseconds per
layer and the ratio: the default name must cost the same whatever N.

    python benchmarks/naming.py                  # N = 300 and 3000
    python benchmarks/naming.py --layers 100,1000,10000
"""

from __future__ import annotations

import argparse
import time

import scalestate as ss


def per_layer_us(n: int, named: bool) -> float:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    start = time.perf_counter()
    for i in range(n):
        ss.nn.Linear(4, 4, manager=manager, name=f"layer{i}" if named else None, device="meta")
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="300,3000", help="comma-separated layer counts")
    args = parser.parse_args()
    per_layer_us(200, named=False)  # warm-up: first calls pay for imports and caches
    per_layer_us(200, named=True)
    print("layers   default name (us/layer)   explicit name (us/layer)   ratio")
    for n in (int(v) for v in args.layers.split(",") if v.strip()):
        # the best of 3 of each, interleaved: allocation and garbage collection add noise
        runs = [(per_layer_us(n, named=False), per_layer_us(n, named=True)) for _ in range(3)]
        default, explicit = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{n:>6}   {default:>23.1f}   {explicit:>24.1f}   x{default / explicit:.2f}")


if __name__ == "__main__":
    main()
