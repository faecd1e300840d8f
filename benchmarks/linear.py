"""Side-by-side timing of one Linear layer's forward + backward.

Compares, in one run on one device: torch.nn.Linear in the input dtype (the
baseline), and ss.nn.Linear on each backend that can run there. Prints
milliseconds per iteration and the ratio to the baseline.

    python benchmarks/linear.py                        # CPU, 1024 x 1024, 2048 tokens
    python benchmarks/linear.py --device cuda --dtype bfloat16 --size 8192 --tokens 16384
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import scalestate as ss


def _time(fn: Callable[[], None], device: torch.device, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--size", type=int, default=1024, help="in and out features")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the input")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    x = torch.randn(args.tokens, args.size, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(args.tokens, args.size, device=device, dtype=dtype)

    def step_of(layer: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            layer(x).backward(g)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return step

    base = torch.nn.Linear(args.size, args.size, device=device, dtype=dtype)
    rows = [("torch.nn.Linear", _time(step_of(base), device, args.iters))]
    for name, (ok, reason) in ss.backends.available_backends(device).items():
        if not ok:
            rows.append((f"ss.nn.Linear[{name}]", float("nan")))
            print(f"  ({name} skipped: {reason})")
            continue
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend=name)
        layer = ss.nn.Linear(args.size, args.size, manager=manager, device=device, dtype=dtype)
        layer.load_state_dict(base.state_dict())
        rows.append((f"ss.nn.Linear[{name}]", _time(step_of(layer), device, args.iters)))
    print(f"forward+backward, {args.tokens} x {args.size} @ {args.size} x {args.size}, {dtype}, {device}")
    for label, ms in rows:
        print(f"  {label:<28} {ms:9.3f} ms   x{ms / rows[0][1]:.2f} of torch.nn.Linear")


if __name__ == "__main__":
    main()
