"""Per-tile scale factors: spreading one factor over its tile, and E8M0 factors in and out.

What a fine-grained :class:`~scalestate.Quantized` needs to be read back
(:func:`dequantize`, :func:`apply_tile_scales`), and the E8M0 encoding of MX
scales (:func:`e8m0_from_exponent`, :func:`e8m0_to_float32`). Below
:mod:`scalestate.quantized` and :mod:`scalestate.finegrained`, which both use
it; pure functions, exact, with no host read.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E8M0_BIAS",
    "apply_tile_scales",
    "dequantize",
    "e8m0_decode",
    "e8m0_encode",
    "e8m0_from_exponent",
    "e8m0_to_float32",
]

#: E8M0 encodes ``2**e`` for ``e`` in ``[-127, 127]`` as the byte ``e + 127``; 255 is NaN.
E8M0_BIAS = 127


def dequantize(data: Tensor, scale_inv: Tensor, tile: tuple[int, int]) -> Tensor:
    """``data * scale_inv`` in float32, each factor repeated over its ``tile``.

    Args:
        data: FP8 values of shape ``(..., M, K)`` (or ``(K,)`` for 1-row tiles).
        scale_inv: one factor per tile, shape ``(..., ceil(M / rows), ceil(K / columns))``;
            float32 or E8M0 (converted to float32 exactly).
        tile: ``(rows, columns)`` of ``data`` covered by one factor; partial
            tiles at the edges take their factor like whole ones.
    """
    return apply_tile_scales(data.float(), scale_inv, tile)


def apply_tile_scales(values: Tensor, scale_inv: Tensor, tile: tuple[int, int]) -> Tensor:
    """:func:`dequantize` of FP8 data already converted to float32 (``values``), exactly."""
    rows, cols = tile
    s = e8m0_decode(scale_inv) if scale_inv.dtype == torch.float8_e8m0fnu else scale_inv.float()
    if values.dim() >= 2 and values.numel() and values.shape[-2] % rows == 0 and values.shape[-1] % cols == 0:
        # Whole tiles: broadcast each factor over a tile view (no repeated copy of the scales).
        *lead, m, k = values.shape
        tiles = values.reshape(*lead, m // rows, rows, k // cols, cols)
        return (tiles * s[..., :, None, :, None]).reshape(values.shape)
    if cols > 1:
        s = s.repeat_interleave(cols, dim=-1)[..., : values.shape[-1]]
    if rows > 1:
        s = s.repeat_interleave(rows, dim=-2)[..., : values.shape[-2], :]
    return values * s


# E8M0 in and out as custom ops: torch.compile's CPU code generator has no E8M0 type,
# so these stay opaque calls (eager kernels) inside compiled graphs.
@torch.library.custom_op("scalestate::e8m0_from_exponent", mutates_args=())
def e8m0_from_exponent(e: Tensor) -> Tensor:
    """The E8M0 encoding of ``2**e`` for int32 ``e`` in ``[-127, 127]`` (the biased byte ``e + 127``)."""
    return (e + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu).clone()


@e8m0_from_exponent.register_fake
def _(e: Tensor) -> Tensor:
    return torch.empty_like(e, dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("scalestate::e8m0_to_float32", mutates_args=())
def e8m0_to_float32(s: Tensor) -> Tensor:
    """E8M0 values as float32, exactly (``2**e``; the byte 255 is NaN)."""
    return s.float()


@e8m0_to_float32.register_fake
def _(s: Tensor) -> Tensor:
    return torch.empty_like(s, dtype=torch.float32)


def e8m0_encode(e: Tensor) -> Tensor:
    """:func:`e8m0_from_exponent`, called as an op only while compiling (a custom op costs
    tens of microseconds of dispatch in eager code)."""
    if torch.compiler.is_compiling():
        encoded: Tensor = e8m0_from_exponent(e)
        return encoded
    return (e + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_decode(s: Tensor) -> Tensor:
    """:func:`e8m0_to_float32`, called as an op only while compiling."""
    if torch.compiler.is_compiling():
        decoded: Tensor = e8m0_to_float32(s)
        return decoded
    return s.float()
