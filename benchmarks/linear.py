"""Side-by-side timing of one Linear layer's forward + backward, per recipe and backend.

Compares, in one run on one device: torch.nn.Linear in the input dtype (the
baseline), and ss.nn.Linear for each recipe asked for on each backend that can
run it there. Prints milliseconds per iteration and the ratio to the baseline,
the ratio of every other backend to the emulation backend on the same recipe,
and the bytes the layer saves for backward (activations: the baseline saves
the high-precision input; ss.nn.Linear saves FP8 (or NVFP4) data and scales only)
and those its backend keeps from the forward to the backward (the emulation
backend's float32 copies of the cached weight cast and of the saved input:
``EmulationBackend.kept_bytes()``, the input's bounded by ``saved_copy_bytes``).
The variants are timed in turn, ``--rounds`` times over, and each keeps its
fastest round, so that a busy moment of the machine does not land on one of
them only.

    python benchmarks/linear.py                        # CPU, 1024 x 1024, 2048 tokens, delayed scaling
    python benchmarks/linear.py --recipes delayed,current,rowwise,block,mxfp8,nvfp4
    python benchmarks/linear.py --device cuda --dtype bfloat16 --size 8192 --tokens 16384
    python benchmarks/linear.py --experts 8,64         # also grouped MoE experts (ss.nn.GroupedLinear)

With ``--experts``, each count E adds rows for E experts of ``--expert-size``
features receiving ``--tokens`` tokens split evenly: a loop of
``torch.nn.functional.linear`` per expert (the baseline of these rows), one
``ss.nn.GroupedLinear``, and a loop of E ``ss.nn.Linear``; each row also gives
the operations it dispatches per forward + backward: in a step's first
microbatch (weights cast) and in the later ones (weight casts cached).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import scalestate as ss
from scalestate.testing import OpLog, saved_for_backward_bytes


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


RECIPES: dict[str, Callable[[], ss.Recipe]] = {
    "delayed": ss.DelayedScaling,
    "current": ss.CurrentScaling,
    "rowwise": ss.RowwiseScaling,
    "block": ss.BlockScaling,
    "mxfp8": ss.MXFP8Scaling,
    "nvfp4": ss.NVFP4Scaling,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--size", type=int, default=1024, help="in and out features")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the input")
    parser.add_argument("--iters", type=int, default=10, help="iterations per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all variants; each keeps its fastest")
    parser.add_argument(
        "--recipes", default="delayed", help=f"comma-separated, from: {', '.join(RECIPES)} (default: delayed)"
    )
    parser.add_argument("--experts", default="", help="comma-separated expert counts for grouped rows (e.g. 8,64)")
    parser.add_argument("--expert-size", type=int, default=256, help="in and out features of each expert")
    args = parser.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    x = torch.randn(args.tokens, args.size, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(args.tokens, args.size, device=device, dtype=dtype)

    def step_of(layer: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            layer(x).backward(g)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return step

    if args.iters < 1 or args.rounds < 1:
        parser.error("--iters and --rounds must be at least 1")
    base = torch.nn.Linear(args.size, args.size, device=device, dtype=dtype)
    def kept_by(layer: torch.nn.Module, backend: object) -> int:
        """Bytes ``backend`` keeps between the layer's forward and its backward (0 if it keeps none)."""
        kept = getattr(backend, "kept_bytes", None)
        if kept is None:
            return 0
        y = layer(x)
        held: int = kept()
        y.backward(g)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        return held

    # label -> (recipe, backend, step, bytes saved for backward, bytes the backend keeps); the baseline first
    variants = {"torch.nn.Linear": ("", "", step_of(base), saved_for_backward_bytes(step_of(base)), 0)}
    for name, (ok, reason) in ss.backends.available_backends(device).items():
        for recipe_name in recipes:
            label = f"ss.nn.Linear[{recipe_name}, {name}]"
            if not ok:
                print(f"  ({label} skipped: {reason})")
                continue
            manager = ss.ScalingStateManager(RECIPES[recipe_name](), backend=name)
            layer = ss.nn.Linear(args.size, args.size, manager=manager, device=device, dtype=dtype)
            layer.load_state_dict(base.state_dict())
            try:
                saved = saved_for_backward_bytes(step_of(layer))
            except ss.errors.BackendUnavailableError as e:
                print(f"  ({label} skipped: {e})")
                continue
            variants[label] = (recipe_name, name, step_of(layer), saved, kept_by(layer, manager.backend))
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for label, (_, _, step, _, _) in variants.items():
            best[label] = min(best[label], _time(step, device, args.iters))
    print(f"forward+backward, {args.tokens} x {args.size} @ {args.size} x {args.size}, {dtype}, {device} "
          f"(fastest of {args.rounds} rounds of {args.iters})")
    base_ms, base_saved = best["torch.nn.Linear"], variants["torch.nn.Linear"][3]
    emulated = {recipe: best[label] for label, (recipe, backend, *_) in variants.items() if backend == "emulation"}
    for label, (recipe, backend, _, saved, kept) in variants.items():
        ms = best[label]
        other = backend not in ("", "emulation") and recipe in emulated
        versus = f"   x{ms / emulated[recipe]:.2f} of emulation" if other else ""
        print(
            f"  {label:<40} {ms:9.3f} ms   x{ms / base_ms:.2f} of torch.nn.Linear   "
            f"saved for backward {saved / 2**20:7.2f} MiB (x{saved / base_saved:.2f}), "
            f"kept by the backend {kept / 2**20:6.2f} MiB{versus}"
        )
    for n in [int(e) for e in args.experts.split(",") if e.strip()]:
        grouped_rows(n, args.expert_size, args.tokens, recipes[0], device, dtype, args.iters)


