"""The cuda backend's speed on one GPU, measured side by side in one run, as one table of ratios.

Each row is a ratio measured in this run against a baseline measured in the
same run on the same device, with its goal and PASS or FAIL (INFO where no
goal is set):

1. **casts**: bandwidth of each recipe's cast of an 8192 x 8192 bfloat16
   tensor (bytes read and written, as the kernels move them, over the time)
   against the device's copy bandwidth (``torch.empty_like(x).copy_(x)`` of
   the same tensor), with and without the transposed copy; goal >= 0.85. The
   casts and the copy are timed as CUDA graphs of 20 back-to-back calls, so
   the kernels are measured, not Python's launch overhead;
2. **step()** at 10,000 slots against 10 slots (host and device time per
   step); goal <= 1.5;
3. **Linear**: ``ss.nn.Linear`` forward + backward (and ``manager.step()``)
   of a 16384 x 8192 bfloat16 input through an 8192 x 8192 weight, against
   bfloat16 ``torch.nn.Linear`` and against torchao's float8 Linear
   (tensorwise, compiled), eager and compiled, per recipe; goals: delayed
   scaling >= 1.5x bfloat16, current >= 1.4x, both faster than torchao;
4. **GEMM**: FP8 TFLOP/s of ``backend.scaled_mm`` (16384 x 8192 @ 8192 x 8192)
   as a fraction of the device's dense FP8 peak (from a table by device
   name; "unknown" otherwise);
5. **GPT**: a training step of a small GPT-2 (``transformers``' ``GPT2Config``,
   converted with ``ss.nn.convert``, the LM head kept in bfloat16) with a CUDA
   graph against without.

Timings use CUDA events after warm-up, with ``torch.cuda.synchronize()``; a
measurement that fails prints an ERROR row and the others go on; a global
time budget (``--budget``) skips what no longer fits, most expensive last.

    python benchmarks/gpu_bench.py                 # everything, 330 s budget
    python benchmarks/gpu_bench.py --only casts,step --budget 60
    python benchmarks/gpu_bench.py --demo-table    # the table's format, no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear import RECIPES  # benchmarks/linear.py: the recipes by name

import scalestate as ss

SECTIONS = ("casts", "step", "linear", "compiled", "gemm", "gpt")
#: Dense (not sparse) FP8 tensor-core peaks in TFLOP/s, by a substring of torch's device name; the
#: first match wins, so the more specific names come first.
DENSE_FP8_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 1979.0),
    ("H100 PCIe", 1513.0),
    ("H100 NVL", 1671.0),
    ("H100", 1979.0),
    ("H800", 1979.0),
    ("B200", 4500.0),
    ("L40S", 733.0),
    ("L4", 242.0),
)


# ------------------------------------------------------------------ the table (pure Python)
@dataclass(frozen=True)
class Goal:
    """``measured <op> value``: ``op`` is ``">="`` or ``"<="``."""

    op: str
    value: float

    def met(self, measured: float) -> bool:
        return measured >= self.value if self.op == ">=" else measured <= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass
class Row:
    name: str
    measured: float | None = None
    goal: Goal | None = None
    #: What the row could not measure (an error, or why it was skipped).
    error: str | None = None
    skipped: bool = False
    #: How ``measured`` is shown: a format for a float, e.g. ``"{:.3f}"`` or ``"{:.2f}x"``.
    fmt: str = "{:.3f}"
    #: Shown after the status (times, bandwidths).
    detail: str = ""

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIP"
        if self.error is not None or self.measured is None:
            return "ERROR"
        if self.goal is None:
            return "INFO"
        return "PASS" if self.goal.met(self.measured) else "FAIL"

    def shown(self) -> str:
        if self.error is not None:
            return self.error
        if self.measured is None:
            return "-"
        if isinstance(self.measured, float) and not math.isfinite(self.measured):
            return str(self.measured)
        return self.fmt.format(self.measured)


def format_table(rows: list[Row], title: str = "summary") -> str:
    """The rows as one fixed-width table (errors cut to fit), with counts of each status at the end."""
    name_w = max([len("measurement"), *(len(r.name) for r in rows)])
    value_w = max([len("measured"), *(min(len(r.shown()), 48) for r in rows)])
    goal_w = max([len("goal"), *(len(str(r.goal)) if r.goal else 1 for r in rows)])
    head = f"{'measurement':<{name_w}}  {'measured':>{value_w}}  {'goal':<{goal_w}}  status  detail"
    lines = [f"== {title} ==", head, "-" * len(head)]
    for r in rows:
        shown = r.shown()
        if len(shown) > 48:
            shown = shown[:45] + "..."
        goal = str(r.goal) if r.goal else "-"
        lines.append(f"{r.name:<{name_w}}  {shown:>{value_w}}  {goal:<{goal_w}}  {r.status:<6}  {r.detail}".rstrip())
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "INFO", "ERROR", "SKIP")}
    lines.append("-" * len(head))
    lines.append("  ".join(f"{k} {v}" for k, v in counts.items() if v) or "no rows")
    return "\n".join(lines)


def demo_rows() -> list[Row]:
    """Rows of every kind, for ``--demo-table`` (and for checking the format without a GPU)."""
    return [
        Row("cast delayed per-tensor / copy", 0.91, Goal(">=", 0.85), detail="4321 GB/s, copy 4750 GB/s"),
        Row("cast MX +T / copy", 0.62, Goal(">=", 0.85), detail="2950 GB/s"),
        Row("step() 10000 slots / 10 slots", 1.1, Goal("<=", 1.5), fmt="{:.2f}", detail="0.105 ms vs 0.095 ms"),
        Row("GEMM tensorwise / dense FP8 peak", None, None, error="unknown peak for 'Some GPU'"),
        Row("Linear delayed compiled / bf16", 1.62, Goal(">=", 1.5), fmt="{:.2f}x"),
        Row("GPT step graph / eager", 1.3, None, fmt="{:.2f}x"),
        Row("Linear block compiled / bf16", error="RuntimeError: " + "x" * 80),
        Row("GPT step", skipped=True, error="time budget spent"),
    ]


# ------------------------------------------------------------------ measuring
class Budget:
    """The global time budget, with progress lines."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)


