"""Cold torch.compile time of one model: float32, scalestate, torchao, each in a fresh process.

Each variant trains a TinyLM (d_model 256, 4 blocks, the default) compiled
with inductor, in its own Python process with its own empty inductor cache,
so nothing compiled by one run is reused by the next. Printed per variant:

- the first training step (forward, backward, the optimizer; for scalestate
  also ``manager.step()``), which includes compiling the forward and the
  backward graphs, and a later step, for comparison;
- the number of C++ kernels inductor compiled (shared objects in the cache):
  identical layers should share theirs, so this does not grow with depth;

and the ratios of scalestate's compile time (first step minus a later one)
to torchao's (float8 training, ``emulate=True``: the CPU runs no FP8
product) and to float32's. torchao's float8 training scales each tensor from
its own amax, as scalestate's current scaling does: that pair compares like
with like. Delayed scaling adds the history read and the choice of scale to
every cast. Variants run one after another for ``--repeats`` rounds; each
ratio is of medians.

    python benchmarks/compile_time.py
    python benchmarks/compile_time.py --layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: float32; scalestate's delayed and current scaling (emulation backend); torchao's tensorwise float8 training.
VARIANTS = ("float32", "ss delayed", "ss current", "torchao")


def _child(variant: str, layers: int, threads: int) -> None:
    """One cold run: prints a JSON line with the first and a later step's seconds."""
    import torch

    import scalestate as ss
    from scalestate.testing import TinyLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TinyLM(d_model=256, n_layers=layers, n_heads=4, seq_len=64)
    manager = None
    if variant.startswith("ss "):
        recipe = ss.DelayedScaling() if variant == "ss delayed" else ss.CurrentScaling()
        manager = ss.ScalingStateManager(recipe, backend="emulation")
        model = ss.nn.convert(model, manager)
    elif variant == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (8, 65))

    def step() -> float:
        start = time.perf_counter()
        model.loss(batch, forward=compiled).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if manager is not None:
            manager.step()
        return time.perf_counter() - start

    first = step()
    later = min(step() for _ in range(3))
    print(json.dumps({"first": first, "later": later}))


def _run(variant: str, layers: int, threads: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        cmd = [sys.executable, __file__, "--child", variant, "--layers", str(layers), "--threads", str(threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"{variant} run failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
        result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        result["kernels"] = sum(1 for _ in Path(cache).rglob("*.so"))
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three fresh runs (median)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.layers, args.threads)
        return
    import torch

    import scalestate as ss

    print(f"scalestate {ss.__version__}, torch {torch.__version__}, {args.threads} CPU thread(s), "
          f"TinyLM d_model 256, {args.layers} blocks, inductor, a fresh process and cache per run")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in VARIANTS:
            print(f"  round {r + 1}/{args.repeats}: {variant}...", flush=True)
            runs[variant].append(_run(variant, args.layers, args.threads))
    compile_s = {v: statistics.median(x["first"] - x["later"] for x in runs[v]) for v in VARIANTS}
    print(f"\n  {'variant':<12}{'first step s':>14}{'later step s':>14}{'compile s':>11}{'kernels':>9}")
    for v in VARIANTS:
        first = statistics.median(x["first"] for x in runs[v])
        later = statistics.median(x["later"] for x in runs[v])
        kernels = statistics.median(x["kernels"] for x in runs[v])
        print(f"  {v:<12}{first:>14.1f}{later:>14.3f}{compile_s[v]:>11.1f}{kernels:>9.0f}")
    print()
    for v in ("ss current", "ss delayed"):
        ours = compile_s[v]
        print(f"  compile time, {v} / torchao: x{ours / compile_s['torchao']:.2f}, "
              f"/ float32: x{ours / compile_s['float32']:.2f}")
    print("  (goal: at most x1.2 torchao's)")


if __name__ == "__main__":
    main()
