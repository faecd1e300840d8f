"""`Quantized`: FP8 data that carries the scale it was cast with."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["Quantized"]


@attrs.frozen(eq=False)
class Quantized:
    """An FP8 tensor and the inverse of the scale it was cast with.

    ``data * scale_inv`` is the value that was cast. The pair travels together,
    so a later change of the slot's scale can never be applied to data cast
    with an earlier one.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> h = m.register("fc", roles=(ss.Role.INPUT,))
        >>> q = h.quantize(torch.tensor([1.0, -2.0, 0.5]), ss.Role.INPUT)
        >>> q.data.dtype, q.dequantize()
        (torch.float8_e4m3fn, tensor([ 1.0000, -2.0000,  0.5000]))
    """

    #: The FP8 values (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
    data: Tensor
    #: 0-d float32: multiply ``data`` by it to get back the cast values.
    scale_inv: Tensor

    @property
    def shape(self) -> torch.Size:
        """Shape of ``data``."""
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """FP8 dtype of ``data``."""
        return self.data.dtype

    def t(self) -> Quantized:
        """The transpose of a 2-d ``Quantized`` (a view; the scale is per tensor)."""
        return Quantized(self.data.t(), self.scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale_inv`` in ``dtype`` (computed in float32)."""
        return (self.data.float() * self.scale_inv).to(dtype)
