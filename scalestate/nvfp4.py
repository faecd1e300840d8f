"""NVFP4 numerics: E2M1 values in blocks of 16, an E4M3 scale per block, a float32 scale per tensor.

Pure functions over tensors, exact by construction and the same on every
device: a fixed number of tensor operations whatever the size, no value read
back to the host, no floating-point operation whose order a kernel may
choose (the Hadamard transform is a butterfly, not a matrix product), and no
random number from torch's generators (stochastic rounding draws from a
counter-based hash of a key, :func:`random_bits`). They are the reference the
``emulation`` backend runs and every other backend is tested against; no
manager or recipe state is involved.

For a tensor ``x`` with per-tensor amax ``A``, in float32 (docs/recipes.md):

* ``S_enc = 2688 / A`` (``448 * 6``, :data:`TENSOR_MAX`), at most the float32
  max; 1 where ``A`` is zero or not finite (:func:`tensor_scale`);
  ``S_dec = 1 / S_enc``.
* per block ``b`` (16 elements along the last dimension, or 16 x 16 for
  2-d weights; the last block of a row may be partial):
  ``s_b = e4m3(clamp(max|x_b| / 6 * S_enc, -448, 448))``, stored;
  ``e_b = min(1 / (s_b * S_dec), float32 max)``, the multiplier applied;
* ``q = round_e2m1(clamp(x * e_b, -6, 6))`` (:func:`scalestate.e2m1.round_e2m1`,
  or :func:`scalestate.e2m1.stochastic_round_e2m1`), stored packed two per
  byte (:func:`scalestate.e2m1.pack_e2m1`), the first value of a pair in the
  low nibble;
* ``dequantize = q * (s_b * S_dec)``.

Example:
    >>> import torch
    >>> from scalestate.nvfp4 import quantize_nvfp4
    >>> q = quantize_nvfp4(torch.tensor([[1.0, -3.0, 0.25, 6.0]]))
    >>> q.dequantize()
    tensor([[ 1., -3.,  0.,  6.]])
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor

from scalestate.e2m1 import (
    E2M1_MAX,
    Packing,
    block_multipliers,
    encode_e2m1,
    nearest_codes,
    pack_e2m1,
    stochastic_round_e2m1,
)
from scalestate.errors import ArgumentValueError, CastError
from scalestate.finegrained import FineQuantized, check_input
from scalestate.math import ScaleRule, abs_max, scale_from_amax
from scalestate.quantized import Orientation

__all__ = [
    "E4M3_MAX",
    "NVFP4_BLOCK",
    "TENSOR_MAX",
    "block_scales",
    "hadamard16",
    "mix32",
    "quantize_nvfp4",
    "random_bits",
    "rht_signs",
    "seed_key",
    "slot_key",
    "stream_key",
    "tensor_scale",
]

#: Elements per block scale (along a row; weights may use 16 x 16 blocks).
NVFP4_BLOCK = 16
#: The largest E4M3 value, the block scales' format.
E4M3_MAX = 448.0
#: ``E2M1_MAX * E4M3_MAX``: the per-tensor scale maps a tensor's amax onto it.
TENSOR_MAX = E2M1_MAX * E4M3_MAX

_M32 = 0xFFFFFFFF
#: The odd multiplier of :func:`mix32` (below 2**31, so that no int64 product overflows).
_MIX = 0x45D9F3B
#: What the RHT signs' stream is keyed by, besides the seed (``"RHT"`` in ASCII).
_RHT_SALT = 0x524854
_TENSOR_RULE = ScaleRule()


# ------------------------------------------------------------------ the counter-based generator
def mix32(h: Tensor) -> Tensor:
    """A bijection of ``[0, 2**32)`` that scrambles every bit (int64 tensors holding 32-bit values).

    ``h ^= h >> 16; h *= 0x45D9F3B (mod 2**32); h ^= h >> 16; h *= 0x45D9F3B; h ^= h >> 16``.
    The products stay below ``2**59``: no int64 arithmetic overflows, so every device computes the same bits.
    """
    h = h ^ (h >> 16)
    h = (h * _MIX) & _M32
    h = h ^ (h >> 16)
    h = (h * _MIX) & _M32
    return h ^ (h >> 16)


def _mix_int(h: int) -> int:
    """:func:`mix32` of a Python int."""
    h = (h ^ (h >> 16)) & _M32
    h = (h * _MIX) & _M32
    h ^= h >> 16
    h = (h * _MIX) & _M32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit key of a seed in ``[0, 2**63)``: both halves mixed in."""
    return _mix_int(_mix_int(seed & _M32) ^ (seed >> 32))


