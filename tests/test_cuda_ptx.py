"""The ``cuda`` backend's Triton kernels compiled for real GPUs, checked in their PTX: no GPU needed.

Every kernel of :mod:`scalestate.backends.cuda.kernels` is compiled with
``triton.compile`` for sm_89 (Ada), sm_90 (Hopper) and sm_100 (Blackwell), in
the variants ``launch.py`` launches (both rounding paths, both FP8 formats,
input kinds, just-in-time modes, transposed copies, MX exponents, block sizes
a GPU gets), with the signature and specialization Triton's launcher builds
(pointers and multiples of 16 marked 16-byte divisible, integers equal to 1
turned into constants). The PTX and cubin then show what the interpreter
hides:

* no approximate division (``div.full.f32`` / ``div.approx.f32``): every
  division is ``tl.math.div_rn``;
* no ``.ftz`` on a float instruction (subnormals are kept, as torch keeps them);
* the hardware conversion ``cvt.rn.satfinite.<format>x2.f32`` in every
  ``HW=True`` cast and in none of the ``HW=False`` ones (integer rounding);
* no local memory: no ``.local`` in the PTX, and no stack or local bytes in
  the cubin's resource usage (no register spills).

Registers per kernel (from the cubin, by the ``cuobjdump`` that ships with
Triton), shared memory, spilled bytes and compile times are printed as a
table by :func:`test_register_table` (``pytest -s`` or ``-rP``) and recorded
as its ``registers`` property.

The compiles run once per module, in one subprocess per GPU side by side
(about 100 compiles; under a minute on two cores with a cold Triton cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import triton  # the test extra installs it: a missing Triton fails here, it is not skipped
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CAPABILITIES = (89, 90, 100)
#: Per FP8 format: the constexprs launch.py passes (largest finite value's float32 bits, mantissa bits,
#: exponent bias, the max, and the MX exponent and mantissa of the max); and the PTX conversion of each.
FORMATS: dict[str, dict[str, Any]] = {
    "e4m3": dict(FP8_MAX=448.0, MAX_BITS=0x43E00000, MBITS=3, BIAS=7, F_EXP=8, F_MANT_BITS=0x600000),
    "e5m2": dict(FP8_MAX=57344.0, MAX_BITS=0x47600000, MBITS=2, BIAS=15, F_EXP=15, F_MANT_BITS=0x600000),
}
CVT = {"e4m3": "cvt.rn.satfinite.e4m3x2.f32", "e5m2": "cvt.rn.satfinite.e5m2x2.f32"}
#: What launch.py views each input dtype as: float32 as int32 bits, bfloat16 as int16 bits, float16 as is.
IN_POINTER = {0: "*i32", 1: "*i16", 2: "*fp16"}
IN_NAME = {0: "fp32", 1: "bf16", 2: "fp16"}
#: An 8192 x 8192 input, as the benchmarks cast it.
SIZE = 8192


class Ptr(str):
    """A pointer argument of the given Triton type (``"*fp32"``), 16-byte aligned as torch allocates."""


def _signature(kernel: Any, args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], Any]]:
    """``(signature, constexprs, attrs)`` for ``ASTSource``, specialized as Triton's launcher does:
    constexpr parameters by value, pointers ``"*<type>"`` with 16-byte divisibility, integers ``"i32"``
    (16-divisible ones marked so), and an integer equal to 1 made a constant."""
    names = [p.name for p in kernel.params]
    assert set(names) == set(args), f"arguments {sorted(set(names) ^ set(args))} missing or unknown"
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int], Any] = {}
    divisible = [["tt.divisibility", 16]]
    for i, p in enumerate(kernel.params):
        value = args[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, Ptr):
            signature[p.name] = str(value)
            attrs[(i,)] = divisible
        elif isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{p.name}: give a Ptr or an int, not {value!r}")
        elif value == 1:
            signature[p.name] = "constexpr"
            constexprs[p.name] = 1
        else:
            signature[p.name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = divisible
    return signature, constexprs, attrs


class Variant(NamedTuple):
    kernel: str
    label: str
    args: dict[str, Any]
    #: The FP8 format a cast writes, and whether it uses the hardware conversion (None: not a cast).
    fmt: str | None = None
    hw: bool | None = None
    #: Warps per program, as the launch gives them (``launch.block_warps`` for block casts).
    num_warps: int = 4

    @property
    def id(self) -> str:
        return f"{self.kernel}[{self.label}]"


def _amax(in_kind: int) -> Variant:
    # launch.py for 8192 x 8192: BM=1, BN=4096 (4,096 elements a program); the record is an int32 view
    args = dict(x_ptr=Ptr(IN_POINTER[in_kind]), amax_ptr=Ptr("*i32"), record_ptr=Ptr("*i32"), M=SIZE, N=SIZE,
                stride_m=SIZE, stride_n=1, IN_KIND=in_kind, RECORD=True, BM=1, BN=4096)
    return Variant("amax_kernel", f"{IN_NAME[in_kind]},BM=1,BN=4096", args)


def _tensor_cast(fmt: str, hw: bool, jit: int, in_kind: int = 1, bm: int = 32, bn: int = 128,
                 transpose: bool = True) -> Variant:
    f = FORMATS[fmt]
    args = dict(
        x_ptr=Ptr(IN_POINTER[in_kind]), out_ptr=Ptr("*u8"), out_t_ptr=Ptr("*u8"), scale_ptr=Ptr("*fp32"),
        # modes 2 and 3 (the device flag's two launches) get the device bool; otherwise launch.py
        # passes the scale tensor in its place
        jit_ptr=Ptr("*u8" if jit in (2, 3) else "*fp32"),
        # modes 1, 2 and 3 use the int32 scratch amax; mode 0 gets the scale tensor in its place
        amax_ptr=Ptr("*i32" if jit else "*fp32"), record_ptr=Ptr("*i32"), scale_out_ptr=Ptr("*fp32"),
        scale_inv_out_ptr=Ptr("*fp32"), M=SIZE, N=SIZE, stride_m=SIZE, stride_n=1,
        IN_KIND=in_kind, JIT=jit, RECORD=jit in (0, 3), TRANSPOSE=transpose, FP8_MAX=f["FP8_MAX"],
        MAX_BITS=f["MAX_BITS"], MBITS=f["MBITS"], BIAS=f["BIAS"], MARGIN_DIV=1.0 if jit != 1 else 4.0,
        POW2=False, FLOOR=0.0 if jit != 1 else 1e-12, HW=hw, BM=bm, BN=bn,
    )
    label = f"{fmt},{'hw' if hw else 'int'},jit{jit},{IN_NAME[in_kind]},BM={bm},BN={bn}{',T' if transpose else ''}"
    return Variant("tensor_cast_kernel", label, args, fmt, hw)


def _lastdim(fmt: str, hw: bool, what: str, in_kind: int = 1, columns: bool = False, br: int | None = None,
             bk: int | None = None) -> Variant:
    """``what``: "mx" (1 x 32, E8M0), "tile" (1 x 128, powers of two) or "row" (one scale per row).
    ``columns``: the columnwise orientation, read through the transposed view (strides swapped)."""
    f = FORMATS[fmt]
    t = {"mx": 32, "tile": 128, "row": SIZE}[what]
    # launch.py: bk = max(t, min(k, 4096)), br = max(4096 // bk, 1)
    bk = bk if bk is not None else max(t, min(SIZE, 4096))
    br = br if br is not None else max(4096 // bk, 1)
    args = dict(
        x_ptr=Ptr(IN_POINTER[in_kind]), out_ptr=Ptr("*u8"), scale_ptr=Ptr("*fp32"),
        scale_inv_ptr=Ptr("*u8" if what == "mx" else "*fp32"), record_ptr=Ptr("*i32"),
        R=SIZE, K=SIZE, stride_r=1 if columns else SIZE, stride_k=SIZE if columns else 1, n_tiles=SIZE // t,
        IN_KIND=in_kind, RECORD=True, MX=what == "mx", POW2=what != "row", FP8_MAX=f["FP8_MAX"],
        MAX_BITS=f["MAX_BITS"], MBITS=f["MBITS"], BIAS=f["BIAS"], F_EXP=f["F_EXP"], F_MANT_BITS=f["F_MANT_BITS"],
        HW=hw, BR=br, BK=bk, T=t,
    )
    label = f"{fmt},{'hw' if hw else 'int'},{what},{IN_NAME[in_kind]},BR={br},BK={bk},T={t}{',cols' if columns else ''}"
    return Variant("lastdim_cast_kernel", label, args, fmt, hw)


def _block(fmt: str, hw: bool, in_kind: int = 1) -> Variant:
    f = FORMATS[fmt]
    blocks = SIZE // 128
    # launch.py for 128 x 128 blocks: RB = CB = 1 (a block holds more than 4,096 elements), 8 warps
    args = dict(
        x_ptr=Ptr(IN_POINTER[in_kind]), out_ptr=Ptr("*u8"), out_t_ptr=Ptr("*u8"), scale_ptr=Ptr("*fp32"),
        scale_inv_ptr=Ptr("*fp32"), record_ptr=Ptr("*i32"), M=SIZE, K=SIZE, stride_b=SIZE * SIZE, stride_m=SIZE,
        stride_k=1, mt=blocks, kt=blocks, IN_KIND=in_kind, RECORD=True, TRANSPOSE=True, POW2=True,
        FP8_MAX=f["FP8_MAX"], MAX_BITS=f["MAX_BITS"], MBITS=f["MBITS"], BIAS=f["BIAS"], HW=hw, B=128, RB=1, CB=1,
    )
    return Variant("block_cast_kernel", f"{fmt},{'hw' if hw else 'int'},{IN_NAME[in_kind]},B=128,RB=1,CB=1,T", args,
                   fmt, hw, num_warps=8)


def _update(full: bool, bn: int, bh: int) -> Variant:
    """``full``: non-finite counting and forgetting, margin, power of two and an amax floor; else none."""
    args = dict(
        history_ptr=Ptr("*fp32"), scales_ptr=Ptr("*fp32"), step_amax_ptr=Ptr("*fp32"), fp8_max_ptr=Ptr("*fp32"),
        counts_ptr=Ptr("*i64" if full else "*fp32"), N=10_000, H=bh,
        COUNT=full, FORGET=full, MOST_RECENT=not full, MARGIN_DIV=4.0 if full else 1.0, POW2=full,
        FLOOR=1e-12 if full else 0.0, BN=bn, BH=bh,
    )
    return Variant("update_kernel", f"{'all_options' if full else 'plain'},BN={bn},BH={bh}", args)


def _variants() -> list[Variant]:
    """Both rounding paths and both formats for every cast kernel; the other axes (input kinds, just in
    time modes, orientations, block sizes) at one format each, to keep the compile time short."""
    v: list[Variant] = [_amax(k) for k in (0, 1, 2)]
    for fmt in FORMATS:
        for hw in (True, False):
            v += [_tensor_cast(fmt, hw, 0), _lastdim(fmt, hw, "mx"), _block(fmt, hw)]
    for hw in (True, False):
        v += [_tensor_cast("e4m3", hw, 1), _tensor_cast("e4m3", hw, 2), _tensor_cast("e4m3", hw, 3)]
        v += [_lastdim("e4m3", hw, "tile"), _lastdim("e4m3", hw, "row")]
    v += [
        # what launch.py picks for 8192 columns (one row of 4,096 a program), from float32
        _tensor_cast("e4m3", True, 0, in_kind=0, bm=1, bn=4096),
        # current scaling from float16, without the transposed copy
        _tensor_cast("e4m3", True, 1, in_kind=2, transpose=False),
        # the columnwise orientations: the same kernel through the transposed view
        _lastdim("e4m3", True, "mx", in_kind=0, columns=True),
        _lastdim("e4m3", True, "tile", in_kind=2, columns=True),
        # smaller programs: 32 rows of 128
        _lastdim("e4m3", True, "mx", br=32, bk=128),
        _lastdim("e5m2", False, "tile", br=32, bk=128),
        # launch.py for 10,000 slots with a history of 16: BN=256, BH=16
        _update(True, 256, 16),
        _update(False, 256, 16),
        _update(True, 128, 16),
    ]
    ids = [x.id for x in v]
    assert len(set(ids)) == len(ids), "variant ids must be unique"
    return v


VARIANTS = _variants()
BY_ID = {v.id: v for v in VARIANTS}


class Compiled(NamedTuple):
    ptx: str
    #: From the cubin's resource usage: registers a thread, stack and local bytes a thread.
    registers: int
    stack: int
    local: int
    #: Shared memory Triton allocates for the kernel (layout conversions, reductions), bytes.
    shared: int
    #: Triton's count of spilled registers where the compiled kernel has one (set when loaded on a GPU).
    spills: int | None
    #: Compile time (PTX, cubin and resource usage).
    seconds: float


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _load_kernels(path: str) -> ModuleType:
    """The kernels' module from its file, on its own (it imports only Triton: no torch, no scalestate)."""
    spec = importlib.util.spec_from_file_location("scalestate_cuda_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(kernels: ModuleType, variant: Variant, cc: int, tmp: Path) -> dict[str, Any]:
    """The variant compiled for ``sm_<cc>`` with Triton's default options (as a launch compiles it):
    its PTX and the cubin's resource usage."""
    kernel = getattr(kernels, variant.kernel)
    signature, constexprs, attrs = _signature(kernel, variant.args)
    with warnings.catch_warnings():
        # Triton 3.9 warns once that FP fusion is on by default; the kernels are compiled as launched
        warnings.simplefilter("ignore", UserWarning)
        out = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                             target=GPUTarget("cuda", cc, 32), options={"num_warps": variant.num_warps})
    cubin = tmp / f"sm{cc}.cubin"
    cubin.write_bytes(out.asm["cubin"])
    usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    match = _USAGE.search(usage)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    regs, stack, _, local = (int(g) for g in match.groups())
    return dict(ptx=out.asm["ptx"], registers=regs, stack=stack, local=local, shared=out.metadata.shared,
                spills=getattr(out, "n_spills", None))


