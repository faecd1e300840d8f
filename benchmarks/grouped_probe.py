"""Does torch's grouped FP8 GEMM give the bits of one scaled matmul per group? A GPU probe.

The ``scaled_mm`` backend multiplies each expert of a grouped layer with
torch's row-wise scaled matmul (``torch.nn.functional.scaled_mm``, the
kernel an ``ss.nn.Linear`` uses), so that expert ``e`` is bitwise that
``Linear``. ``torch.nn.functional.scaled_grouped_mm`` (row-wise on sm90)
would run all experts in one launch; whether it may replace the loop
without breaking that equality is a fact of the GPU's kernels, measured
here, with its speed:

- the forward product, rows by expert times each expert's weight
  (``(T, K)`` by ``(E, K, N)``, one empty expert);
- the weight-gradient product, each expert's tokens contracted
  (``(N, T)`` by ``(T, K)``, group scales along the tokens);

each against the loop of ``F.scaled_mm`` products on the same FP8 data and
scales: bitwise or not (how many elements differ, and by how much), and the
milliseconds of each.

    python benchmarks/grouped_probe.py            # on a CUDA GPU (sm90 for row-wise)
    python benchmarks/grouped_probe.py --tokens 8192 --dim 2048 --experts 8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW = F.ScalingType.RowWise if hasattr(F, "ScalingType") else None


def _ms(fn: Callable[[], torch.Tensor], repeats: int = 20) -> float:
    """Fastest of ``repeats`` timed calls, in milliseconds, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _compare(name: str, grouped: torch.Tensor, loop: torch.Tensor) -> bool:
    """Print whether the two are bitwise equal, and if not how they differ; True if equal."""
    same = torch.equal(grouped, loop)
    if same:
        print(f"  {name}: bitwise EQUAL ({grouped.numel()} elements)")
        return True
    diff = (grouped.float() - loop.float()).abs()
    differ = int((grouped != loop).sum())
    scale = loop.float().abs().max().clamp_min(1e-30)
    print(
        f"  {name}: DIFFERENT in {differ} of {grouped.numel()} elements; max |diff| {float(diff.max()):.3e} "
        f"({float(diff.max() / scale):.2e} of max |loop|)"
    )
    return False


def _fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * 64).to(torch.float8_e4m3fn)


def _scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device="cuda") * 0.01 + 0.001


def probe(tokens: int, dim: int, experts: int) -> bool:
    """Both products at ``tokens`` rows, ``dim`` x ``dim`` experts; True if both are bitwise equal."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = n = dim
    weights = torch.rand(experts, generator=gen, device="cuda")
    weights[1] = 0  # one expert with no tokens
    sizes = (weights / weights.sum() * tokens).floor().long()
    sizes[0] += tokens - int(sizes.sum())
    sizes = (sizes // 16) * 16  # the grouped kernel's alignment of each group's rows
    sizes[0] += tokens - int(sizes.sum())
    ends = sizes.cumsum(0)
    offs = ends.to(torch.int32)
    bounds = list(zip([0, *ends.tolist()[:-1]], ends.tolist(), strict=True))
    print(f"tokens {tokens}, experts {experts} (sizes {sizes.tolist()}), {k} x {n} each, E4M3, bfloat16 out")
    equal = True

    # forward: x (T, K) row-wise along K, times each expert's w_e.T, w (E, N, K) row-wise along K
    x, w = _fp8((tokens, k), gen), _fp8((experts, n, k), gen)
    sx, sw = _scales((tokens,), gen), _scales((experts, n), gen)

    def forward_grouped() -> torch.Tensor:
        return F.scaled_grouped_mm(x, w.transpose(-2, -1), sx, ROW, sw, ROW, offs=offs, output_dtype=torch.bfloat16)

    def forward_loop() -> torch.Tensor:
        parts = [
            F.scaled_mm(x[s:e], w[g].t(), sx[s:e, None], ROW, sw[g][None, :], ROW, output_dtype=torch.bfloat16)
            for g, (s, e) in enumerate(bounds)
            if e > s
        ]
        return torch.cat(parts)

    try:
        grouped = forward_grouped()
        equal &= _compare("forward (T, K) x (E, K, N)", grouped, forward_loop())
        print(f"    {_ms(forward_grouped):.3f} ms grouped, {_ms(forward_loop):.3f} ms loop")
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"  forward: refused: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        equal = False

    # weight gradient: dy.T (N, T) by x (T, K), each expert's tokens contracted, scales per group along them
    dy_t = _fp8((n, tokens), gen)
    x_cols = _fp8((k, tokens), gen).t()  # (T, K), column-major
    sa, sb = _scales((experts * n,), gen), _scales((experts * k,), gen)

    def wgrad_grouped() -> torch.Tensor:
        return F.scaled_grouped_mm(dy_t, x_cols, sa, ROW, sb, ROW, offs=offs, output_dtype=torch.bfloat16)

    def wgrad_loop() -> torch.Tensor:
        out = torch.zeros(experts, n, k, dtype=torch.bfloat16, device="cuda")
        for g, (s, e) in enumerate(bounds):
            if e > s:
                a_g = dy_t[:, s:e].contiguous()
                b_g = x_cols[s:e].t().contiguous().t()
                out[g] = F.scaled_mm(
                    a_g, b_g, sa[g * n : (g + 1) * n, None], ROW, sb[None, g * k : (g + 1) * k], ROW,
                    output_dtype=torch.bfloat16,
                )
        return out

    try:
        equal &= _compare("weight gradient (N, T) x (T, K)", wgrad_grouped(), wgrad_loop())
        print(f"    {_ms(wgrad_grouped):.3f} ms grouped, {_ms(wgrad_loop):.3f} ms loop")
    except (RuntimeError, TypeError, ValueError) as exc:
        print(f"  weight gradient: refused: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        equal = False
    return equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the forward product, all experts")
    parser.add_argument("--dim", type=int, default=2048, help="each expert is dim x dim")
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("grouped_probe: needs a CUDA GPU; nothing measured")
        return 0
    major, minor = torch.cuda.get_device_capability()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()} (sm{major}{minor})")
    if ROW is None or not hasattr(F, "scaled_grouped_mm"):
        print("grouped_probe: this torch has no torch.nn.functional.scaled_grouped_mm; nothing measured")
        return 0
    if (major, minor) != (9, 0):
        print("grouped_probe: torch runs row-wise scaled_grouped_mm on sm90 only; nothing measured")
        return 0
    equal = probe(args.tokens, args.dim, args.experts)
    print("grouped_probe: " + ("both products bitwise the per-group loop" if equal else "NOT bitwise the loop"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
