"""E2M1, the 4-bit float of NVFP4: rounding onto its grid, codes, and packing two per byte.

Below :mod:`scalestate.quantized` (which reads packed data back) and
:mod:`scalestate.nvfp4` (which casts); pure functions, exact, no host read.
The grid is {0, 0.5, 1, 1.5, 2, 3, 4, 6} and its negatives; code ``c`` (0..7)
is ``E2M1_VALUES[c]``, code ``c + 8`` its negative (8 is ``-0``).

Example:
    >>> import torch
    >>> from scalestate.e2m1 import round_e2m1
    >>> round_e2m1(torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, -1.75]))
    tensor([ 0.,  1.,  1.,  2.,  4., -2.])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "Packing",
    "block_multipliers",
    "decode_e2m1",
    "encode_e2m1",
    "nearest_codes",
    "pack_e2m1",
    "round_e2m1",
    "stochastic_round_e2m1",
    "unpack_e2m1",
]

#: The largest E2M1 value.
E2M1_MAX = 6.0
#: The non-negative E2M1 values, by code (0..7); codes 8..15 are their negatives (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Packing(NamedTuple):
    """How an NVFP4 orientation's packed data is laid out: no tensors.

    ``data`` holds the E2M1 codes of ``shape`` (its last dimension packed two
    per byte, padded with one zero code when odd); scales and tile are those
    of these stored values. ``transposed``: the orientation means the
    transpose of the stored values (a view, as :meth:`Quantized.t` makes one).
    ``hadamard``: the values were Hadamard-transformed along the stored last
    dimension (in chunks of 16) before they were quantized.
    """

    #: Logical shape of the stored values (the last dimension unpacked).
    shape: tuple[int, ...]
    #: The orientation is the transpose of the stored values.
    transposed: bool = False
    #: The stored values were transformed by :func:`hadamard16` before quantization.
    hadamard: bool = False


def _spacing(a: Tensor) -> Tensor:
    """The E2M1 grid's spacing at magnitudes ``a`` in ``[0, 6]``: 0.5 below 2, 1 below 4, else 2."""
    return torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))


def round_e2m1(v: Tensor) -> Tensor:
    """Round float32 ``v`` (in ``[-6, 6]``) to the nearest E2M1 value, ties to the even code, sign kept.

    ``torch.round`` (half to even) of ``|v| / spacing`` is exactly E2M1's
    ties-to-even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4. NaN stays NaN.
    """
    a = v.abs()
    g = _spacing(a)
    return torch.copysign(torch.round(a / g) * g, v)


def stochastic_round_e2m1(v: Tensor, bits: Tensor) -> Tensor:
    """Round ``v`` (in ``[-6, 6]``) up in magnitude with probability proportional to proximity.

    With ``lo <= |v| < lo + g`` the grid points around ``|v|``, the result is
    ``lo + g`` when ``bits * 2**-24 < (|v| - lo) / g`` (both exact in float32),
    else ``lo``: unbiased up to ``2**-24`` of a step. ``bits``: 24 random bits
    per element (:func:`random_bits`). NaN stays NaN.
    """
    a = v.abs()
    g = _spacing(a)
    lo = torch.floor(a / g) * g
    up = bits.float() * 2.0**-24 < (a - lo) / g
    return torch.copysign(torch.where(up, lo + g, lo), v)


def encode_e2m1(q: Tensor) -> Tensor:
    """The uint8 codes (0..15) of E2M1 values ``q``: sign in bit 3 (``-0`` is 8); NaN becomes code 0."""
    a = q.abs()
    magnitude = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0))
    magnitude = torch.nan_to_num(magnitude, nan=0.0).to(torch.uint8)
    sign = torch.where(torch.signbit(q) & ~torch.isnan(q), 8, 0).to(torch.uint8)
    return magnitude | sign


