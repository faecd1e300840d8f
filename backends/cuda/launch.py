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
import struct

import torch
import triton
from torch import Tensor

from scalestate.backends.base import CastRequest
from scalestate.backends.cuda import kernels as K
from scalestate.granularity import GranularityKind
from scalestate.math import ScaleRule
from scalestate.quantized import Orientation, Quantized

__all__ = ["INTERPRETED", "block_warps", "blocks_cast", "cast", "lastdim_cast", "tensor_cast", "update"]

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
    """One cast, as :class:`~scalestate.backends.CastRequest` says (per tensor or fine-grained).

    In eager code the kernels are launched directly; while ``torch.compile`` traces, through the
    custom ops ``scalestate_cuda::cast_tensor``, ``cast_lastdim`` and ``cast_blocks``, opaque to the
    compiler, with fake implementations that give the outputs' shapes.
    """
    spec = request.spec
    if spec.granularity is None:
        return _cast_tensor(request)
    kind, block, power_of_2 = spec.granularity
    if kind == GranularityKind.BLOCK:
        return _cast_blocks(request, block, power_of_2)
    x = request.x
    tile = max(x.shape[-1], 1) if kind == GranularityKind.ROW else block
    rows = _cast_lastdim(x, request, kind, tile, power_of_2, request.record)
    if not request.transpose:
        return Quantized.of(rows, None)
    col_tile = max(x.shape[0], 1) if kind == GranularityKind.ROW else block
    return Quantized.of(rows, _cast_lastdim(x.t(), request, kind, col_tile, power_of_2, None))


def _quiet() -> contextlib.AbstractContextManager[object]:
    """Under the interpreter, numpy's warnings about the infinities the kernels clamp on purpose
    (``448 / 1e-44``) are silenced; on a GPU nothing is."""
    if not INTERPRETED:
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(over="ignore", divide="ignore", invalid="ignore")


def _floor(rule: ScaleRule) -> float:
    """The amax floor as the float32 nearest to it (what ``clamp(min=floor)`` on float32 uses)."""
    # struct's "f" rounds to the nearest float32 as torch does, without making a tensor on every cast
    return struct.unpack("f", struct.pack("f", rule.amax_floor))[0] if rule.amax_floor else 0.0


def _cast_tensor(request: CastRequest) -> Quantized:
    spec, rule, jit = request.spec, request.spec.rule, request.jit
    mode = 0 if jit is False else 1 if jit is True else 2
    args = (
        request.x, request.scale, jit if isinstance(jit, Tensor) else None, mode, request.record, request.transpose,
        spec.dtype, spec.fp8_max, rule.margin, rule.power_of_2, _floor(rule),
    )
    op = _OPS[0] if torch.compiler.is_compiling() else tensor_cast
    data, data_t, scale, scale_inv = op(*args)
    rows = Orientation(data, scale, scale_inv)
    return Quantized.of(rows, Orientation(data_t, scale, scale_inv) if request.transpose else None)