@dataclass
class Results:
    budget: Budget
    rows: list[Row] = field(default_factory=list)
    #: Times and other values later rows are computed from, by key.
    values: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def measuring(self, key: str, need_s: float = 0.0) -> Iterator[bool]:
        """``with results.measuring(key, need) as go: if go: ...``: skipped when less than ``need_s`` is
        left; an exception becomes ``errors[key]`` (and a traceback on stderr), and the run goes on."""
        if self.budget.left() < need_s:
            self.errors[key] = f"skipped: {self.budget.left():.0f} s left of the budget, needs ~{need_s:.0f} s"
            self.budget.log(f"{key}: {self.errors[key]}")
            yield False
            return
        self.budget.log(f"{key} ...")
        try:
            yield True
        except Exception as e:
            self.errors[key] = f"{type(e).__name__}: {e}".splitlines()[0]
            self.budget.log(f"{key}: ERROR {self.errors[key]}")
            traceback.print_exc(file=sys.stderr)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    def ratio_row(self, name: str, num: str, den: str, goal: Goal | None, fmt: str = "{:.3f}",
                  detail: Callable[[float, float], str] | None = None) -> None:
        """A row ``values[num] / values[den]``, or an ERROR/SKIP row naming what is missing."""
        missing = [k for k in (num, den) if k not in self.values]
        if missing:
            why = "; ".join(f"{k}: {self.errors.get(k, 'not measured')}" for k in missing)
            skipped = all(self.errors.get(k, "").startswith("skipped") for k in missing)
            self.rows.append(Row(name, goal=goal, error=why, skipped=skipped))
            return
        a, b = self.values[num], self.values[den]
        self.rows.append(Row(name, a / b, goal, fmt=fmt, detail=detail(a, b) if detail else ""))