def _worker(kernels_path: str, cc: int, out_dir: str) -> None:
    """Compile every variant for ``sm_<cc>`` into ``out_dir`` (``sm<cc>.json``): run in a subprocess."""
    kernels = _load_kernels(kernels_path)
    results: dict[str, Any] = {}
    tmp = Path(out_dir)
    for variant in VARIANTS:
        start = time.perf_counter()
        try:
            results[variant.id] = _compile(kernels, variant, cc, tmp)
        except Exception as e:  # reported by the variant's own test
            results[variant.id] = {"error": f"{type(e).__name__}: {e}"}
        results[variant.id]["seconds"] = time.perf_counter() - start
    (tmp / f"sm{cc}.json").write_text(json.dumps(results))


class Results(dict):  # type: ignore[type-arg]
    """``(variant id, capability) -> Compiled | error``, shown short in tracebacks."""

    def __repr__(self) -> str:
        return f"<{len(self)} compiled kernel variants>"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, int], Compiled | str]:
    """Every variant for every capability: ``Compiled``, or the compiler's error as a string.

    The compiler runs in subprocesses (one per capability, side by side) without ``TRITON_INTERPRET``:
    the suite sets it on machines without a GPU, and under it Triton's own library functions
    (``tl.max``'s combine, ...) are interpreted functions that ``triton.compile`` cannot take.
    """
    spec = importlib.util.find_spec("scalestate.backends.cuda.kernels")
    assert spec is not None and spec.origin is not None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = []
    for cc in CAPABILITIES:
        out = tmp_path_factory.mktemp(f"ptx_sm{cc}")
        cmd = [sys.executable, __file__, spec.origin, str(cc), str(out)]
        jobs.append((cc, out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True)))
    results: dict[tuple[str, int], Compiled | str] = {}
    for cc, out, job in jobs:
        log, _ = job.communicate(timeout=600)
        assert job.returncode == 0, f"the compiler's subprocess for sm_{cc} failed:\n{log}"
        for variant_id, r in json.loads((out / f"sm{cc}.json").read_text()).items():
            results[variant_id, cc] = r["error"] if "error" in r else Compiled(**r)
    return Results(results)