def slot_key(name: str, role: str) -> int:
    """A slot's 32-bit key: the CRC-32 of ``"<name>\\0<role>"`` (the same in every process)."""
    return zlib.crc32(f"{name}\0{role}".encode())


def stream_key(base: Tensor | int, *words: Tensor | int) -> Tensor | int:
    """Fold 32-bit ``words`` into ``base``: ``h = mix32(h ^ word)`` for each (int64 tensors or ints)."""
    h = base
    for word in words:
        if isinstance(h, int) and isinstance(word, int):
            h = _mix_int(h ^ word)
        elif isinstance(h, Tensor):
            h = mix32(h ^ word)
        else:
            assert isinstance(word, Tensor)
            h = mix32(word ^ h)
    return h


def random_bits(key: Tensor, shape: tuple[int, ...], salt: int) -> Tensor:
    """24 random bits per element of ``shape`` (int64 in ``[0, 2**24)``), from a 0-d int64 ``key``.

    Element ``i`` (row-major) gets ``h >> 8`` with ``h = mix32(k ^ lo(i))``,
    then ``h = mix32(h ^ hi(i))`` where ``hi(i) > 0``; ``k = mix32(key ^ salt)``
    and ``lo``, ``hi`` are the 32-bit halves of ``i``: the same bits on every
    device, and an element's bits depend on its index alone, not on the size.
    """
    k = mix32(key ^ salt)
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int64, device=key.device)
    h = mix32(k ^ (index & _M32 if n > _M32 else index))
    if n > _M32:  # elements past 2**32 fold their high half in too
        high = index >> 32
        h = torch.where(high > 0, mix32(h ^ high), h)
    return (h >> 8).reshape(shape)


def rht_signs(seed: int, device: torch.device | str | None = None) -> Tensor:
    """The 16 signs (float32 ``+-1``) of the random Hadamard transform drawn from ``seed``.

    Sign ``i`` is ``-1`` where bit 31 of ``mix32(mix32(k) ^ i)`` is set (bit 23
    of :func:`random_bits` of ``k`` with salt 0), ``k = stream_key(seed_key(seed), 0x524854)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ArgumentValueError(f"seed must be an int in [0, 2**63); got {seed!r}")
    key = torch.tensor(stream_key(seed_key(seed), _RHT_SALT), dtype=torch.int64, device=device)
    bits = random_bits(key, (NVFP4_BLOCK,), 0)
    return torch.where((bits >> 23) & 1 == 1, -1.0, 1.0)


# ------------------------------------------------------------------ the transform
def hadamard16(x: Tensor, signs: Tensor) -> Tensor:
    """``x`` with each whole chunk ``v`` of 16 along the last dim replaced by ``H16 @ (signs * v) / 4``.

    ``H16`` is the Sylvester Hadamard matrix, so the transform is orthonormal:
    products contracting two operands transformed alike are unchanged (in
    exact arithmetic). Computed by four butterfly stages in float32 (a fixed
    order of additions), then an exact division by 4. A last chunk of fewer
    than 16 elements is left as it is (the identity is orthonormal too).
    """
    if not isinstance(signs, Tensor) or tuple(signs.shape) != (NVFP4_BLOCK,):
        got = tuple(signs.shape) if isinstance(signs, Tensor) else type(signs).__name__
        raise CastError(f"hadamard16 needs 16 signs (a tensor of shape (16,)); got {got}")
    xf = x.float()
    k = xf.shape[-1]
    whole = k - k % NVFP4_BLOCK
    if whole == 0:
        return xf.clone()
    v = xf[..., :whole].reshape(-1, whole // NVFP4_BLOCK, NVFP4_BLOCK) * signs
    n = v.shape[0] * v.shape[1]
    h = 1
    while h < NVFP4_BLOCK:
        pairs = v.reshape(n, NVFP4_BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack([a + b, a - b], dim=2)
        h *= 2
    out = (v.reshape(*xf.shape[:-1], whole) / 4.0)
    return out if whole == k else torch.cat([out, xf[..., whole:]], dim=-1)


# ------------------------------------------------------------------ scales
def tensor_scale(amax: Tensor, previous: Tensor | float = 1.0, rule: ScaleRule = _TENSOR_RULE) -> Tensor:
    """``S_enc = 2688 / amax`` (a float32 division, clamped to the float32 range), ``previous``
    (1 by default) where ``amax`` is zero or not finite; ``rule`` adds a delayed recipe's margin."""
    return scale_from_amax(amax, TENSOR_MAX, rule, previous=previous)


