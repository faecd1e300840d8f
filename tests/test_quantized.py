"""scalestate.quantized: the FP8 data + scale_inv pair."""

from __future__ import annotations

import torch

import scalestate as ss


class TestQuantized:
    def test_dequantize(self):
        """dequantize() is data * scale_inv, in the dtype asked for."""
        q = ss.Quantized(torch.tensor([2.0, -4.0]).to(torch.float8_e4m3fn), torch.tensor(0.5))
        assert q.dequantize().tolist() == [1.0, -2.0]
        assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16

    def test_transpose_shares_scale(self):
        """t() transposes the data and keeps the scale."""
        data = torch.arange(6.0).reshape(2, 3).to(torch.float8_e4m3fn)
        q = ss.Quantized(data, torch.tensor(2.0)).t()
        assert q.shape == (3, 2) and q.scale_inv.item() == 2.0 and q.dtype == torch.float8_e4m3fn

    def test_frozen(self):
        """A Quantized is read-only."""
        q = ss.Quantized(torch.zeros(1, dtype=torch.float8_e4m3fn), torch.tensor(1.0))
        try:
            q.scale_inv = torch.tensor(2.0)  # type: ignore[misc]
        except AttributeError:
            return
        raise AssertionError("Quantized accepted an assignment")