def grouped_rows(
    n: int, size: int, tokens: int, recipe_name: str, device: torch.device, dtype: torch.dtype, iters: int
) -> None:
    """Time and count the operations of E experts: dense loop, GroupedLinear, and a loop of ss.nn.Linear."""
    sizes = [tokens // n + (e < tokens % n) for e in range(n)]
    x = torch.randn(tokens, size, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, size, device=device, dtype=dtype)
    weight = torch.randn(n, size, size, device=device, dtype=dtype) / size**0.5
    manager = ss.ScalingStateManager(RECIPES[recipe_name](), backend="emulation")
    grouped = ss.nn.GroupedLinear(n, size, size, manager=manager, name="grouped", device=device, dtype=dtype)
    layers = torch.nn.ModuleList(
        ss.nn.Linear(size, size, bias=False, manager=manager, name=f"loop.{e}", device=device, dtype=dtype)
        for e in range(n)
    )
    dense = torch.nn.Parameter(weight.clone())
    with torch.no_grad():
        grouped.weight.copy_(weight)
        for e, layer in enumerate(layers):
            layer.weight.copy_(weight[e])

    def dense_step() -> None:
        torch.cat([torch.nn.functional.linear(p, w) for p, w in zip(x.split(sizes), dense, strict=True)]).backward(g)

    def grouped_step() -> None:
        grouped(x, sizes).backward(g)

    def loop_step() -> None:
        torch.cat([layer(p) for layer, p in zip(layers, x.split(sizes), strict=True)]).backward(g)

    print(f"grouped experts: E = {n}, {size} x {size} each, {tokens} tokens ({sizes[0]} per expert), "
          f"{recipe_name}, emulation, {dtype}, {device}")
    base = None
    for label, fn in (("dense loop (F.linear)", dense_step), ("ss.nn.GroupedLinear", grouped_step),
                      (f"{n} x ss.nn.Linear", loop_step)):
        manager.step()  # a new scale epoch: the first count includes the weight casts of a step's first microbatch
        counts = []
        for _ in range(2):
            with OpLog() as log:
                fn()
            counts.append(len(log.ops))
        ms = _time(fn, device, iters)
        base = base or ms
        print(
            f"  {label:<40} {ms:9.3f} ms   x{ms / base:.2f} of the dense loop   ops per fwd+bwd: "
            f"{counts[0]:6d} first microbatch, {counts[1]:6d} later ones (weights cached)"
        )


if __name__ == "__main__":
    main()