def block_scales(block_amax: Tensor, s_enc: Tensor) -> tuple[Tensor, Tensor]:
    """``(s_b, e_b)`` of blocks with amaxes ``block_amax`` under the per-tensor scale ``s_enc``.

    ``s_b = e4m3(clamp(block_amax / 6 * s_enc, -448, 448))`` (round to nearest even; NaN stays NaN)
    and ``e_b = min(1 / (s_b * (1 / s_enc)), float32 max)``.

    The division by 6 is a true float32 division by a tensor: divided by a Python
    number, torch's CUDA kernels multiply by its rounded reciprocal instead, which
    differs in the last bit for about a third of all quotients (and then,
    rarely, in an E4M3 block scale).
    """
    s_dec = torch.reciprocal(s_enc)
    six = block_amax.new_full((), E2M1_MAX)
    s_b = (torch.div(block_amax, six) * s_enc).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return s_b, block_multipliers(s_b, s_dec)


# ------------------------------------------------------------------ the cast
def quantize_nvfp4(
    x: Tensor,
    *,
    s_enc: Tensor | None = None,
    amax: Tensor | None = None,
    two_d: bool = False,
    columnwise: bool = False,
    signs: Tensor | None = None,
    sr_key: Tensor | None = None,
) -> FineQuantized:
    """The NVFP4 cast of ``x`` along its last dimension (see the module's docstring for the numerics).

    Returns a :class:`~scalestate.finegrained.FineQuantized` whose orientations
    hold packed ``torch.float4_e2m1fn_x2`` data, ``e_b`` as ``scale``
    (float32, the multipliers applied), ``s_b`` as ``scale_inv``
    (``float8_e4m3fn``), ``S_dec`` as ``tensor_scale_inv`` and a
    :class:`~scalestate.e2m1.Packing`; its ``amax`` is ``max|x|`` (NaN if any
    element is NaN).

    Args:
        x: the high-precision tensor (read in float32), at least 1-d (2-d for
            ``two_d`` or ``columnwise``).
        s_enc: the per-tensor scale ``S_enc`` (a 0-d float32 tensor); by
            default :func:`tensor_scale` of ``x``'s own amax.
        amax: ``max|x|`` if already known (it is not computed again).
        two_d: ``16 x 16`` blocks over the last two dimensions: ``x`` and
            ``x.t()`` quantize to the same values (the columnwise orientation
            is the same codes, transposed and packed along its own rows).
        columnwise: also quantize ``x.t()`` along its rows (its own
            ``1 x 16`` blocks), laid out contiguously.
        signs: with ``columnwise`` (``1 x 16`` blocks), transform ``x.t()``
            by :func:`hadamard16` with these 16 signs first; that orientation is
            then scaled from its own amax (``tensor_scale`` of the
            transformed tensor, whatever ``s_enc`` is).
        sr_key: a 0-d int64 key: round stochastically
            (:func:`~scalestate.e2m1.stochastic_round_e2m1`) with
            :func:`random_bits` of it (salt 0 for ``x``, 1 for ``x.t()``);
            ``None``: round to nearest even.
    """
    check_input(x, 2 if two_d else 1, columnwise, "quantize_nvfp4")
    if sr_key is not None and (not isinstance(sr_key, Tensor) or sr_key.dtype != torch.int64 or sr_key.dim() != 0):
        got = f"{sr_key.dtype}, shape {tuple(sr_key.shape)}" if isinstance(sr_key, Tensor) else type(sr_key).__name__
        raise CastError(f"quantize_nvfp4: sr_key must be a 0-d int64 tensor; got {got}")
    xf = x.float()
    if amax is None:
        amax = abs_max(xf)
    if s_enc is None:
        s_enc = tensor_scale(amax)
    if two_d:
        primary, codes = _blocks(xf, s_enc, sr_key)
        if not columnwise:
            return FineQuantized(primary, None, amax)
        codes_t = codes.t().contiguous()
        other = Orientation(
            pack_e2m1(codes_t), primary.scale.t(), primary.scale_inv.t(), primary.tile, primary.tensor_scale_inv,
            Packing(tuple(codes_t.shape)),
        )
        return FineQuantized(primary, other, amax)
    primary = _rows(xf, s_enc, sr_key, 0, hadamard=False)
    if not columnwise:
        return FineQuantized(primary, None, amax)
    xt = xf.t()
    if signs is None:
        other = _rows(xt, s_enc, sr_key, 1, hadamard=False)
    else:
        xt = hadamard16(xt, signs)
        other = _rows(xt, tensor_scale(abs_max(xt)), sr_key, 1, hadamard=True)
    return FineQuantized(primary, other, amax)


