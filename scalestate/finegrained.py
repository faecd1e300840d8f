"""Fine-grained FP8 scaling: one scale per row, per tile, per block, or per MX block.

Pure functions over tensors, bit-exact by construction: each is a fixed
number of tensor operations whatever the size (the input is padded with zeros
to a whole number of tiles, which never changes a max, then reshaped), and
none reads a value back to the host. They are the numerics of the
fine-grained recipes; no manager or recipe state is involved.

The granularities (``K`` is the last, contraction, dimension):

* :func:`quantize_rowwise`: one scale per row of ``K`` elements.
* :func:`quantize_tiles`: one scale per ``1 x block`` tile of a row
  (activations and gradients); ``ceil(K / block)`` scales per row.
* :func:`quantize_blocks`: one scale per ``block x block`` block of the last
  two dimensions (weights).
* :func:`quantize_mx`: MXFP8, one E8M0 power of two per 32 consecutive
  elements of a row.

The rules, per row, tile or block with amax ``a`` (the max of ``|x|`` over
it; NaN if it holds a NaN):

* scale (rows, tiles, blocks): exactly the per-tensor rule of
  :func:`scalestate.math.scale_from_amax` applied to ``a``: ``fp8_max / a``
  (a true float32 division), clamped to ``[smallest normal float32, largest
  float32]``, rounded down to a power of two when ``power_of_2`` (by clearing
  the mantissa bits); ``1`` where ``a`` is zero or not finite.
  ``scale_inv = torch.reciprocal(scale)`` in float32 (exact for powers of two).
* MX: see :func:`mx_exponent`; ``scale = 2**-e`` (float32) and
  ``scale_inv = 2**e`` as ``torch.float8_e8m0fnu``.
* data: ``x * scale`` in float32, saturated to ``[-fp8_max, fp8_max]``, cast
  to the float8 dtype by torch (round to nearest even); NaN stays NaN.

A last tile or block that is cut short by the tensor's edge is partial: its
amax is taken over the elements that exist. Data always has ``x``'s shape.

Each function returns a :class:`FineQuantized`: the
:class:`~scalestate.Quantized` record every cast makes (one
:class:`~scalestate.quantized.Orientation`, and a second for
``columnwise=True``), with the tensor's amax beside it. :func:`quantize`
dispatches on a :class:`~scalestate.granularity.Granularity`; reading tiled
data back (:func:`dequantize`, :func:`apply_tile_scales`) and the E8M0 ops
live in :mod:`scalestate.tiles` and are importable from here too.

Example:
    >>> import torch
    >>> from scalestate.finegrained import quantize_tiles
    >>> x = torch.tensor([[1.0, -3.0, 0.25, 100.0]])
    >>> q = quantize_tiles(x, torch.float8_e4m3fn, block=2)
    >>> q.scale
    tensor([[128.,   4.]])
    >>> q.dequantize()  # 100 * 4 = 400 is a tie between E4M3's 384 and 416: even wins
    tensor([[ 1.0000, -3.0000,  0.2500, 96.0000]])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from scalestate.errors import CastError
from scalestate.granularity import MX_BLOCK, NVFP4_KINDS, Granularity, GranularityKind
from scalestate.math import ScaleRule, is_usable_amax, scale_from_amax
from scalestate.quantized import FP8_MAX, Orientation, Quantized
from scalestate.tiles import (
    E8M0_BIAS,
    apply_tile_scales,
    dequantize,
    e8m0_encode,
    e8m0_from_exponent,
    e8m0_to_float32,
)

__all__ = [
    "MX_BLOCK",
    "FineQuantized",
    "Granularity",
    "GranularityKind",
    "apply_tile_scales",
    "check_input",
    "dequantize",
    "e8m0_from_exponent",
    "e8m0_to_float32",
    "mx_exponent",
    "quantize",
    "quantize_blocks",
    "quantize_mx",
    "quantize_rowwise",
    "quantize_tiles",
]

_MANTISSA_BITS = 0x007FFFFF
#: Every kind :func:`quantize` dispatches on (their string values compare equal); NVFP4 casts are
#: :func:`scalestate.nvfp4.quantize_nvfp4`.
_KINDS = frozenset(GranularityKind) - NVFP4_KINDS
#: The two scale rules of fine-grained casts, made once (``torch.compile`` cannot trace an attrs ``__init__``).
_RULES = {False: ScaleRule(), True: ScaleRule(power_of_2=True)}


class FineQuantized(Quantized):
    """The result of a fine-grained cast: a :class:`~scalestate.Quantized` and the tensor's amax.

    ``data ~= x * scale`` with each scale broadcast over its ``tile``, the
    ``(rows, columns)`` of ``data`` that one scale covers. When the cast was
    asked for ``columnwise=True``, the second orientation (``other``, also
    ``transposed`` or ``t_data``, with ``t_scale``, ``t_scale_inv`` and
    ``t_tile``) holds the quantization of ``x.t()`` laid out contiguously
    (shape ``x.t().shape``).
    """

    __slots__ = ("_amax",)

    _amax: Tensor

    def __init__(self, primary: Orientation, other: Orientation | None, amax: Tensor) -> None:
        self._fill(primary, other)
        object.__setattr__(self, "_amax", amax)

    @property
    def amax(self) -> Tensor:
        """0-d float32: max of ``|x|`` over the whole tensor (NaN if any element is NaN)."""
        return self._amax

    @property
    def t_data(self) -> Tensor | None:
        """Quantized ``x.t()``, contiguous, when asked for (``transposed``); else ``None``."""
        return self.transposed

    @property
    def quantized(self) -> Quantized:
        """The two orientations without the amax: what a backend's cast returns."""
        return Quantized.of(self.primary, self.other)

    def dequantize_t(self) -> Tensor:
        """``t_data * t_scale_inv`` in float32 (``~= x.t()``)."""
        if self.other is None:
            raise CastError("this cast holds no columnwise data; quantize with columnwise=True")
        return self.other.dequantize()


