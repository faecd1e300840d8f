"""`Quantized`: FP8 data that carries the scale it was cast with.

One record for every cast, per-tensor or fine-grained: an :class:`Orientation`
(FP8 data, its scales, the tile one scale covers) and, where the cast made
it, a second orientation, the quantization of ``x.t()`` that the GEMMs
contracting over the other axis take.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NoReturn

import torch
from torch import Tensor

from scalestate.e2m1 import Packing, block_multipliers, decode_e2m1, unpack_e2m1
from scalestate.errors import CastError, ReadOnlyError
from scalestate.tiles import apply_tile_scales
from scalestate.tiles import dequantize as tile_dequantize

__all__ = ["FP4_DTYPE", "FP8_DTYPES", "FP8_MAX", "Orientation", "Packing", "Quantized", "QuantizedLayout"]

#: The largest finite value of each float8 dtype a ``Quantized`` may hold: the one table of them.
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: The float8 dtypes a ``Quantized`` may hold.
FP8_DTYPES = frozenset(FP8_MAX)
#: NVFP4's data dtype: two E2M1 values per byte (see :mod:`scalestate.e2m1`).
FP4_DTYPE = torch.float4_e2m1fn_x2

#: ``(rows, columns)`` of the data one scale covers; ``None``: one 0-d scale for the whole tensor.
Tile = tuple[int, int] | None


class Orientation(NamedTuple):
    """One orientation of a quantized tensor: FP8 (or NVFP4) data with the scales it was cast with.

    ``data ~= x * scale``, each scale spread over its ``tile`` of ``data``
    (``tile`` ``None``: one 0-d scale). ``scale_inv`` is
    ``torch.reciprocal(scale)`` in float32, or E8M0 for MX.

    NVFP4 (``packing`` set): ``data`` is ``torch.float4_e2m1fn_x2``, two
    E2M1 values per byte along its last dimension; ``scale`` holds the
    float32 multipliers ``e_b`` applied per block, ``scale_inv`` the stored
    E4M3 block scales ``s_b`` and ``tensor_scale_inv`` the per-tensor
    ``S_dec``: the values are ``q * (s_b * S_dec)``. Scales and ``tile`` are
    those of the stored values; ``packing.transposed`` says the orientation
    means their transpose (see :mod:`scalestate.nvfp4`).
    """

    #: The FP8 values (NVFP4: packed E2M1 codes).
    data: Tensor
    #: float32: the multipliers applied before rounding.
    scale: Tensor
    #: Multiply ``data`` by them (each over its tile) to get back the cast values.
    scale_inv: Tensor
    #: ``(rows, columns)`` of ``data`` one scale covers; ``None`` for one 0-d scale.
    tile: Tile = None
    #: NVFP4 only: the 0-d float32 per-tensor factor ``S_dec`` that multiplies every block scale.
    tensor_scale_inv: Tensor | None = None
    #: NVFP4 only: the logical shape of the packed data, and whether this orientation is its transpose.
    packing: Packing | None = None

    def t(self) -> Orientation:
        """The same values as ``x.t()``: the view ``data.t()``, with the scales and the tile transposed.

        NVFP4 data stays as stored (it is packed along its rows): the
        orientation's ``packing`` then says it means the transpose.
        """
        if self.packing is not None:
            return self._replace(packing=self.packing._replace(transposed=not self.packing.transposed))
        return Orientation(self.data.t(), _t(self.scale), _t(self.scale_inv), _swap(self.tile))

    @property
    def shape(self) -> torch.Size:
        """The shape of the values (NVFP4: unpacked, transposed where the orientation is a transpose)."""
        p = self.packing
        if p is None:
            return self.data.shape
        return torch.Size(p.shape[::-1] if p.transposed else p.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale_inv`` in ``dtype`` (computed in float32), each factor spread over its tile.

        NVFP4: ``q * (s_b * S_dec)``, in that order of float32 operations.
        """
        p = self.packing
        if p is not None:
            assert self.tensor_scale_inv is not None
            values = decode_e2m1(unpack_e2m1(self.data, p.shape[-1]))
            out = apply_tile_scales(values, self.scale_inv.float() * self.tensor_scale_inv, self.tile or (1, 1))
            return (out.t() if p.transposed else out).to(dtype)
        if self.tile is None:
            return (self.data.float() * self.scale_inv).to(dtype)
        return tile_dequantize(self.data, self.scale_inv, self.tile).to(dtype)

    def tensors(self) -> tuple[Tensor, ...]:
        """Its tensors: ``data, scale, scale_inv``; NVFP4: ``data, scale_inv, tensor_scale_inv``
        (``scale`` follows from those two exactly, so it is not kept: 4 bytes per 16 elements)."""
        if self.tensor_scale_inv is None:
            return self.data, self.scale, self.scale_inv
        return self.data, self.scale_inv, self.tensor_scale_inv


