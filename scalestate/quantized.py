"""`Quantized`: FP8 data that carries the scale it was cast with."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import Tensor

from scalestate.errors import CastError, ReadOnlyError
from scalestate.finegrained import dequantize as fine_dequantize

__all__ = ["FP8_DTYPES", "Quantized"]

#: The float8 dtypes a ``Quantized`` may hold.
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


class Quantized:
    """An FP8 tensor with the exact scale it was cast with, and its inverse.

    ``data`` holds ``x * scale`` rounded to FP8, so ``data * scale_inv`` is the
    value that was cast. The scale travels with the data: a later change of the
    slot's scale can never be applied to data cast with an earlier one.

    ``scale`` is the very multiplier of the cast (an adapter that needs it must
    not compute ``1 / scale_inv``, which differs from ``scale`` for about one
    float32 in six); ``scale_inv`` is ``torch.reciprocal(scale)``. Per-tensor
    recipes give 0-d float32 scales (``tile`` is ``None``). Fine-grained
    recipes give one scale per tile of ``data``: ``tile = (rows, columns)``
    is the part of ``data`` one scale covers (``(1, K)`` row-wise, ``(1, 128)``
    tiles, ``(128, 128)`` blocks, ``(1, 32)`` MX), ``scale`` has shape
    ``(..., ceil(M / rows), ceil(K / columns))`` and, for MX, ``scale_inv`` is
    ``torch.float8_e8m0fnu``.

    ``transposed``, when present, is ``x.t()`` cast along its own rows and
    laid out contiguously, made in the same call as ``data`` for the GEMMs
    that contract over the other axis. With per-tensor scales (and
    ``block x block`` blocks) it holds the values of ``data.t()``; with rows,
    tiles or MX blocks it is a second quantization with its own ``t_scale``,
    ``t_scale_inv`` and ``t_tile``.

    A plain object of tensors, read-only, which ``torch.compile`` traces.

    Args:
        data: the FP8 values (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        scale: (keyword) the multiplier that was applied before rounding; derived as
            ``1 / scale_inv`` when not given.
        scale_inv: the dequantization factor; ``torch.reciprocal(scale)`` when not given.
        transposed: optional contiguous quantization of ``x.t()`` (2-d data only).
        tile: the ``(rows, columns)`` one scale covers; ``None``: one scale (0-d).
        t_scale: the ``scale`` of ``transposed``; default: ``scale`` transposed
            (right for per-tensor scales and square blocks).
        t_scale_inv: the ``scale_inv`` of ``transposed``; default: ``scale_inv``
            transposed.
        t_tile: the ``tile`` of ``transposed``; default: ``tile`` transposed.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> h = m.register("fc", roles=(ss.Role.INPUT,))
        >>> q = h.quantize(torch.tensor([1.0, -2.0, 0.5]), ss.Role.INPUT)
        >>> q.data.dtype, q.scale, q.dequantize()
        (torch.float8_e4m3fn, tensor(224.), tensor([ 1.0000, -2.0000,  0.5000]))
    """

    __slots__ = ("data", "scale", "scale_inv", "t_scale", "t_scale_inv", "t_tile", "tile", "transposed")

    #: The FP8 values.
    data: Tensor
    #: float32: the multiplier applied before rounding (``data ~= x * scale``).
    scale: Tensor
    #: float32: multiply ``data`` by it to get back the cast values.
    scale_inv: Tensor
    #: ``x.t()`` quantized along its rows, contiguous, if the cast made it; else ``None``.
    transposed: Tensor | None
    #: ``(rows, columns)`` of ``data`` one scale covers; ``None`` for one 0-d scale.
    tile: tuple[int, int] | None
    #: Scales of ``transposed`` (``scale`` itself, or transposed, where they are shared).
    t_scale: Tensor
    #: Dequantization factors of ``transposed``.
    t_scale_inv: Tensor
    #: Tile of ``transposed``.
    t_tile: tuple[int, int] | None

    def __init__(
        self,
        data: Tensor,
        *,
        scale: Tensor | None = None,
        scale_inv: Tensor | None = None,
        transposed: Tensor | None = None,
        tile: tuple[int, int] | None = None,
        t_scale: Tensor | None = None,
        t_scale_inv: Tensor | None = None,
        t_tile: tuple[int, int] | None = None,
    ) -> None:
        if data.dtype not in FP8_DTYPES:
            raise CastError(
                f"Quantized data must be torch.float8_e4m3fn or torch.float8_e5m2; got {data.dtype}"
            )
        if scale is None:
            if scale_inv is None:
                raise CastError("Quantized needs scale or scale_inv (or both); got neither")
            scale = torch.reciprocal(scale_inv)
        elif scale_inv is None:
            scale_inv = torch.reciprocal(scale)
        set_ = object.__setattr__
        set_(self, "data", data)
        set_(self, "scale", scale)
        set_(self, "scale_inv", scale_inv)
        set_(self, "transposed", transposed)
        set_(self, "tile", tile)
        set_(self, "t_scale", _t(scale) if t_scale is None else t_scale)
        set_(self, "t_scale_inv", _t(scale_inv) if t_scale_inv is None else t_scale_inv)
        set_(self, "t_tile", _swap(tile) if t_tile is None else t_tile)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise ReadOnlyError(f"Quantized is read-only; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise ReadOnlyError(f"Quantized is read-only; cannot delete {name!r}")

    @property
    def shape(self) -> torch.Size:
        """Shape of ``data``."""
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """FP8 dtype of ``data``."""
        return self.data.dtype

    def t(self) -> Quantized:
        """The quantization of ``x.t()``, with no copy.

        Where the cast made ``transposed``, the two orientations swap places
        (``data`` becomes ``transposed`` and back, scales and tiles with them).
        Otherwise its ``data`` is the view ``data.t()``, with the scales and
        the tile transposed: the same values, scaled along the first dimension.
        """
        if self.data.dim() != 2:
            raise CastError(f"Quantized.t() needs 2-d data; got shape {tuple(self.data.shape)}")
        if self.transposed is not None:
            return Quantized(
                self.transposed, scale=self.t_scale, scale_inv=self.t_scale_inv, transposed=self.data,
                tile=self.t_tile, t_scale=self.scale, t_scale_inv=self.scale_inv, t_tile=self.tile,
            )
        return Quantized(self.data.t(), scale=_t(self.scale), scale_inv=_t(self.scale_inv), tile=_swap(self.tile))

    def rowwise(self) -> Quantized:
        """Only the orientation of ``data`` (scaled along its last dimension where tiled)."""
        if self.transposed is None:
            return self
        return Quantized(self.data, scale=self.scale, scale_inv=self.scale_inv, tile=self.tile)

    def columnwise(self) -> Quantized:
        """Only the quantization of ``x.t()`` (``transposed``), as a ``Quantized`` of its own.

        Without ``transposed``, the view :meth:`t` where one set of scales
        serves both orientations (per-tensor scales, square blocks).
        """
        if self.transposed is not None:
            return Quantized(self.transposed, scale=self.t_scale, scale_inv=self.t_scale_inv, tile=self.t_tile)
        if self.tile is not None and self.tile[0] != self.tile[1]:
            raise CastError(
                f"this Quantized is scaled in {self.tile[0]} x {self.tile[1]} tiles and holds no "
                "columnwise quantization; cast with transpose=True"
            )
        return self.t()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale_inv`` in ``dtype`` (computed in float32), each factor spread over its tile:
        the orientation scaled along the last dimension."""
        if self.tile is None:
            return (self.data.float() * self.scale_inv).to(dtype)
        return fine_dequantize(self.data, self.scale_inv, self.tile).to(dtype)

    def __repr__(self) -> str:
        scale = f"{self.scale.item():g}" if self.scale.numel() == 1 else f"shape {tuple(self.scale.shape)}"
        extra = ", transposed" if self.transposed is not None else ""
        tile = "" if self.tile is None else f", tile={self.tile}"
        return f"<Quantized({tuple(self.data.shape)}, {self.data.dtype}, scale={scale}{tile}{extra})>"


def _t(scale: Tensor) -> Tensor:
    return scale.t() if scale.dim() == 2 else scale


def _swap(tile: tuple[int, int] | None) -> tuple[int, int] | None:
    return None if tile is None else (tile[1], tile[0])