def quantize(x: Tensor, dtype: torch.dtype, granularity: Granularity, *, columnwise: bool = False) -> FineQuantized:
    """The fine-grained cast ``granularity`` names (see :class:`~scalestate.granularity.Granularity`)."""
    kind, block, power_of_2 = granularity
    if kind in NVFP4_KINDS:
        raise CastError("NVFP4 casts take per-tensor and per-block scales: use scalestate.nvfp4.quantize_nvfp4")
    if kind not in _KINDS:
        kinds = ", ".join(f"GranularityKind.{k.name}" for k in GranularityKind if k not in NVFP4_KINDS)
        raise CastError(f"unknown granularity kind {kind!r}; expected one of {kinds}")
    if kind == GranularityKind.ROW:
        return quantize_rowwise(x, dtype, power_of_2=power_of_2, columnwise=columnwise)
    if kind == GranularityKind.TILE:
        return quantize_tiles(x, dtype, block=block, power_of_2=power_of_2, columnwise=columnwise)
    if kind == GranularityKind.BLOCK:
        return quantize_blocks(x, dtype, block=block, power_of_2=power_of_2, columnwise=columnwise)
    return quantize_mx(x, dtype, block=block, columnwise=columnwise)


def quantize_rowwise(
    x: Tensor, dtype: torch.dtype, *, power_of_2: bool = False, columnwise: bool = False
) -> FineQuantized:
    """One scale per row of the last dimension: ``scale`` has shape ``(..., 1)``.

    Args:
        x: the high-precision tensor (read in float32), at least 1-d; 2-d when ``columnwise``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        power_of_2: round each scale down to a power of two.
        columnwise: also quantize ``x.t()`` row-wise (one scale per column of ``x``).
    """
    fp8_max = _fp8_max(dtype)
    check_input(x, 1, columnwise, "quantize_rowwise")
    rule = _RULES[power_of_2]
    row, amax = _lastdim(x, fp8_max, dtype, rule, block=max(x.shape[-1], 1), n_tiles=1, tile=(1, x.shape[-1]))
    if not columnwise:
        return FineQuantized(row, None, amax)
    col, _ = _lastdim(x.t(), fp8_max, dtype, rule, block=max(x.shape[0], 1), n_tiles=1, tile=(1, x.shape[0]))
    return FineQuantized(row, col, amax)


