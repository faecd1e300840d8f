"""``emulation``: pure-torch FP8, the reference every other backend is tested against.

Casts saturate to the FP8 range and round to nearest even (torch's own cast);
matrix products dequantize both operands and multiply in float32. Runs on any
device torch supports.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from scalestate.backends.base import CastSpec
from scalestate.math import scale_from_amax, update_scales
from scalestate.quantized import Quantized

__all__ = ["EmulationBackend"]


class EmulationBackend:
    """Reference backend: pure torch, any device."""

    name = "emulation"

    def __init__(self) -> None:
        self._e4m3_tables: dict[torch.device, Tensor] = {}

    def dequantize(self, q: Quantized) -> Tensor:
        """``q.data * q.scale_inv`` in float32.

        On CPU, torch's E4M3 to float32 cast is several times slower than a
        gather from a 256-entry table built with that very cast; the table is
        scaled first (256 products instead of one per element), which gives
        the same bits as scaling every element.
        """
        data = q.data
        if data.dtype != torch.float8_e4m3fn or data.device.type != "cpu":
            return data.float() * q.scale_inv
        table = self._e4m3_tables.get(data.device)
        if table is None:
            codes = torch.arange(256, dtype=torch.uint8, device=data.device)
            table = self._e4m3_tables[data.device] = codes.view(torch.float8_e4m3fn).float()
        codes = data.view(torch.uint8)
        flip = codes.dim() == 2 and not codes.is_contiguous() and codes.t().is_contiguous()
        if flip:  # a transposed operand: gather in its memory order, transpose back
            codes = codes.t()
        values = torch.index_select(table * q.scale_inv, 0, codes.reshape(-1).int())
        values = values.view(codes.shape)
        return values.t() if flip else values

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Always available: it needs nothing beyond torch's float8 dtypes."""
        return True, "pure torch: runs on any device"

    def quantize(
        self, x: Tensor, scale: Tensor, spec: CastSpec, jit: bool | Tensor
    ) -> tuple[Quantized, Tensor]:
        """Saturating cast of ``x * scale`` to ``spec.dtype``; also returns ``amax(|x|)``."""
        xf = x.float()
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        if jit is not False:
            own = scale_from_amax(
                amax, spec.fp8_max, margin=spec.margin, power_of_2=spec.power_of_2,
                previous=scale,
            )
            scale = own if jit is True else torch.where(jit, own, scale)
        data = (xf * scale).clamp_(-spec.fp8_max, spec.fp8_max).to(spec.dtype)
        return Quantized(data, scale.reciprocal()), amax

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Dequantize both operands, multiply in float32, add ``bias``, cast."""
        out = torch.mm(self.dequantize(a), self.dequantize(b))
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    def update(
        self,
        history: Tensor,
        scales: Tensor,
        step_amax: Tensor,
        fp8_max: Tensor,
        *,
        amax_compute: Literal["max", "most_recent"],
        margin: int,
        power_of_2: bool,
    ) -> None:
        """Apply :func:`scalestate.math.update_scales` in place and clear ``step_amax``."""
        new_history, new_scales = update_scales(
            history, scales, step_amax, fp8_max,
            amax_compute=amax_compute, margin=margin, power_of_2=power_of_2,
        )
        history.copy_(new_history)
        scales.copy_(new_scales)
        step_amax.zero_()