def _events_ms(fn: Callable[[], Any], iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` calls, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def eager_ms(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, repeats: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _events_ms(fn, iters, repeats)


def warm_on_side_stream(fn: Callable[[], Any], times: int = 3) -> None:
    """Run ``fn`` a few times on a side stream, as CUDA graph capture wants before it captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def graph_ms(fn: Callable[[], Any], *, calls: int = 20, repeats: int = 5) -> float:
    """Milliseconds per call of ``fn``, from a CUDA graph of ``calls`` back-to-back calls (warmed up on a
    side stream first), so that the GPU is measured without the host's launch overhead."""
    warm_on_side_stream(fn)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = _events_ms(graph.replay, 1, repeats) / calls
    del graph
    return ms


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------ 1. casts
def bench_casts(res: Results, size: int) -> None:
    from scalestate.backends import CastRequest, CastSpec, get_backend
    from scalestate.math import ScaleRule

    cuda = get_backend("cuda")
    dev = torch.device("cuda")
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    with res.measuring("copy", 5) as go:
        if go:
            ms = graph_ms(lambda: torch.empty_like(x).copy_(x))
            res.values["copy"] = 2 * x.nbytes / ms / 1e6  # GB/s
            res.budget.log(f"copy: {res.values['copy']:.0f} GB/s")
    e4m3 = torch.float8_e4m3fn
    scale = torch.tensor(1.0, device=dev)
    record = torch.zeros((), device=dev)
    flag = torch.tensor(False, device=dev)  # what a manager passes for delayed scaling on a GPU
    cases: list[tuple[str, Any, bool | torch.Tensor, int, int]] = [
        # name, granularity, jit, reads of x without and with the transposed copy: a just-in-time
        # per-tensor scale needs the amax first (an amax pass, then the cast); fine-grained
        # orientations each read x (the columnwise one through x.t()), except 128 x 128 blocks,
        # which write both orientations from one read
        ("delayed per-tensor (given scale)", None, False, 1, 1),
        ("delayed per-tensor (device flag)", None, flag, 2, 2),
        ("current per-tensor", None, True, 2, 2),
        ("rowwise", ss.RowwiseScaling().granularity(ss.Role.INPUT), True, 1, 2),
        ("1x128 tiles", ss.BlockScaling().granularity(ss.Role.INPUT), True, 1, 2),
        ("128x128 blocks", ss.BlockScaling().granularity(ss.Role.WEIGHT), True, 1, 1),
        ("MX 1x32", ss.MXFP8Scaling().granularity(ss.Role.INPUT), True, 1, 2),
    ]
    reads_of: dict[str, int] = {}
    for name, granularity, jit, reads, reads_t in cases:
        spec = CastSpec(e4m3, 448.0, ScaleRule(), granularity)
        for transpose in (False, True):
            key = f"cast {name}{' +T' if transpose else ''}"
            reads_of[key] = reads_t if transpose else reads
            with res.measuring(key, 5) as go:
                if go:
                    request = CastRequest(x, spec, scale, jit, record, transpose)
                    out_bytes = _nbytes(cuda.cast(request).flatten()[0]) + record.nbytes
                    ms = graph_ms(lambda request=request: cuda.cast(request))
                    res.values[key] = (reads_of[key] * x.nbytes + out_bytes) / ms / 1e6
    copy = res.values.get("copy")
    for key, reads in reads_of.items():
        res.ratio_row(f"{key} / copy", key, "copy", Goal(">=", 0.85),
                      detail=lambda a, b, reads=reads: f"{a:.0f} GB/s ({reads} read(s) of x) vs copy {b:.0f} GB/s")
    if copy is not None:
        res.rows.append(Row("copy bandwidth (GB/s)", copy, None, fmt="{:.0f}",
                            detail=f"{size} x {size} bf16, torch.empty_like(x).copy_(x)"))


# ------------------------------------------------------------------ 2. step()
def bench_step(res: Results) -> None:
    for n in (10, 10_000):
        key = f"step {n}"
        with res.measuring(key, 10) as go:
            if go:
                m = ss.ScalingStateManager(ss.DelayedScaling(), backend="cuda", device="cuda")
                m.reserve(n)
                for i in range(n):
                    m.register(f"layer{i}", roles=(ss.Role.INPUT,))
                for _ in range(5):
                    m.step()
                torch.cuda.synchronize()
                iters = 200
                start = time.perf_counter()
                for _ in range(iters):
                    m.step()
                torch.cuda.synchronize()
                res.values[key] = (time.perf_counter() - start) / iters * 1e3
    res.ratio_row("step() 10000 slots / 10 slots", "step 10000", "step 10", Goal("<=", 1.5), fmt="{:.2f}",
                  detail=lambda a, b: f"{a:.3f} ms vs {b:.3f} ms per step")


# ------------------------------------------------------------------ 3. Linear
#: In the order they are measured: the recipes with goals first.
LINEAR_RECIPES = ("delayed", "current", "rowwise", "block")
#: Speed-up goals over bfloat16 (and being faster than torchao) per recipe; None: shown only.
LINEAR_GOALS: dict[str, float | None] = {"delayed": 1.5, "current": 1.4, "rowwise": None, "block": None}


def _linear_step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor,
                 manager: ss.ScalingStateManager | None) -> Callable[[], None]:
    def step() -> None:
        if manager is None:
            layer(x).backward(g)
        else:
            with manager.forward():
                y = layer(x)
            with manager.backward():
                y.backward(g)
            manager.step()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return step


def bench_linear(res: Results, tokens: int, size: int, compiled: bool) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(tokens, size, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, size, device=dev, dtype=dtype)
    mode = "compiled" if compiled else "eager"
    need = 60 if compiled else 5
    torch.manual_seed(0)
    base = torch.nn.Linear(size, size, device=dev, dtype=dtype)

    def maybe_compile(layer: torch.nn.Module) -> torch.nn.Module:
        if not compiled:
            return layer
        torch.compiler.reset()  # each layer compiled from a clean compiler (one recipe's ops per compile)
        return torch.compile(layer)  # type: ignore[return-value]

    with res.measuring(f"linear bf16 {mode}", need) as go:
        if go:
            res.values[f"linear bf16 {mode}"] = eager_ms(_linear_step(maybe_compile(base), x, g, None))
    if compiled:
        with res.measuring("linear torchao compiled", need) as go:
            if go:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                ref = torch.nn.Sequential(torch.nn.Linear(size, size, device=dev, dtype=dtype))
                ref[0].load_state_dict(base.state_dict())
                ao = convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"))
                res.values["linear torchao compiled"] = eager_ms(_linear_step(maybe_compile(ao), x, g, None))
    for recipe in LINEAR_RECIPES:
        key = f"linear {recipe} {mode}"
        with res.measuring(key, need) as go:
            if go:
                manager = ss.ScalingStateManager(RECIPES[recipe](), backend="cuda", device="cuda")
                layer = ss.nn.Linear(size, size, manager=manager, device=dev, dtype=dtype)
                layer.load_state_dict(base.state_dict())
                res.values[key] = eager_ms(_linear_step(maybe_compile(layer), x, g, manager))


def linear_rows(res: Results, tokens: int, size: int, modes: list[str]) -> None:
    """Speed-ups (baseline time / ss.nn.Linear time): over bfloat16 in the same mode, and over torchao
    compiled (when the compiled section ran, which measures torchao)."""
    shape = f"{tokens}x{size} @ {size}x{size}"
    for mode in modes:
        for recipe in LINEAR_RECIPES:
            goal = LINEAR_GOALS[recipe]
            key = f"linear {recipe} {mode}"
            res.ratio_row(f"Linear {recipe} {mode}: speed-up over bf16 {mode}", f"linear bf16 {mode}", key,
                          Goal(">=", goal) if goal else None, fmt="{:.2f}x",
                          detail=lambda a, b: f"{b:.2f} ms vs {a:.2f} ms, fwd+bwd+step {shape}")
            if "compiled" in modes:
                res.ratio_row(f"Linear {recipe} {mode}: speed-up over torchao compiled", "linear torchao compiled",
                              key, Goal(">=", 1.0) if goal else None, fmt="{:.2f}x",
                              detail=lambda a, b: f"{b:.2f} ms vs {a:.2f} ms")


# ------------------------------------------------------------------ 4. GEMM
def dense_fp8_peak(name: str) -> float | None:
    """The dense FP8 peak of a device by its name (TFLOP/s), or None when the table lacks it."""
    for key, tflops in DENSE_FP8_TFLOPS:
        if key in name:
            return tflops
    return None


def bench_gemm(res: Results, tokens: int, size: int) -> None:
    from scalestate.backends import CastRequest, CastSpec, get_backend
    from scalestate.math import ScaleRule

    cuda = get_backend("cuda")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    peak = dense_fp8_peak(name)
    x = torch.randn(tokens, size, device=dev, dtype=torch.bfloat16)
    w = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * tokens * size * size
    e4m3 = torch.float8_e4m3fn
    cases = [
        ("tensorwise", None, None),
        ("rowwise", ss.RowwiseScaling().granularity(ss.Role.INPUT), ss.RowwiseScaling().granularity(ss.Role.WEIGHT)),
        ("1x128 x 128x128 blocks", ss.BlockScaling().granularity(ss.Role.INPUT),
         ss.BlockScaling().granularity(ss.Role.WEIGHT)),
        ("MX", ss.MXFP8Scaling().granularity(ss.Role.INPUT), ss.MXFP8Scaling().granularity(ss.Role.WEIGHT)),
    ]
    for label, gx, gw in cases:
        row = f"GEMM {label} / dense FP8 peak"
        before = len(res.rows)
        with res.measuring(row, 5) as go:
            if go:
                scale = torch.tensor(1.0, device=dev)
                qx = cuda.cast(CastRequest(x, CastSpec(e4m3, 448.0, ScaleRule(), gx), scale, True))
                qw = cuda.cast(CastRequest(w, CastSpec(e4m3, 448.0, ScaleRule(), gw), scale, True))
                b = qw.t() if gw is None else qw.rowwise().t()  # as ss.nn.Linear's forward multiplies
                ms = eager_ms(lambda qx=qx, b=b: cuda.scaled_mm(qx, b, out_dtype=torch.bfloat16), iters=20)
                tflops = flops / ms / 1e9
                detail = f"{tflops:.0f} TFLOP/s, {tokens}x{size} @ {size}x{size}"
                if peak is None:
                    res.rows.append(Row(row, None, None, error=f"unknown peak for {name!r}", detail=detail))
                else:
                    res.rows.append(Row(row, tflops / peak, None, detail=f"{detail}, peak {peak:.0f}"))
        if len(res.rows) == before:
            error = res.errors.get(row, "not measured")
            res.rows.append(Row(row, error=error, skipped=error.startswith("skipped")))


# ------------------------------------------------------------------ 5. GPT
def bench_gpt(res: Results, layers: int, width: int, batch: int, seq: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = torch.device("cuda")
    vocab = 32768
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=seq, vocab_size=vocab,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq + 1), device=dev)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def build() -> tuple[torch.nn.Module, ss.ScalingStateManager, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).to(dev, torch.bfloat16)
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="cuda", device="cuda")
        model = ss.nn.convert(model, manager, filter_fn=lambda path, module: "lm_head" not in path)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        return model, manager, opt

    def step_of(model: torch.nn.Module, manager: ss.ScalingStateManager,
                opt: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            with manager.forward():
                logits = model(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
            with manager.backward():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            manager.step()
            return loss

        return step

    tokens = batch * seq
    with res.measuring("gpt eager", 20) as go:
        if go:
            step = step_of(*build())
            res.values["gpt eager"] = eager_ms(step, warmup=3, iters=5, repeats=3)
    with res.measuring("gpt graph", 30) as go:
        if go:
            model, manager, opt = build()
            step = step_of(model, manager, opt)
            warm_on_side_stream(step)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            res.values["gpt graph"] = eager_ms(graph.replay, warmup=2, iters=5, repeats=3)
    res.ratio_row(f"GPT-2 {layers}x{width} step, CUDA graph speed-up", "gpt eager", "gpt graph", None,
                  fmt="{:.2f}x",
                  detail=lambda a, b: f"eager {a:.1f} ms, graph {b:.1f} ms; {tokens / b * 1e3:,.0f} tokens/s")


# ------------------------------------------------------------------ the run
def versions() -> str:
    import triton

    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}, scalestate {ss.__version__}",
    ]
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        _, total = torch.cuda.mem_get_info()
        lines.append(f"device: {torch.cuda.get_device_name()} (sm_{cc[0]}{cc[1]}, {total / 2**30:.0f} GiB, "
                     f"{torch.cuda.device_count()} visible)")
    else:
        lines.append("device: no CUDA GPU visible to torch")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all measurements (default 330)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections, from: {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--size", type=int, default=8192, help="features (and the cast's square size)")
    parser.add_argument("--tokens", type=int, default=16384, help="rows of the Linear's and GEMM's input")
    parser.add_argument("--gpt", default="4,1024,8,1024",
                        help="GPT-2 layers,width,batch,sequence (default 4,1024,8,1024)")
    parser.add_argument("--versions", action="store_true", help="print the versions and the device, and exit")
    parser.add_argument("--demo-table", action="store_true", help="print an example table (no GPU needed) and exit")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.demo_table:
        print(format_table(demo_rows(), "example"))
        return 0
    print(versions(), flush=True)
    if args.versions:
        return 0
    if not torch.cuda.is_available():
        print("gpu_bench: needs a CUDA GPU; none is visible to torch", file=sys.stderr)
        return 2
    ok, why = ss.backends.get_backend("cuda").available(torch.device("cuda"))
    if not ok:
        print(f"gpu_bench: the cuda backend is not available: {why}", file=sys.stderr)
        return 2
    res = Results(Budget(args.budget))
    layers, width, batch, seq = (int(v) for v in args.gpt.split(","))
    # the goals' measurements first, the most expensive (compiles) after them, the INFO rows last
    runs: list[tuple[str, Callable[[], None]]] = [
        ("casts", lambda: bench_casts(res, args.size)),
        ("step", lambda: bench_step(res)),
        ("linear", lambda: bench_linear(res, args.tokens, args.size, compiled=False)),
        ("compiled", lambda: bench_linear(res, args.tokens, args.size, compiled=True)),
        ("gemm", lambda: bench_gemm(res, args.tokens, args.size)),
        ("gpt", lambda: bench_gpt(res, layers, width, batch, seq)),
    ]
    interrupted = False
    try:
        for section, run in runs:
            if section in sections:
                run()
    except KeyboardInterrupt:  # a timeout's SIGINT: print what was measured
        interrupted = True
        res.budget.log("interrupted: the table holds what was measured so far")
    modes = [mode for mode, section in (("eager", "linear"), ("compiled", "compiled")) if section in sections]
    if modes:
        linear_rows(res, args.tokens, args.size, modes)
    res.budget.log("done")
    order = ("cast", "copy", "step()", "Linear", "GEMM", "GPT-2")
    rows = sorted(res.rows, key=lambda r: next((i for i, p in enumerate(order) if r.name.startswith(p)), len(order)))
    print()
    print(format_table(rows, f"cuda backend on {torch.cuda.get_device_name()}"), flush=True)
    return 1 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