def quantize_tiles(
    x: Tensor, dtype: torch.dtype, *, block: int = 128, power_of_2: bool = True, columnwise: bool = False
) -> FineQuantized:
    """One scale per ``1 x block`` tile of the last dimension: ``scale`` is ``(..., ceil(K / block))``.

    Args:
        x: the high-precision tensor (read in float32), at least 1-d; 2-d when ``columnwise``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: elements per tile (the last tile of a row may be shorter).
        power_of_2: round each scale down to a power of two.
        columnwise: also quantize ``x.t()`` in ``1 x block`` tiles (``block x 1`` tiles of ``x``).
    """
    fp8_max = _fp8_max(dtype)
    check_input(x, 1, columnwise, "quantize_tiles")
    _check_block(block)
    rule = _RULES[power_of_2]
    row, amax = _lastdim(x, fp8_max, dtype, rule, block=block, n_tiles=-(-x.shape[-1] // block), tile=(1, block))
    if not columnwise:
        return FineQuantized(row, None, amax)
    col, _ = _lastdim(x.t(), fp8_max, dtype, rule, block=block, n_tiles=-(-x.shape[0] // block), tile=(1, block))
    return FineQuantized(row, col, amax)


def quantize_blocks(
    w: Tensor, dtype: torch.dtype, *, block: int = 128, power_of_2: bool = True, columnwise: bool = False
) -> FineQuantized:
    """One scale per ``block x block`` block of the last two dimensions.

    ``scale`` has shape ``(..., ceil(M / block), ceil(K / block))``. One set of
    scales serves both orientations: the columnwise data is ``data.t()`` laid
    out contiguously, which is bitwise the quantization of ``w.t()`` with the
    transposed scale grid ``scale.t()``.

    Args:
        w: the high-precision tensor (read in float32), at least 2-d; 2-d when ``columnwise``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: rows and columns per block (blocks at the edges may be smaller).
        power_of_2: round each scale down to a power of two.
        columnwise: also return the contiguous transpose of the data.
    """
    fp8_max = _fp8_max(dtype)
    check_input(w, 2, columnwise, "quantize_blocks")
    _check_block(block)
    *lead, m, k = w.shape
    mt, kt = -(-m // block), -(-k // block)
    batch = math.prod(lead)
    w3 = _padded(w.reshape(batch, m, k), (mt * block, kt * block))
    tiles = w3.view(batch, mt, block, kt, block)
    tile_amax = tiles.abs().amax(dim=(2, 4))
    scale = scale_from_amax(tile_amax, fp8_max, _RULES[power_of_2])
    scaled = (tiles * scale[:, :, None, :, None]).view(w3.shape)[:, :m, :k]
    data = _saturate(scaled, fp8_max, dtype).reshape(w.shape)
    scale = scale.reshape(*lead, mt, kt)
    rows = Orientation(data, scale, torch.reciprocal(scale), (block, block))
    amax = _total_amax(tile_amax)
    if not columnwise:
        return FineQuantized(rows, None, amax)
    columns = Orientation(data.t().contiguous(), rows.scale.t(), rows.scale_inv.t(), (block, block))
    return FineQuantized(rows, columns, amax)


def quantize_mx(
    x: Tensor, dtype: torch.dtype, *, block: int = MX_BLOCK, columnwise: bool = False
) -> FineQuantized:
    """MXFP8: one E8M0 power of two per ``block`` (32) consecutive elements of the last dimension.

    ``scale_inv`` is the ``torch.float8_e8m0fnu`` tensor ``2**e`` with ``e``
    from :func:`mx_exponent`, shape ``(..., ceil(K / block))``; ``scale`` is
    the float32 ``2**-e`` the data was multiplied by. A last block cut short
    by the row's end is partial (the OCP format itself wants ``K`` a multiple
    of 32; a GEMM kernel will).

    Args:
        x: the high-precision tensor (read in float32), at least 1-d; 2-d when ``columnwise``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        block: elements per scale (32 in MXFP8).
        columnwise: also quantize ``x.t()`` (blocks of 32 down the columns of ``x``).
    """
    fp8_max = _fp8_max(dtype)
    check_input(x, 1, columnwise, "quantize_mx")
    _check_block(block)
    row, amax = _lastdim(x, fp8_max, dtype, None, block=block, n_tiles=-(-x.shape[-1] // block), tile=(1, block))
    if not columnwise:
        return FineQuantized(row, None, amax)
    col, _ = _lastdim(x.t(), fp8_max, dtype, None, block=block, n_tiles=-(-x.shape[0] // block), tile=(1, block))
    return FineQuantized(row, col, amax)


def mx_exponent(amax: Tensor, fp8_max: float) -> Tensor:
    """The MX block exponent ``e = ceil(log2(amax / fp8_max))``, exactly, as int32.

    Rounding up (NVIDIA's MXFP8 pre-training recipe) rather than the OCP
    spec's ``floor(log2(amax)) - emax`` guarantees ``amax * 2**-e <= fp8_max``:
    no element of the block saturates.

    Computed on the float32 bits, not with a float ``log2`` (which rounds near
    powers of two): with ``amax = ma * 2**ea`` and ``fp8_max = mf * 2**ef``
    (``ma, mf`` in ``[1, 2)``), ``e = ea - ef + (ma > mf)``.

    ``e`` is clamped to ``[-127, 127]``, E8M0's range (biased bytes 0..254;
    255 is NaN); ``2**-e`` is then a float32 (``2**-127`` a subnormal one).
    Only the lower bound can bind for float32 inputs (amaxes below about
    ``fp8_max * 2**-127``; the clamp only makes the scale smaller than the
    exact one, so nothing saturates); the upper one cannot (``e <= 120`` for
    E4M3). A subnormal amax needs no normalization: the true ``e`` is below
    ``-126 - ef <= -127``, and its bits (exponent field 0) give
    ``e <= -127 - ef + 1 <= -127`` too, so both clamp to -127 whenever
    ``fp8_max >= 2``. ``e = 0`` where ``amax`` is zero or not finite.

    Args:
        amax: float32 block amaxes (any shape).
        fp8_max: the format's largest value, a normal float32 ``>= 2`` (448 or 57344).
    """
    usable = is_usable_amax(amax)
    bits = torch.where(usable, amax.float(), 1.0).view(torch.int32)
    exponent = torch.bitwise_right_shift(bits, 23) - 127
    f_mantissa, f_exponent = math.frexp(fp8_max)  # fp8_max = (2 * f_mantissa) * 2**(f_exponent - 1)
    f_bits = round((2 * f_mantissa - 1) * 2**23)
    above = torch.bitwise_and(bits, _MANTISSA_BITS) > f_bits
    e = exponent - (f_exponent - 1) + above.int()
    return torch.where(usable, e.clamp(-E8M0_BIAS, E8M0_BIAS), 0).int()


def _lastdim(
    x: Tensor, fp8_max: float, dtype: torch.dtype, rule: ScaleRule | None, *, block: int, n_tiles: int,
    tile: tuple[int, int],
) -> tuple[Orientation, Tensor]:
    """The orientation with one scale per ``block`` elements of the last dim (``tile``), and the amax.

    ``rule`` is ``None`` for MX (power-of-two E8M0 factors).
    """
    *lead, k = x.shape
    rows = math.prod(lead)
    x2 = _padded(x.reshape(rows, k), (n_tiles * block,))
    tiles = x2.view(rows, n_tiles, block)
    tile_amax = tiles.abs().amax(dim=-1)
    if rule is None:
        e = mx_exponent(tile_amax, fp8_max)
        scale = _pow2(-e)
        scale_inv = e8m0_encode(e)
    else:
        scale = scale_from_amax(tile_amax, fp8_max, rule)
        scale_inv = torch.reciprocal(scale)
    scaled = (tiles * scale.unsqueeze(-1)).view(x2.shape)[:, :k]
    data = _saturate(scaled, fp8_max, dtype).reshape(x.shape)
    shape = (*lead, n_tiles)
    return Orientation(data, scale.reshape(shape), scale_inv.reshape(shape), tile), _total_amax(tile_amax)


def _pow2(n: Tensor) -> Tensor:
    """``2**n`` as float32 for int32 ``n`` in ``[-127, 127]``, exactly, from the exponent bits."""
    normal = torch.bitwise_left_shift(n + 127, 23).view(torch.float32)
    return torch.where(n > -127, normal, 2.0**-127)


def _padded(x: Tensor, size: tuple[int, ...]) -> Tensor:
    """``x`` in float32, zero-padded at the end of its last ``len(size)`` dims to ``size``."""
    xf = x.float()
    pad: list[int] = []
    for dim, target in zip(range(-1, -len(size) - 1, -1), reversed(size), strict=True):
        pad += [0, target - xf.shape[dim]]
    return F.pad(xf, pad) if any(pad) else xf.contiguous()


def _saturate(scaled: Tensor, fp8_max: float, dtype: torch.dtype) -> Tensor:
    """Clamp to ``[-fp8_max, fp8_max]`` (NaN stays NaN) and round to ``dtype``, contiguous."""
    return scaled.clamp(-fp8_max, fp8_max).to(dtype).contiguous()


def _total_amax(tile_amax: Tensor) -> Tensor:
    """The max over all tiles, 0-d float32, NaN propagating; 0 for an empty tensor."""
    return tile_amax.amax() if tile_amax.numel() else tile_amax.new_zeros(())


def _fp8_max(dtype: torch.dtype) -> float:
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise CastError(
            f"fine-grained casts need torch.float8_e4m3fn or torch.float8_e5m2; got {dtype}"
        ) from None


def check_input(x: Tensor, min_dim: int, columnwise: bool, name: str) -> None:
    """The shapes a fine-grained cast named ``name`` takes (raises :class:`~scalestate.errors.CastError`)."""
    if not x.is_floating_point():
        raise CastError(f"{name} needs a floating-point tensor; got {x.dtype}")
    if x.dim() < min_dim:
        raise CastError(f"{name} needs a tensor of at least {min_dim} dimension(s); got shape {tuple(x.shape)}")
    if columnwise and x.dim() != 2:
        raise CastError(
            f"{name}(columnwise=True) needs a 2-d tensor; got shape {tuple(x.shape)}; "
            "flatten the leading dimensions first: x.reshape(-1, x.shape[-1])"
        )


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise CastError(f"block must be an int >= 1; got {block!r}")
