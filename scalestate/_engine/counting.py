"""Cast statistics on the hot path: what one recorded cast did to its elements.

Only with ``ScalingStateManager(..., collect_stats=True)``; the manager sums
these per slot over a step's recorded casts, and
:meth:`~scalestate.ScalingStateManager.stats` turns the sums into the
fractions of :mod:`scalestate.diagnostics`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.diagnostics import COUNT_FIELDS
from scalestate.e2m1 import E2M1_MAX
from scalestate.math import FLOAT32_MAX
from scalestate.nvfp4 import NVFP4_BLOCK, hadamard16
from scalestate.quantized import Orientation, Quantized
from scalestate.tiles import apply_tile_scales

__all__ = ["COUNT_FIELDS", "cast_counts"]

#: FP8 codes with every bit but the sign clear are +0 and -0 (E4M3FN and E5M2 alike).
_MAGNITUDE_BITS = 0x7F


def cast_counts(x: Tensor, q: Quantized, fp8_max: float, signs: Tensor | None = None) -> tuple[int, Tensor]:
    """What one cast did to its elements: ``(elements, counts)``, counted on the device.

    ``counts`` is an int64 ``[3]`` tensor: ``saturated``, ``nonzero_inputs``
    and ``nonzero_codes`` of :data:`COUNT_FIELDS` (``elements`` is known on
    the host). Per element of ``x`` cast with the scale ``s`` of its tile (the
    one per-tensor scale, or the scale of its row, tile, block or MX block):

    * saturated: ``|x * s| > fp8_max``, computed as the cast computes it, so
      exactly the elements the cast clipped (``+-inf`` included; NaN is not);
    * non-zero input: ``x != 0`` (NaN included);
    * non-zero code: the FP8 result is neither ``+0`` nor ``-0``. A zero
      input always gives a zero code, so ``nonzero_inputs - nonzero_codes``
      elements were non-zero and flushed to zero by the cast.

    Where the cast made a second quantization of ``x.t()`` with scales of its
    own (row-wise, tiles, MX with ``transpose=True``), its elements count too;
    a transposed copy of the same values (per-tensor scales, square blocks)
    does not count twice. No host-device sync.

    NVFP4 (packed orientations): per element scaled by the multiplier ``e_b``
    of its block, saturated means ``|x * e_b| > 6`` in a block whose E4M3
    scale is not zero, and a non-zero code one whose value ``q * s_b * S_dec``
    is not zero (a block scale that flushed to zero flushes its block). A
    Hadamard-transformed orientation counts the transformed values
    (``signs``: the transform's, which the manager passes).
    """
    xf = x.detach().float()
    primary, other = q.primary, q.other
    if primary.packing is not None:
        return _nvfp4_counts(xf, primary, other, signs)
    n, counts = _orientation(xf, primary, fp8_max)
    if other is not None and primary.tile is not None and primary.tile[0] == 1 and other.tile is not None:
        n_t, counts_t = _orientation(xf.t(), other, fp8_max)
        n, counts = n + n_t, counts + counts_t
    return n, counts


def _orientation(xf: Tensor, o: Orientation, fp8_max: float) -> tuple[int, Tensor]:
    scaled = xf * o.scale if o.tile is None else apply_tile_scales(xf, o.scale, o.tile)  # a fresh tensor
    saturated = torch.count_nonzero(scaled.abs_() > fp8_max)
    nonzero_inputs = torch.count_nonzero(xf)
    nonzero_codes = torch.count_nonzero(torch.bitwise_and(o.data.view(torch.uint8), _MAGNITUDE_BITS))
    return xf.numel(), torch.stack([saturated, nonzero_inputs, nonzero_codes])


def _nvfp4_counts(
    xf: Tensor, primary: Orientation, other: Orientation | None, signs: Tensor | None
) -> tuple[int, Tensor]:
    n, counts = _packed(xf, primary)
    if other is None or primary.tile != (1, NVFP4_BLOCK):  # 16 x 16 blocks: the same values, counted once
        return n, counts
    assert other.packing is not None
    xt = xf.t()
    if other.packing.hadamard:
        assert signs is not None, "a Hadamard-transformed cast is counted with the transform's signs"
        xt = hadamard16(xt, signs)
    n_t, counts_t = _packed(xt, other)
    return n + n_t, counts + counts_t


def _packed(xf: Tensor, o: Orientation) -> tuple[int, Tensor]:
    """An NVFP4 orientation's counts. A block whose E4M3 scale flushed to zero (its multiplier is then
    the float32 max) flushes every element: they count as flushed, not as saturated."""
    assert o.tile is not None
    multiplier = apply_tile_scales(torch.ones_like(xf), o.scale, o.tile)
    saturated = torch.count_nonzero(((xf * multiplier).abs_() > E2M1_MAX) & (multiplier < FLOAT32_MAX))
    nonzero_inputs = torch.count_nonzero(xf)
    nonzero_values = torch.count_nonzero(o.dequantize())
    return xf.numel(), torch.stack([saturated, nonzero_inputs, nonzero_values])