#: The magnitudes above which round-to-nearest-even gives each next code: the midpoints of the
#: grid, those whose tie goes up (0.75, 1.75, 3.5) lowered by one float32 ulp, so that the
#: count of boundaries strictly below ``|v|`` is the code.
_BOUNDARIES = (0.25, 0.74999994, 1.25, 1.7499999, 2.5, 3.4999998, 5.0)
#: Every code's value (codes 8..15: the negatives).
_TABLE = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))
#: Those constants per device, made once (a copy to a GPU per cast would cost a transfer, and
#: could not be captured in a CUDA graph); compiled code makes them inline.
_constants: dict[tuple[tuple[float, ...], torch.device], Tensor] = {}


def _constant(values: tuple[float, ...], device: torch.device) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    known = _constants.get((values, device))
    if known is None:
        known = _constants[(values, device)] = torch.tensor(values, dtype=torch.float32, device=device)
    return known


def nearest_codes(v: Tensor) -> Tensor:
    """``encode_e2m1(round_e2m1(v))`` in a few operations (a search of the grid's midpoints).

    ``v`` in ``[-6, 6]``; NaN becomes code 0, ``-0`` code 8.
    """
    w = torch.nan_to_num(v, nan=0.0)
    magnitude = torch.bucketize(w.abs().contiguous(), _constant(_BOUNDARIES, v.device)).to(torch.uint8)
    return magnitude | (torch.signbit(w).to(torch.uint8) << 3)


def decode_e2m1(codes: Tensor) -> Tensor:
    """float32 values of uint8 E2M1 codes (0..15)."""
    return _constant(_TABLE, codes.device)[codes.long()]


def block_multipliers(s_b: Tensor, s_dec: Tensor) -> Tensor:
    """NVFP4's multipliers ``e_b = min(1 / (s_b * S_dec), float32 max)`` of E4M3 block scales ``s_b``
    under the per-tensor ``S_dec``: what a cast applies, and what a saved cast derives again."""
    return torch.div(1.0, s_b.float() * s_dec).clamp(max=torch.finfo(torch.float32).max)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Codes ``(..., K)`` packed two per byte as ``torch.float4_e2m1fn_x2`` ``(..., ceil(K / 2))``.

    Element ``2j`` is the low nibble of byte ``j``, element ``2j + 1`` the high one (an odd ``K`` pads a zero).
    """
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return _as_fp4(packed.contiguous())


def unpack_e2m1(data: Tensor, columns: int) -> Tensor:
    """The uint8 codes of packed ``data`` (``float4_e2m1fn_x2``), ``(..., columns)``."""
    packed = _as_bytes(data)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return codes[..., :columns]


# float4 in and out as custom ops while compiling: torch.compile's code generators have no
# float4 type, so these stay opaque calls inside compiled graphs (eager code views directly).
@torch.library.custom_op("scalestate::bytes_as_fp4", mutates_args=())
def _bytes_as_fp4(b: Tensor) -> Tensor:
    return b.view(torch.float4_e2m1fn_x2).clone()


@_bytes_as_fp4.register_fake
def _(b: Tensor) -> Tensor:
    return torch.empty_like(b, dtype=torch.float4_e2m1fn_x2)


@torch.library.custom_op("scalestate::fp4_as_bytes", mutates_args=())
def _fp4_as_bytes(d: Tensor) -> Tensor:
    return d.view(torch.uint8).clone()


@_fp4_as_bytes.register_fake
def _(d: Tensor) -> Tensor:
    return torch.empty_like(d, dtype=torch.uint8)


def _as_fp4(b: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        out: Tensor = _bytes_as_fp4(b)
        return out
    return b.view(torch.float4_e2m1fn_x2)


def _as_bytes(d: Tensor) -> Tensor:
    if d.dtype == torch.uint8:
        return d
    if torch.compiler.is_compiling():
        out: Tensor = _fp4_as_bytes(d.contiguous())
        return out
    return d.contiguous().view(torch.uint8)


