"""The Triton kernels of the ``cuda`` backend, and the integer numerics they share.

Every kernel compiles in one of two ways, chosen by the ``HW`` constexpr:

* ``HW=False``: FP8 rounding written with integer operations on the float32
  bits (round to nearest even, saturation, subnormals). It is bit-exact
  against torch's ``clamp(x * scale, -max, max).to(float8)`` and is the path
  Triton's interpreter runs (the interpreter's own FP8 conversion rounds
  ties away from zero and does not saturate).
* ``HW=True``: the hardware conversion (``cvt.rn.satfinite``), the GPU default.

Shared rules, so that both paths and the emulation backend agree bit for bit:

* inputs are read as raw bits: float32 as int32, bfloat16 as int16 shifted
  into the high half (the interpreter's bfloat16 load flushes subnormals),
  float16 converted by the load;
* an amax is an int32 max over ``bits & 0x7FFFFFFF``: for non-negative
  floats the integer order is the float order, and a NaN (bits above
  ``0x7F800000``) wins, so NaN propagates; accumulators are maxed with an
  int32 ``atomic_max`` on their bits (valid: amaxes are never negative);
* every division is ``tl.math.div_rn`` (correctly rounded), never ``/``;
* NaN casts to ``0x7F`` with the input's sign bit, as torch does on CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "amax_kernel",
    "block_cast_kernel",
    "lastdim_cast_kernel",
    "tensor_cast_kernel",
    "update_kernel",
]

_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_EXP_BITS = 0x7F800000
_MANT_BITS = 0x007FFFFF
_FLOAT32_TINY = 1.1754943508222875e-38
_FLOAT32_MAX = 3.4028234663852886e38


@triton.jit
def load_f32(ptr, offs, mask, IN_KIND: tl.constexpr):
    """Load as float32: ``IN_KIND`` 0 float32 (an int32 view), 1 bfloat16 (an int16 view), 2 float16."""
    if IN_KIND == 0:
        x = tl.load(ptr + offs, mask=mask, other=0).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        raw = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        x = (raw << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def magnitude(x):
    """``|x|`` as int32 bits (ordered as the floats; NaN above every number)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def to_fp8_code(y, MAX_BITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """``y`` saturated to the format's max and rounded to nearest even: the FP8 byte as int32."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.minimum(a, MAX_BITS)
    if HW:
        sat = (a | (bits & -2147483648)).to(tl.float32, bitcast=True)
        if MBITS == 3:
            code = sat.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32) & 0x7F
        else:
            code = sat.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32) & 0x7F
    else:
        e = (a >> 23) - 127
        normal = e >= 1 - BIAS
        biased = a - ((127 - BIAS) << 23)
        rounded = (biased + ((1 << (22 - MBITS)) - 1) + ((biased >> (23 - MBITS)) & 1)) >> (23 - MBITS)
        m = (a & 0x007FFFFF) | 0x00800000
        sh = tl.maximum(tl.minimum(23 + 1 - BIAS - MBITS - e, 25), 1)
        q = m >> sh
        rem = m & ((1 << sh) - 1)
        half = 1 << (sh - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        code = tl.where(normal, rounded, q + up.to(tl.int32))
    return tl.where(nan, 0x7F, code) | sign


@triton.jit
def scale_of(amax_bits, previous, FP8_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr,
             FLOOR: tl.constexpr):
    """:func:`scalestate.math.scale_from_amax` on an amax given as magnitude bits."""
    usable = (amax_bits > 0) & (amax_bits < 0x7F800000)
    amax = tl.where(usable, amax_bits, 0x3F800000).to(tl.float32, bitcast=True)
    if FLOOR > 0.0:
        amax = tl.maximum(amax, FLOOR)
    s = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    if MARGIN_DIV != 1.0:
        s = tl.math.div_rn(s, tl.full(s.shape, MARGIN_DIV, tl.float32))
    s = tl.minimum(tl.maximum(s, 1.1754943508222875e-38), 3.4028234663852886e38)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(usable, s, previous)


@triton.jit
def mx_exp(amax_bits, F_EXP: tl.constexpr, F_MANT_BITS: tl.constexpr):
    """:func:`scalestate.finegrained.mx_exponent` on magnitude bits: ``ceil(log2(amax / fp8_max))``."""
    usable = (amax_bits > 0) & (amax_bits < 0x7F800000)
    bits = tl.where(usable, amax_bits, 0x3F800000)
    e = (bits >> 23) - 127 - F_EXP + ((bits & 0x007FFFFF) > F_MANT_BITS).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(usable, e, 0)


@triton.jit
def pow2_neg(e):
    """``2**-e`` as float32 for int32 ``e`` in ``[-127, 127]`` (``2**-127`` is subnormal)."""
    n = -e
    normal = ((n + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(n > -127, normal, 5.877471754111438e-39)


@triton.jit
def amax_kernel(x_ptr, amax_ptr, record_ptr, M, N, stride_m, stride_n,
                IN_KIND: tl.constexpr, RECORD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Max ``|x|`` of a 2-d view into ``amax_ptr`` (int32 bits), and into ``record_ptr`` when ``RECORD``."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = load_f32(x_ptr, rm[:, None] * stride_m + rn[None, :] * stride_n, mask, IN_KIND)
    a = tl.max(tl.max(magnitude(x), axis=1), axis=0)
    tl.atomic_max(amax_ptr, a)
    if RECORD:
        tl.atomic_max(record_ptr, a)


@triton.jit
def tensor_cast_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, jit_ptr, amax_ptr, record_ptr, scale_out_ptr, scale_inv_out_ptr,
    M, N, stride_m, stride_n,
    IN_KIND: tl.constexpr, JIT: tl.constexpr, RECORD: tl.constexpr, TRANSPOSE: tl.constexpr,
    FP8_MAX: tl.constexpr, MAX_BITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, FLOOR: tl.constexpr, HW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """Per-tensor cast of a 2-d view: scale, saturate, round; the transposed copy and the record too.

    ``JIT`` 0: cast with ``scale_ptr``, recording the amax in the same pass (one read). 1: with
    the scale of the amax in ``amax_ptr`` (found and recorded by :func:`amax_kernel` first).
    3 then 2, per ``jit_ptr`` (a bool on the device, as delayed scaling passes it): 3 casts with
    ``scale_ptr`` and also maxes the amax into ``amax_ptr``; 2 then exits at once where the flag
    is false and otherwise casts again with the scale of that amax. So a slot with history costs
    one read of ``x`` and a launch that reads one byte; one without, two reads.
    """
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    if JIT == 2:
        if tl.load(jit_ptr) == 0:
            return
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = load_f32(x_ptr, rm[:, None] * stride_m + rn[None, :] * stride_n, mask, IN_KIND)
    previous = tl.load(scale_ptr)
    if JIT == 0 or JIT == 3:
        s = previous
        if RECORD or JIT == 3:
            a = tl.max(tl.max(magnitude(x), axis=1), axis=0)
            if RECORD:
                tl.atomic_max(record_ptr, a)
            if JIT == 3:
                tl.atomic_max(amax_ptr, a)
    else:
        s = scale_of(tl.load(amax_ptr), previous, FP8_MAX, MARGIN_DIV, POW2, FLOOR)
    code = to_fp8_code(x * s, MAX_BITS, MBITS, BIAS, HW).to(tl.uint8)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], code, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + rn[None, :] * M + rm[:, None], code, mask=mask)
    if (pm == 0) & (pn == 0):
        tl.store(scale_out_ptr, s)
        tl.store(scale_inv_out_ptr, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s))


@triton.jit
def lastdim_cast_kernel(
    x_ptr, out_ptr, scale_ptr, scale_inv_ptr, record_ptr,
    R, K, stride_r, stride_k, n_tiles,
    IN_KIND: tl.constexpr, RECORD: tl.constexpr, MX: tl.constexpr, POW2: tl.constexpr,
    FP8_MAX: tl.constexpr, MAX_BITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    F_EXP: tl.constexpr, F_MANT_BITS: tl.constexpr, HW: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, T: tl.constexpr,
):
    """One scale per ``T`` consecutive elements of each row of an ``[R, K]`` view (rows, tiles, MX).

    Zero padding past the row's end never changes a max, so a partial tile's amax is that of the
    elements it holds. ``MX``: E8M0 exponents from the bits (``scale_inv_ptr`` takes the bytes).
    """
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rr[:, None] < R) & (rk[None, :] < K)
    x = load_f32(x_ptr, rr[:, None] * stride_r + rk[None, :] * stride_k, mask, IN_KIND)
    a = magnitude(x)
    tile_amax = tl.max(tl.reshape(a, (BR, BK // T, T)), axis=2)
    if MX:
        e = mx_exp(tile_amax, F_EXP, F_MANT_BITS)
        s = pow2_neg(e)
    else:
        s = scale_of(tile_amax, tl.full(tile_amax.shape, 1.0, tl.float32), FP8_MAX, 1.0, POW2, 0.0)
    s_full = tl.reshape(tl.broadcast_to(tl.reshape(s, (BR, BK // T, 1)), (BR, BK // T, T)), (BR, BK))
    code = to_fp8_code(x * s_full, MAX_BITS, MBITS, BIAS, HW).to(tl.uint8)
    tl.store(out_ptr + rr[:, None] * K + rk[None, :], code, mask=mask)
    rt = tl.program_id(1) * (BK // T) + tl.arange(0, BK // T)
    tmask = (rr[:, None] < R) & (rt[None, :] < n_tiles)
    toffs = rr[:, None] * n_tiles + rt[None, :]
    tl.store(scale_ptr + toffs, s, mask=tmask)
    if MX:
        tl.store(scale_inv_ptr + toffs, (e + 127).to(tl.uint8), mask=tmask)
    else:
        tl.store(scale_inv_ptr + toffs, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=tmask)
    if RECORD:
        tl.atomic_max(record_ptr, tl.max(tl.max(tile_amax, axis=1), axis=0))


@triton.jit
def block_cast_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, scale_inv_ptr, record_ptr,
    M, K, stride_b, stride_m, stride_k, mt, kt,
    IN_KIND: tl.constexpr, RECORD: tl.constexpr, TRANSPOSE: tl.constexpr, POW2: tl.constexpr,
    FP8_MAX: tl.constexpr, MAX_BITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr,
    B: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
):
    """One scale per ``B x B`` block of ``[batch, M, K]``, ``RB x CB`` blocks per program; with
    ``TRANSPOSE`` (2-d) the transposed data too, from the same read."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    pb = tl.program_id(2)
    rm = pm * (RB * B) + tl.arange(0, RB * B)
    rk = pk * (CB * B) + tl.arange(0, CB * B)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = load_f32(x_ptr + pb * stride_b, rm[:, None] * stride_m + rk[None, :] * stride_k, mask, IN_KIND)
    a = tl.reshape(magnitude(x), (RB, B, CB, B))
    amax = tl.max(tl.max(a, axis=3), axis=1)
    s = scale_of(amax, tl.full(amax.shape, 1.0, tl.float32), FP8_MAX, 1.0, POW2, 0.0)
    s_full = tl.reshape(tl.broadcast_to(tl.reshape(s, (RB, 1, CB, 1)), (RB, B, CB, B)), (RB * B, CB * B))
    code = to_fp8_code(x * s_full, MAX_BITS, MBITS, BIAS, HW).to(tl.uint8)
    tl.store(out_ptr + pb * M * K + rm[:, None] * K + rk[None, :], code, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + rk[None, :] * M + rm[:, None], code, mask=mask)
    bm = pm * RB + tl.arange(0, RB)
    bk = pk * CB + tl.arange(0, CB)
    bmask = (bm[:, None] < mt) & (bk[None, :] < kt)
    sidx = pb * mt * kt + bm[:, None] * kt + bk[None, :]
    tl.store(scale_ptr + sidx, s, mask=bmask)
    tl.store(scale_inv_ptr + sidx, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=bmask)
    if RECORD:
        tl.atomic_max(record_ptr, tl.max(tl.max(amax, axis=1), axis=0))


@triton.jit
def update_kernel(
    history_ptr, scales_ptr, step_amax_ptr, fp8_max_ptr, counts_ptr, N, H,
    COUNT: tl.constexpr, FORGET: tl.constexpr, MOST_RECENT: tl.constexpr,
    MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, FLOOR: tl.constexpr,
    BN: tl.constexpr, BH: tl.constexpr,
):
    """The step update of every slot (:func:`scalestate.math.update_scales`), in place; zeroes the amaxes.

    Histories hold usable amaxes or zeros (never negative, never NaN), so their max is an int32 max.
    """
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rh = tl.arange(0, BH)
    nmask = rn < N
    hmask = nmask[:, None] & (rh[None, :] < H)
    sa_bits = tl.load(step_amax_ptr + rn, mask=nmask, other=0.0).to(tl.int32, bitcast=True)
    sa_abs = sa_bits & 0x7FFFFFFF
    bad = sa_abs >= 0x7F800000
    if COUNT:
        counts = tl.load(counts_ptr + rn, mask=nmask, other=0)
        tl.store(counts_ptr + rn, counts + bad.to(tl.int64), mask=nmask)
    hist = tl.load(history_ptr + rn[:, None] * H + rh[None, :], mask=hmask, other=0.0)
    nxt = tl.load(history_ptr + rn[:, None] * H + rh[None, :] + 1, mask=hmask & (rh[None, :] + 1 < H), other=0.0)
    if FORGET:
        hist = tl.where(bad[:, None], 0.0, hist)
        nxt = tl.where(bad[:, None], 0.0, nxt)
    sa = sa_bits.to(tl.float32, bitcast=True)
    rolled = tl.where(rh[None, :] == H - 1, sa[:, None], nxt)
    keep = (sa_bits > 0) & (sa_bits < 0x7F800000)
    new = tl.where(keep[:, None], rolled, hist)
    tl.store(history_ptr + rn[:, None] * H + rh[None, :], new, mask=hmask)
    new_bits = tl.where(hmask, new.to(tl.int32, bitcast=True), 0)
    if MOST_RECENT:
        amax = tl.max(tl.where(rh[None, :] == H - 1, new_bits, 0), axis=1)
    else:
        amax = tl.max(new_bits, axis=1)
    fmax = tl.load(fp8_max_ptr + rn, mask=nmask, other=1.0)
    previous = tl.load(scales_ptr + rn, mask=nmask, other=1.0)
    usable = (amax > 0) & (amax < 0x7F800000)
    a = tl.where(usable, amax, 0x3F800000).to(tl.float32, bitcast=True)
    if FLOOR > 0.0:
        a = tl.maximum(a, FLOOR)
    s = tl.math.div_rn(fmax, a)
    if MARGIN_DIV != 1.0:
        s = tl.math.div_rn(s, tl.full(s.shape, MARGIN_DIV, tl.float32))
    s = tl.minimum(tl.maximum(s, 1.1754943508222875e-38), 3.4028234663852886e38)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    tl.store(scales_ptr + rn, tl.where(usable, s, previous), mask=nmask)
    tl.store(step_amax_ptr + rn, tl.zeros((BN,), tl.float32), mask=nmask)