def _get(compiled: dict[tuple[str, int], Compiled | str], variant_id: str, cc: int) -> Compiled:
    c = compiled[variant_id, cc]
    if isinstance(c, str):
        pytest.fail(f"{variant_id} does not compile for sm_{cc}: {c}")
    return c


def _lines(ptx: str, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [f"    {n}: {line.strip()}" for n, line in enumerate(ptx.splitlines(), 1) if rx.search(line)]


_FTZ = r"\.ftz\b"
_APPROX_DIV = r"\bdiv\.(full|approx)\.f32\b"
_LOCAL = r"\.local\b"


@pytest.mark.parametrize("cc", CAPABILITIES, ids=lambda cc: f"sm{cc}")
@pytest.mark.parametrize("variant_id", list(BY_ID))
def test_ptx(compiled, variant_id, cc):
    """One kernel variant for one GPU: exact divisions only, no flush to zero, the hardware conversion
    exactly where asked, and nothing in local memory (PTX and cubin)."""
    variant = BY_ID[variant_id]
    c = _get(compiled, variant_id, cc)
    where = f"{variant_id} for sm_{cc}"
    problems: list[str] = []
    if found := _lines(c.ptx, _APPROX_DIV):
        problems.append("an approximate float division (use tl.math.div_rn):\n" + "\n".join(found[:5]))
    if found := _lines(c.ptx, _FTZ):
        problems.append(".ftz flushes subnormals:\n" + "\n".join(found[:5]))
    if found := _lines(c.ptx, _LOCAL):
        problems.append("local memory in the PTX:\n" + "\n".join(found[:5]))
    if c.stack or c.local:
        problems.append(f"{c.stack} stack and {c.local} local bytes in the cubin (register spills)")
    if c.spills:
        problems.append(f"{c.spills} registers spilled (Triton's n_spills)")
    if variant.hw is not None:
        cvt = _lines(c.ptx, r"\bcvt\.rn\.satfinite\b")
        if variant.hw and not _lines(c.ptx, re.escape(CVT[variant.fmt])):
            problems.append(f"HW=True but no {CVT[variant.fmt]}; conversions seen:\n" + "\n".join(cvt[:5]))
        if not variant.hw and cvt:
            problems.append("HW=False (integer rounding) but a hardware conversion:\n" + "\n".join(cvt[:5]))
    assert not problems, f"{where}:\n" + "\n".join(f"  - {p}" for p in problems)


def test_register_table(compiled, record_property):
    """Registers a thread per kernel variant and GPU (from the cubins, 4 warps), Triton's shared memory,
    spilled bytes and compile time: printed as a table (``pytest -s`` or ``-rP``) and recorded as the
    ``registers`` property. Every variant compiled for every GPU."""
    width = max(len(v) for v in BY_ID)
    head = (f"{'kernel variant':<{width}}" + "".join(f" {f'sm{cc} regs':>10}" for cc in CAPABILITIES)
            + f" {'shared B':>9} {'spill B':>8} {'compile s':>10}")
    rows = [head, "-" * len(head)]
    seconds = dict.fromkeys(CAPABILITIES, 0.0)
    for variant_id in BY_ID:
        cs = {cc: _get(compiled, variant_id, cc) for cc in CAPABILITIES}
        for cc, c in cs.items():
            seconds[cc] += c.seconds
        rows.append(
            f"{variant_id:<{width}}" + "".join(f" {cs[cc].registers:>10}" for cc in CAPABILITIES)
            + f" {max(c.shared for c in cs.values()):>9} {max(c.stack + c.local for c in cs.values()):>8}"
            + f" {sum(c.seconds for c in cs.values()):>10.2f}"
        )
    rows.append("compile time per GPU: " + ", ".join(f"sm_{cc} {t:.1f} s" for cc, t in seconds.items()))
    table = "\n".join(rows)
    print(f"\n{len(BY_ID)} kernel variants compiled for {len(CAPABILITIES)} GPUs\n{table}")
    record_property("registers", table)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