def _codes(v: Tensor, sr_key: Tensor | None, salt: int) -> Tensor:
    """The E2M1 codes of ``v``: rounded to nearest even, or stochastically with ``sr_key``'s bits."""
    if sr_key is None:
        return nearest_codes(v)
    return encode_e2m1(stochastic_round_e2m1(v, random_bits(sr_key, tuple(v.shape), salt)))


def _rows(xf: Tensor, s_enc: Tensor, sr_key: Tensor | None, salt: int, *, hadamard: bool) -> Orientation:
    """The orientation of ``1 x 16`` blocks along the last dim of float32 ``xf``."""
    *lead, k = xf.shape
    rows, nb = math.prod(lead), -(-k // NVFP4_BLOCK)
    x2 = xf.reshape(rows, k)
    if nb * NVFP4_BLOCK != k:
        x2 = F.pad(x2, (0, nb * NVFP4_BLOCK - k))
    blocks = x2.reshape(rows, nb, NVFP4_BLOCK)
    s_b, e_b = block_scales(blocks.abs().amax(dim=-1), s_enc)
    v = (blocks * e_b.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).reshape(rows, nb * NVFP4_BLOCK)[:, :k]
    codes = _codes(v.reshape(xf.shape), sr_key, salt)
    shape = (*lead, nb)
    return Orientation(
        pack_e2m1(codes), e_b.reshape(shape), s_b.reshape(shape), (1, NVFP4_BLOCK), torch.reciprocal(s_enc),
        Packing(tuple(xf.shape), False, hadamard),
    )


def _blocks(xf: Tensor, s_enc: Tensor, sr_key: Tensor | None) -> tuple[Orientation, Tensor]:
    """The orientation of ``16 x 16`` blocks over the last two dims of float32 ``xf``, and its codes."""
    *lead, m, k = xf.shape
    batch, mt, kt = math.prod(lead), -(-m // NVFP4_BLOCK), -(-k // NVFP4_BLOCK)
    w3 = xf.reshape(batch, m, k)
    if (mt * NVFP4_BLOCK, kt * NVFP4_BLOCK) != (m, k):
        w3 = F.pad(w3, (0, kt * NVFP4_BLOCK - k, 0, mt * NVFP4_BLOCK - m))
    tiles = w3.reshape(batch, mt, NVFP4_BLOCK, kt, NVFP4_BLOCK)
    s_b, e_b = block_scales(tiles.abs().amax(dim=(2, 4)), s_enc)
    v = (tiles * e_b[:, :, None, :, None]).clamp(-E2M1_MAX, E2M1_MAX)
    v = v.reshape(batch, mt * NVFP4_BLOCK, kt * NVFP4_BLOCK)[:, :m, :k]
    codes = _codes(v.reshape(xf.shape), sr_key, 0)
    shape = (*lead, mt, kt)
    tile = (NVFP4_BLOCK, NVFP4_BLOCK)
    primary = Orientation(
        pack_e2m1(codes), e_b.reshape(shape), s_b.reshape(shape), tile, torch.reciprocal(s_enc),
        Packing(tuple(xf.shape)),
    )
    return primary, codes
