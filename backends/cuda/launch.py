"""Python side of the ``cuda`` backend's kernels: shapes, block sizes, outputs, launches.

Each function here is one cast or the step update, as a fixed number of
launches whatever the tensor or slot count (listed per function). Inputs of
any float dtype are read as float32 (bfloat16, float16 and float32 directly;
others converted first, as the emulation backend does). A 2-d input is read
through its strides, contiguous or not; an input of more dimensions that is
not contiguous is made contiguous first (one copy).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from torch import Tensor

from scalestate.backends.base import CastRequest
from scalestate.backends.cuda import kernels as K
from scalestate.granularity import GranularityKind
from scalestate.math import ScaleRule
from scalestate.quantized import Orientation, Quantized

__all__ = ["INTERPRETED", "cast", "update"]

#: Whether the kernels were imported under Triton's interpreter (``TRITON_INTERPRET=1``): they then
#: run on CPU tensors, for testing. Decided when this module is first imported, as Triton decides.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"
#: Elements one program instance holds: under the interpreter each instance costs milliseconds, so few
#: large ones; on a GPU, tiles sized for registers.
_PROGRAM_ELEMENTS = 1 << 18 if INTERPRETED else 1 << 12
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Per FP8 dtype: (largest finite value's float32 bits, mantissa bits, exponent bias).
_FORMAT = {
    torch.float8_e4m3fn: (0x43E00000, 3, 7),
    torch.float8_e5m2: (0x47600000, 2, 15),
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: For MX exponents, ``fp8_max = (1 + mant / 2**23) * 2**exp``: (exp, mant bits).
_MX_MAX = {torch.float8_e4m3fn: (8, 0x600000), torch.float8_e5m2: (15, 0x600000)}


def _p2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _hardware() -> bool:
    return not INTERPRETED


def _as_readable(x: Tensor) -> tuple[Tensor, int]:
    """``x`` as the view the kernel loads (int32 bits for float32, int16 for bfloat16) and its kind."""
    if x.dtype not in _IN_KIND:
        x = x.float()
    kind = _IN_KIND[x.dtype]
    if kind == 0:
        return x.view(torch.int32), kind
    if kind == 1:
        return x.view(torch.int16), kind
    return x, kind


def _rows(x: Tensor) -> Tensor:
    """``x`` as 2-d rows of its last dimension (a copy only for a non-contiguous input of 3+ dims)."""
    if x.dim() == 2:
        return x
    if x.dim() < 2:
        return x.reshape(1, -1)
    return x.contiguous().view(-1, x.shape[-1])


def _blocks(m: int, n: int) -> tuple[int, int]:
    bn = min(_p2(n), _PROGRAM_ELEMENTS)
    bm = min(_p2(m), max(_PROGRAM_ELEMENTS // bn, 1))
    return bm, bn


def cast(request: CastRequest) -> Quantized:
    """One cast, as :class:`~scalestate.backends.CastRequest` says (per tensor or fine-grained)."""
    with _quiet():
        if request.spec.granularity is not None:
            return _cast_fine(request)
        return _cast_tensor(request)


def _quiet() -> contextlib.AbstractContextManager[object]:
    """Under the interpreter, numpy's warnings about the infinities the kernels clamp on purpose
    (``448 / 1e-44``) are silenced; on a GPU nothing is."""
    if not INTERPRETED:
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(over="ignore", divide="ignore", invalid="ignore")


def _cast_tensor(request: CastRequest) -> Quantized:
    """Per-tensor: one launch with a given scale (the amax recorded in the same pass); just in time,
    a zeroed scratch amax, one amax launch and one cast launch (two reads of ``x``)."""
    x, spec = request.x, request.spec
    rule = spec.rule
    x2 = _rows(x)
    m, n = x2.shape
    src, kind = _as_readable(x2)
    dev = x.device
    data = torch.empty(x.shape, dtype=spec.dtype, device=dev)
    data_t = torch.empty((n, m), dtype=spec.dtype, device=dev) if request.transpose else data
    scale = torch.empty((), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    record = request.record.view(torch.int32) if request.record is not None else scale_inv
    jit = request.jit
    mode = 0 if jit is False else 1 if jit is True else 2
    jit_flag = jit.view(torch.uint8) if isinstance(jit, Tensor) else scale
    bm, bn = _blocks(m, n)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    amax = scale
    if mode:
        amax = torch.zeros((), dtype=torch.int32, device=dev)
        K.amax_kernel[grid](src, amax, record, m, n, src.stride(0), src.stride(1),
                            IN_KIND=kind, RECORD=request.record is not None, BM=bm, BN=bn)
    max_bits, mbits, bias = _FORMAT[spec.dtype]
    K.tensor_cast_kernel[grid](
        src, data.view(torch.uint8), data_t.view(torch.uint8), request.scale, jit_flag, amax, record, scale,
        scale_inv, m, n, src.stride(0), src.stride(1),
        IN_KIND=kind, JIT=mode, RECORD=request.record is not None and mode == 0, TRANSPOSE=request.transpose,
        FP8_MAX=spec.fp8_max, MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, MARGIN_DIV=float(2.0**rule.margin),
        POW2=rule.power_of_2, FLOOR=_floor(rule), HW=_hardware(), BM=bm, BN=bn,
    )
    rows = Orientation(data, scale, scale_inv)
    other = Orientation(data_t, scale, scale_inv) if request.transpose else None
    return Quantized.of(rows, other)


def _floor(rule: ScaleRule) -> float:
    """The amax floor as the float32 nearest to it (what ``clamp(min=floor)`` on float32 uses)."""
    return float(torch.tensor(rule.amax_floor, dtype=torch.float32)) if rule.amax_floor else 0.0


def _cast_fine(request: CastRequest) -> Quantized:
    spec = request.spec
    assert spec.granularity is not None
    kind, block, power_of_2 = spec.granularity
    if kind == GranularityKind.BLOCK:
        return _cast_blocks(request, block, power_of_2)
    x = request.x
    tile = max(x.shape[-1], 1) if kind == GranularityKind.ROW else block
    rows = _cast_lastdim(x, request, kind, tile, power_of_2)
    if not request.transpose:
        return Quantized.of(rows, None)
    col_tile = max(x.shape[0], 1) if kind == GranularityKind.ROW else block
    return Quantized.of(rows, _cast_lastdim(x.t(), request, kind, col_tile, power_of_2, record=False))


def _cast_lastdim(
    x: Tensor, request: CastRequest, kind: GranularityKind, tile: int, power_of_2: bool, *, record: bool = True
) -> Orientation:
    """Rows, tiles or MX blocks along the last dimension: one launch (one read of ``x``)."""
    spec = request.spec
    x2 = _rows(x)
    r, k = x2.shape
    src, in_kind = _as_readable(x2)
    t = _p2(tile)
    n_tiles = -(-k // tile)
    bk = max(t, min(_p2(k), _PROGRAM_ELEMENTS))
    br = min(_p2(r), max(_PROGRAM_ELEMENTS // bk, 1))
    dev = x.device
    mx = kind == GranularityKind.MX
    data = torch.empty(x.shape, dtype=spec.dtype, device=dev)
    scale = torch.empty((r, n_tiles), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((r, n_tiles), dtype=torch.uint8 if mx else torch.float32, device=dev)
    rec = request.record if record else None
    record_bits = rec.view(torch.int32) if rec is not None else scale
    max_bits, mbits, bias = _FORMAT[spec.dtype]
    f_exp, f_mant = _MX_MAX[spec.dtype]
    K.lastdim_cast_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
        src, data.view(torch.uint8), scale, scale_inv, record_bits, r, k, src.stride(0), src.stride(1), n_tiles,
        IN_KIND=in_kind, RECORD=rec is not None, MX=mx, POW2=power_of_2, FP8_MAX=spec.fp8_max,
        MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, F_EXP=f_exp, F_MANT_BITS=f_mant, HW=_hardware(),
        BR=br, BK=bk, T=t,
    )
    shape = (*x.shape[:-1], n_tiles) if x.dim() else (n_tiles,)
    inv = scale_inv.view(torch.float8_e8m0fnu) if mx else scale_inv
    tile_shape = (1, x.shape[-1]) if kind == GranularityKind.ROW else (1, tile)
    return Orientation(data, scale.view(shape), inv.view(shape), tile_shape)


def _cast_blocks(request: CastRequest, block: int, power_of_2: bool) -> Quantized:
    """``block x block`` blocks of the last two dimensions: one launch, both orientations from one read."""
    x, spec = request.x, request.spec
    *lead, m, k = x.shape
    x3 = x.unsqueeze(0) if x.dim() == 2 else x.contiguous().view(-1, m, k)
    src, in_kind = _as_readable(x3)
    batch = x3.shape[0]
    mt, kt = -(-m // block), -(-k // block)
    dev = x.device
    data = torch.empty(x.shape, dtype=spec.dtype, device=dev)
    data_t = torch.empty((k, m), dtype=spec.dtype, device=dev) if request.transpose else data
    scale = torch.empty((batch, mt, kt), dtype=torch.float32, device=dev)
    scale_inv = torch.empty_like(scale)
    rec = request.record
    max_bits, mbits, bias = _FORMAT[spec.dtype]
    cb = min(_p2(kt), max(_PROGRAM_ELEMENTS // (block * block), 1))
    rb = min(_p2(mt), max(_PROGRAM_ELEMENTS // (block * block * cb), 1))
    K.block_cast_kernel[(triton.cdiv(mt, rb), triton.cdiv(kt, cb), batch)](
        src, data.view(torch.uint8), data_t.view(torch.uint8), scale, scale_inv,
        rec.view(torch.int32) if rec is not None else scale, m, k, src.stride(0), src.stride(1), src.stride(2),
        mt, kt, IN_KIND=in_kind, RECORD=rec is not None, TRANSPOSE=request.transpose, POW2=power_of_2,
        FP8_MAX=spec.fp8_max, MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, HW=_hardware(), B=block, RB=rb, CB=cb,
    )
    scale = scale.view(*lead, mt, kt)
    scale_inv = scale_inv.view(*lead, mt, kt)
    rows = Orientation(data, scale, scale_inv, (block, block))
    if not request.transpose:
        return Quantized.of(rows, None)
    return Quantized.of(rows, Orientation(data_t, scale.t(), scale_inv.t(), (block, block)))


def update(
    history: Tensor, scales: Tensor, step_amax: Tensor, fp8_max: Tensor, rule: ScaleRule,
    nonfinite_counts: Tensor | None, forget_nonfinite: bool,
) -> None:
    """The step update of every slot, in place: one launch whatever the slot count."""
    n, h = history.shape
    if n == 0:
        return
    bh = _p2(h)
    bn = min(_p2(n), max(_PROGRAM_ELEMENTS // bh, 1))
    with _quiet():
        _launch_update(history, scales, step_amax, fp8_max, rule, nonfinite_counts, forget_nonfinite, n, h, bn, bh)


def _launch_update(
    history: Tensor, scales: Tensor, step_amax: Tensor, fp8_max: Tensor, rule: ScaleRule,
    nonfinite_counts: Tensor | None, forget_nonfinite: bool, n: int, h: int, bn: int, bh: int,
) -> None:
    K.update_kernel[(triton.cdiv(n, bn),)](
        history, scales, step_amax, fp8_max, nonfinite_counts if nonfinite_counts is not None else scales, n, h,
        COUNT=nonfinite_counts is not None, FORGET=forget_nonfinite, MOST_RECENT=rule.amax_compute == "most_recent",
        MARGIN_DIV=float(2.0**rule.margin), POW2=rule.power_of_2, FLOOR=_floor(rule), BN=bn, BH=bh,
    )