def tensor_cast(
    x: Tensor, scale_in: Tensor, jit: Tensor | None, jit_mode: int, record: Tensor | None, transpose: bool,
    dtype: torch.dtype, fp8_max: float, margin: int, power_of_2: bool, floor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-tensor cast: ``(data, data_t, scale, scale_inv)`` (``data_t`` empty without ``transpose``).

    ``jit_mode`` 0: with ``scale_in``, one launch (the amax recorded in the same pass). 1 (just in
    time): a zeroed scratch amax, one amax launch (which records), one cast launch: two reads of
    ``x``, since the scale needs the amax first. 2 (per the device flag ``jit``, as delayed scaling
    passes it): a zeroed scratch amax, a cast with ``scale_in`` that also finds the amax (and
    records), and a second cast launch that exits at once where the flag is false and casts again
    with the tensor's own scale where it is true: one read of ``x`` for a slot with history.
    """
    x2 = _rows(x)
    m, n = x2.shape
    src, kind = _as_readable(x2)
    dev = x.device
    data = torch.empty(x.shape, dtype=dtype, device=dev)
    data_t = torch.empty((n, m) if transpose else (0,), dtype=dtype, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    record_bits = record.view(torch.int32) if record is not None else scale_inv
    jit_flag = jit.view(torch.uint8) if jit is not None else scale
    bm, bn = _blocks(m, n)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    max_bits, mbits, bias = _FORMAT[dtype]
    amax = torch.zeros((), dtype=torch.int32, device=dev) if jit_mode else scale

    def launch(mode: int, recorded: bool) -> None:
        K.tensor_cast_kernel[grid](
            src, data.view(torch.uint8), data_t.view(torch.uint8), scale_in, jit_flag, amax, record_bits, scale,
            scale_inv, m, n, src.stride(0), src.stride(1),
            IN_KIND=kind, JIT=mode, RECORD=recorded, TRANSPOSE=transpose,
            FP8_MAX=fp8_max, MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, MARGIN_DIV=float(2.0**margin),
            POW2=power_of_2, FLOOR=floor, HW=_hardware(), BM=bm, BN=bn,
        )

    with _quiet():
        if jit_mode == 1:
            K.amax_kernel[grid](src, amax, record_bits, m, n, src.stride(0), src.stride(1),
                                IN_KIND=kind, RECORD=record is not None, BM=bm, BN=bn)
            launch(1, False)
        elif jit_mode == 2:
            launch(3, record is not None)
            launch(2, False)
        else:
            launch(0, record is not None)
    return data, data_t, scale, scale_inv


def _cast_lastdim(
    x: Tensor, request: CastRequest, kind: GranularityKind, tile: int, power_of_2: bool, record: Tensor | None
) -> Orientation:
    spec = request.spec
    mx = kind == GranularityKind.MX
    op = _OPS[1] if torch.compiler.is_compiling() else lastdim_cast
    data, scale, scale_inv = op(x, record, mx, tile, power_of_2, spec.dtype, spec.fp8_max)
    n_tiles = scale.shape[-1]
    shape = (*x.shape[:-1], n_tiles) if x.dim() else (n_tiles,)
    inv = scale_inv.view(torch.float8_e8m0fnu) if mx else scale_inv
    tile_shape = (1, x.shape[-1]) if kind == GranularityKind.ROW else (1, tile)
    return Orientation(data, scale.view(shape), inv.view(shape), tile_shape)


def lastdim_cast(
    x: Tensor, record: Tensor | None, mx: bool, tile: int, power_of_2: bool, dtype: torch.dtype, fp8_max: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows, tiles or MX blocks along the last dimension, one launch (one read of ``x``):
    ``(data, scale [rows, tiles], scale_inv [rows, tiles])``, ``scale_inv`` as E8M0 bytes for MX."""
    x2 = _rows(x)
    r, k = x2.shape
    src, in_kind = _as_readable(x2)
    t = _p2(tile)
    n_tiles = -(-k // tile)
    bk = max(t, min(_p2(k), _PROGRAM_ELEMENTS))
    br = min(_p2(r), max(_PROGRAM_ELEMENTS // bk, 1))
    dev = x.device
    data = torch.empty(x.shape, dtype=dtype, device=dev)
    scale = torch.empty((r, n_tiles), dtype=torch.float32, device=dev)
    scale_inv = torch.empty((r, n_tiles), dtype=torch.uint8 if mx else torch.float32, device=dev)
    record_bits = record.view(torch.int32) if record is not None else scale
    max_bits, mbits, bias = _FORMAT[dtype]
    f_exp, f_mant = _MX_MAX[dtype]
    with _quiet():
        K.lastdim_cast_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
            src, data.view(torch.uint8), scale, scale_inv, record_bits, r, k, src.stride(0), src.stride(1), n_tiles,
            IN_KIND=in_kind, RECORD=record is not None, MX=mx, POW2=power_of_2, FP8_MAX=fp8_max,
            MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, F_EXP=f_exp, F_MANT_BITS=f_mant, HW=_hardware(),
            BR=br, BK=bk, T=t,
        )
    return data, scale, scale_inv


def _cast_blocks(request: CastRequest, block: int, power_of_2: bool) -> Quantized:
    x, spec = request.x, request.spec
    lead = x.shape[:-2]
    op = _OPS[2] if torch.compiler.is_compiling() else blocks_cast
    data, data_t, scale, scale_inv = op(x, request.record, block, power_of_2, request.transpose, spec.dtype,
                                        spec.fp8_max)
    mt, kt = scale.shape[-2:]
    scale = scale.view(*lead, mt, kt)
    scale_inv = scale_inv.view(*lead, mt, kt)
    rows = Orientation(data, scale, scale_inv, (block, block))
    if not request.transpose:
        return Quantized.of(rows, None)
    return Quantized.of(rows, Orientation(data_t, scale.t(), scale_inv.t(), (block, block)))


def block_warps(elements: int) -> int:
    """Warps of a block-cast program: 8 from 16,384 elements (one 128 x 128 block). With 4, the
    reference rounding and the transposed store need more than 255 registers per thread on sm_89
    (``tests/test_cuda_ptx.py`` checks that no variant spills)."""
    return 8 if elements >= 1 << 14 else 4


def blocks_cast(
    x: Tensor, record: Tensor | None, block: int, power_of_2: bool, transpose: bool, dtype: torch.dtype,
    fp8_max: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``block x block`` blocks of the last two dimensions, one launch writing both orientations from
    one read: ``(data, data_t, scale [batch, mt, kt], scale_inv)`` (``data_t`` empty without ``transpose``)."""
    *_, m, k = x.shape
    x3 = x.unsqueeze(0) if x.dim() == 2 else x.contiguous().view(-1, m, k)
    src, in_kind = _as_readable(x3)
    batch = x3.shape[0]
    mt, kt = -(-m // block), -(-k // block)
    dev = x.device
    data = torch.empty(x.shape, dtype=dtype, device=dev)
    data_t = torch.empty((k, m) if transpose else (0,), dtype=dtype, device=dev)
    scale = torch.empty((batch, mt, kt), dtype=torch.float32, device=dev)
    scale_inv = torch.empty_like(scale)
    max_bits, mbits, bias = _FORMAT[dtype]
    cb = min(_p2(kt), max(_PROGRAM_ELEMENTS // (block * block), 1))
    rb = min(_p2(mt), max(_PROGRAM_ELEMENTS // (block * block * cb), 1))
    with _quiet():
        K.block_cast_kernel[(triton.cdiv(mt, rb), triton.cdiv(kt, cb), batch)](
            src, data.view(torch.uint8), data_t.view(torch.uint8), scale, scale_inv,
            record.view(torch.int32) if record is not None else scale, m, k, src.stride(0), src.stride(1),
            src.stride(2), mt, kt, IN_KIND=in_kind, RECORD=record is not None, TRANSPOSE=transpose,
            POW2=power_of_2, FP8_MAX=fp8_max, MAX_BITS=max_bits, MBITS=mbits, BIAS=bias, HW=_hardware(), B=block,
            RB=rb, CB=cb, num_warps=block_warps(block * block * rb * cb),
        )
    return data, data_t, scale, scale_inv


# ------------------------------------------------------------------ torch.compile: opaque custom ops
@torch.library.custom_op("scalestate_cuda::cast_tensor", mutates_args=("record",))
def _cast_tensor_op(
    x: Tensor, scale_in: Tensor, jit: Tensor | None, jit_mode: int, record: Tensor | None, transpose: bool,
    dtype: torch.dtype, fp8_max: float, margin: int, power_of_2: bool, floor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tensor_cast(x, scale_in, jit, jit_mode, record, transpose, dtype, fp8_max, margin, power_of_2, floor)


@_cast_tensor_op.register_fake
def _(
    x: Tensor, scale_in: Tensor, jit: Tensor | None, jit_mode: int, record: Tensor | None, transpose: bool,
    dtype: torch.dtype, fp8_max: float, margin: int, power_of_2: bool, floor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    m, n = _rows(x).shape
    t_shape = (n, m) if transpose else (0,)
    one = x.new_empty((), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(t_shape, dtype=dtype), one, torch.empty_like(one)


@torch.library.custom_op("scalestate_cuda::cast_lastdim", mutates_args=("record",))
def _cast_lastdim_op(
    x: Tensor, record: Tensor | None, mx: bool, tile: int, power_of_2: bool, dtype: torch.dtype, fp8_max: float
) -> tuple[Tensor, Tensor, Tensor]:
    return lastdim_cast(x, record, mx, tile, power_of_2, dtype, fp8_max)


@_cast_lastdim_op.register_fake
def _(
    x: Tensor, record: Tensor | None, mx: bool, tile: int, power_of_2: bool, dtype: torch.dtype, fp8_max: float
) -> tuple[Tensor, Tensor, Tensor]:
    r, k = _rows(x).shape
    n_tiles = -(-k // tile)
    return (
        x.new_empty(x.shape, dtype=dtype), x.new_empty((r, n_tiles), dtype=torch.float32),
        x.new_empty((r, n_tiles), dtype=torch.uint8 if mx else torch.float32),
    )


@torch.library.custom_op("scalestate_cuda::cast_blocks", mutates_args=("record",))
def _cast_blocks_op(
    x: Tensor, record: Tensor | None, block: int, power_of_2: bool, transpose: bool, dtype: torch.dtype,
    fp8_max: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return blocks_cast(x, record, block, power_of_2, transpose, dtype, fp8_max)


@_cast_blocks_op.register_fake
def _(
    x: Tensor, record: Tensor | None, block: int, power_of_2: bool, transpose: bool, dtype: torch.dtype,
    fp8_max: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    *lead, m, k = x.shape
    batch = 1
    for d in lead:
        batch *= d
    mt, kt = -(-m // block), -(-k // block)
    scale = x.new_empty((batch, mt, kt), dtype=torch.float32)
    t_shape = (k, m) if transpose else (0,)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(t_shape, dtype=dtype), scale, torch.empty_like(scale)


#: The ops' overloads, looked up once here: looking one up for the first time while the compiler
#: traces (after another was looked up) fails in torch 2.13's tracer.
_OPS = (
    torch.ops.scalestate_cuda.cast_tensor.default,
    torch.ops.scalestate_cuda.cast_lastdim.default,
    torch.ops.scalestate_cuda.cast_blocks.default,
)


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