class QuantizedLayout(NamedTuple):
    """What rebuilds a :class:`Quantized` from the tensors of :meth:`Quantized.flatten`: no tensors."""

    #: The tile of the first orientation.
    tile: Tile
    #: Whether a second orientation follows, and its tile.
    has_other: bool
    #: The tile of the second orientation (``None`` when there is none or it is per tensor).
    other_tile: Tile
    #: NVFP4: the packing of the first orientation (its tensors: data, ``scale_inv``, ``tensor_scale_inv``).
    packing: Packing | None = None
    #: NVFP4: the packing of the second orientation.
    other_packing: Packing | None = None


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

    The record behind these fields is a pair of :class:`Orientation` records:
    :attr:`primary` (``data``, ``scale``, ``scale_inv``, ``tile``) and
    :attr:`other` (``transposed``, ``t_scale``, ``t_scale_inv``, ``t_tile``;
    ``None`` without ``transposed``). A backend builds one with
    :meth:`of`; :meth:`flatten` and :meth:`unflatten` turn it into tensors
    and back (for ``save_for_backward``).

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
        >>> q.primary.data is q.data, q.other is None
        (True, True)
    """

    __slots__ = ("_other", "_primary")

    _primary: Orientation
    _other: Orientation | None

    def __init__(
        self,
        data: Tensor,
        *,
        scale: Tensor | None = None,
        scale_inv: Tensor | None = None,
        transposed: Tensor | None = None,
        tile: Tile = None,
        t_scale: Tensor | None = None,
        t_scale_inv: Tensor | None = None,
        t_tile: Tile = None,
    ) -> None:
        if scale is None:
            if scale_inv is None:
                raise CastError("Quantized needs scale or scale_inv (or both); got neither")
            scale = torch.reciprocal(scale_inv)
        elif scale_inv is None:
            scale_inv = torch.reciprocal(scale)
        primary = Orientation(data, scale, scale_inv, tile)
        other = None
        if transposed is not None:
            other = Orientation(
                transposed,
                _t(scale) if t_scale is None else t_scale,
                _t(scale_inv) if t_scale_inv is None else t_scale_inv,
                _swap(tile) if t_tile is None else t_tile,
            )
        self._fill(primary, other)

    @staticmethod
    def of(primary: Orientation, other: Orientation | None = None) -> Quantized:
        """The ``Quantized`` of one orientation (``data``, ``scale``, ``scale_inv``, ``tile``)
        and, optionally, the other one (``transposed``, ``t_scale``, ``t_scale_inv``, ``t_tile``).

        Example:
            >>> import torch
            >>> from scalestate.quantized import Orientation, Quantized
            >>> s = torch.tensor(2.0)
            >>> q = Quantized.of(Orientation(torch.ones(2, 3).to(torch.float8_e4m3fn), s, 1 / s))
            >>> q.scale_inv, q.tile, q.transposed
            (tensor(0.5000), None, None)
        """
        q = object.__new__(Quantized)
        q._fill(primary, other)
        return q

    def _fill(self, primary: Orientation, other: Orientation | None) -> None:
        """Check the FP8 dtype and set the two orientations of a new instance (also of a subclass's)."""
        dtype = primary.data.dtype
        if dtype not in FP8_DTYPES and not (dtype == FP4_DTYPE and primary.packing is not None):
            raise CastError(
                "Quantized data must be torch.float8_e4m3fn or torch.float8_e5m2 (or torch.float4_e2m1fn_x2 "
                f"with its NVFP4 packing); got {dtype}"
            )
        object.__setattr__(self, "_primary", primary)
        object.__setattr__(self, "_other", other)

    # ----------------------------------------------------------------- the record

    @property
    def primary(self) -> Orientation:
        """The orientation of ``data``: ``(data, scale, scale_inv, tile)``."""
        return self._primary

    @property
    def other(self) -> Orientation | None:
        """The quantization of ``x.t()``, ``(transposed, t_scale, t_scale_inv, t_tile)``, if the cast made it."""
        return self._other

    def flatten(self) -> tuple[tuple[Tensor, ...], QuantizedLayout]:
        """The tensors of this quantization (3 per orientation) and what rebuilds it.

        ``Quantized.unflatten(*q.flatten())`` holds the very same tensors; for
        NVFP4 its ``scale`` (the multipliers ``e_b``) is derived again from
        ``scale_inv`` and ``tensor_scale_inv``, bit for bit the cast's.
        """
        p, o = self._primary, self._other
        if o is None:
            return p.tensors(), QuantizedLayout(p.tile, False, None, p.packing)
        return (*p.tensors(), *o.tensors()), QuantizedLayout(p.tile, True, o.tile, p.packing, o.packing)

    @staticmethod
    def unflatten(tensors: tuple[Tensor, ...], layout: QuantizedLayout) -> Quantized:
        """The ``Quantized`` that :meth:`flatten` gave ``tensors`` and ``layout`` for."""
        primary = _orientation(tensors[:3], layout.tile, layout.packing)
        other = _orientation(tensors[3:], layout.other_tile, layout.other_packing) if layout.has_other else None
        return Quantized.of(primary, other)

    # ----------------------------------------------------------------- public fields

    @property
    def data(self) -> Tensor:
        """The FP8 values."""
        return self._primary.data

    @property
    def scale(self) -> Tensor:
        """float32: the multiplier applied before rounding (``data ~= x * scale``)."""
        return self._primary.scale

    @property
    def scale_inv(self) -> Tensor:
        """float32 (E8M0 for MX): multiply ``data`` by it to get back the cast values."""
        return self._primary.scale_inv

    @property
    def tile(self) -> Tile:
        """``(rows, columns)`` of ``data`` one scale covers; ``None`` for one 0-d scale."""
        return self._primary.tile

    @property
    def transposed(self) -> Tensor | None:
        """``x.t()`` quantized along its rows, contiguous, if the cast made it; else ``None``."""
        return None if self._other is None else self._other.data

    @property
    def t_scale(self) -> Tensor:
        """Scales of ``transposed`` (``scale`` itself, or transposed, where they are shared)."""
        return _t(self._primary.scale) if self._other is None else self._other.scale

    @property
    def t_scale_inv(self) -> Tensor:
        """Dequantization factors of ``transposed``."""
        return _t(self._primary.scale_inv) if self._other is None else self._other.scale_inv

    @property
    def t_tile(self) -> Tile:
        """Tile of ``transposed``."""
        return _swap(self._primary.tile) if self._other is None else self._other.tile

    @property
    def shape(self) -> torch.Size:
        """Shape of ``data`` (NVFP4: of the values, unpacked)."""
        return self._primary.shape

    @property
    def dtype(self) -> torch.dtype:
        """FP8 dtype of ``data`` (``torch.float4_e2m1fn_x2`` for NVFP4)."""
        return self._primary.data.dtype

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise ReadOnlyError(f"{type(self).__name__} is read-only; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise ReadOnlyError(f"{type(self).__name__} is read-only; cannot delete {name!r}")

    # ----------------------------------------------------------------- views

    def t(self) -> Quantized:
        """The quantization of ``x.t()``, with no copy.

        Where the cast made ``transposed``, the two orientations swap places
        (``data`` becomes ``transposed`` and back, scales and tiles with them).
        Otherwise its ``data`` is the view ``data.t()``, with the scales and
        the tile transposed: the same values, scaled along the first dimension.
        """
        if self._primary.data.dim() != 2:
            raise CastError(f"Quantized.t() needs 2-d data; got shape {tuple(self._primary.data.shape)}")
        if self._other is not None:
            return Quantized.of(self._other, self._primary)
        return Quantized.of(self._primary.t())

    def rowwise(self) -> Quantized:
        """Only the orientation of ``data`` (scaled along its last dimension where tiled)."""
        if self._other is None:
            return self
        return Quantized.of(self._primary)

    def columnwise(self) -> Quantized:
        """Only the quantization of ``x.t()`` (``transposed``), as a ``Quantized`` of its own.

        Without ``transposed``, the view :meth:`t` where one set of scales
        serves both orientations (per-tensor scales, square blocks).
        """
        if self._other is not None:
            return Quantized.of(self._other)
        tile = self._primary.tile
        if tile is not None and tile[0] != tile[1]:
            raise CastError(
                f"this Quantized is scaled in {tile[0]} x {tile[1]} tiles and holds no "
                "columnwise quantization; cast with transpose=True"
            )
        return self.t()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale_inv`` in ``dtype`` (computed in float32), each factor spread over its tile:
        the orientation scaled along the last dimension."""
        return self._primary.dequantize(dtype)

    def __repr__(self) -> str:
        p = self._primary
        scale = f"{p.scale.item():g}" if p.scale.numel() == 1 else f"shape {tuple(p.scale.shape)}"
        extra = ", transposed" if self._other is not None else ""
        tile = "" if p.tile is None else f", tile={p.tile}"
        return f"<{type(self).__name__}({tuple(p.shape)}, {p.data.dtype}, scale={scale}{tile}{extra})>"


def _orientation(tensors: tuple[Tensor, ...], tile: Tile, packing: Packing | None) -> Orientation:
    if packing is None:
        return Orientation(tensors[0], tensors[1], tensors[2], tile)
    data, s_b, s_dec = tensors
    return Orientation(data, block_multipliers(s_b, s_dec), s_b, tile, s_dec, packing)


def _t(scale: Tensor) -> Tensor:
    return scale.t() if scale.dim() == 2 else scale


def _swap(tile: Tile) -> Tile:
    return None if tile is None else (tile[1], tile[0])
