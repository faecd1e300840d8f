"""`Quantized`: FP8 data that carries the scale it was cast with."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import Tensor

from scalestate.errors import ScaleStateError

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
    float32 in six); ``scale_inv`` is ``torch.reciprocal(scale)``. Both are
    float32 tensors that broadcast against ``data``: 0-d for per-tensor
    recipes, other shapes for finer-grained ones. ``transposed``, when present,
    holds the values of ``data.t()`` laid out contiguously (``data`` in
    column-major order), made in the same pass as ``data`` for GEMMs that need
    the other layout.

    A plain object of tensors, read-only, which ``torch.compile`` traces.

    Args:
        data: the FP8 values (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        scale: (keyword) the multiplier that was applied before rounding; derived as
            ``1 / scale_inv`` when not given.
        scale_inv: the dequantization factor; ``torch.reciprocal(scale)`` when not given.
        transposed: optional contiguous ``data.t()`` (2-d data only).

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> h = m.register("fc", roles=(ss.Role.INPUT,))
        >>> q = h.quantize(torch.tensor([1.0, -2.0, 0.5]), ss.Role.INPUT)
        >>> q.data.dtype, q.scale, q.dequantize()
        (torch.float8_e4m3fn, tensor(224.), tensor([ 1.0000, -2.0000,  0.5000]))
    """

    __slots__ = ("data", "scale", "scale_inv", "transposed")

    #: The FP8 values.
    data: Tensor
    #: float32: the multiplier applied before rounding (``data ~= x * scale``).
    scale: Tensor
    #: float32: multiply ``data`` by it to get back the cast values.
    scale_inv: Tensor
    #: ``data.t()`` laid out contiguously, if the cast made it; else ``None``.
    transposed: Tensor | None

    def __init__(
        self,
        data: Tensor,
        *,
        scale: Tensor | None = None,
        scale_inv: Tensor | None = None,
        transposed: Tensor | None = None,
    ) -> None:
        if data.dtype not in FP8_DTYPES:
            raise ScaleStateError(
                f"Quantized data must be torch.float8_e4m3fn or torch.float8_e5m2; got {data.dtype}"
            )
        if scale is None:
            if scale_inv is None:
                raise ScaleStateError("Quantized needs scale or scale_inv (or both); got neither")
            scale = torch.reciprocal(scale_inv)
        elif scale_inv is None:
            scale_inv = torch.reciprocal(scale)
        set_ = object.__setattr__
        set_(self, "data", data)
        set_(self, "scale", scale)
        set_(self, "scale_inv", scale_inv)
        set_(self, "transposed", transposed)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"Quantized is read-only; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Quantized is read-only; cannot delete {name!r}")

    @property
    def shape(self) -> torch.Size:
        """Shape of ``data``."""
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """FP8 dtype of ``data``."""
        return self.data.dtype

    def t(self) -> Quantized:
        """The transpose of a 2-d ``Quantized``, with no copy.

        Its ``data`` is the contiguous ``transposed`` copy when the cast made
        one (and its ``transposed`` the original data), else a view. 2-d scales
        are transposed with the data; 0-d ones are shared.
        """
        if self.data.dim() != 2:
            raise ScaleStateError(f"Quantized.t() needs 2-d data; got shape {tuple(self.data.shape)}")
        data = self.transposed if self.transposed is not None else self.data.t()
        transposed = self.data if self.transposed is not None else None
        return Quantized(data, scale=_t(self.scale), scale_inv=_t(self.scale_inv), transposed=transposed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale_inv`` in ``dtype`` (computed in float32)."""
        return (self.data.float() * self.scale_inv).to(dtype)

    def __repr__(self) -> str:
        scale = f"{self.scale.item():g}" if self.scale.numel() == 1 else f"shape {tuple(self.scale.shape)}"
        extra = ", transposed" if self.transposed is not None else ""
        return f"<Quantized({tuple(self.data.shape)}, {self.data.dtype}, scale={scale}{extra})>"


def _t(scale: Tensor) -> Tensor:
    return scale.t() if scale.dim() == 2 else scale
