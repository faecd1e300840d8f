"""scalestate.quantized: FP8 data with the exact scale it was cast with."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate.errors import ScaleStateError

E4M3 = torch.float8_e4m3fn


def _q(values, scale=2.0, **kwargs) -> ss.Quantized:
    s = torch.tensor(scale)
    return ss.Quantized((torch.tensor(values) * s).to(E4M3), scale=s, scale_inv=torch.reciprocal(s), **kwargs)


class TestQuantized:
    def test_dequantize(self):
        """dequantize() is data * scale_inv, in the dtype asked for."""
        q = _q([1.0, -2.0], scale=2.0)
        assert q.dequantize().tolist() == [1.0, -2.0]
        assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16

    def test_carries_the_exact_multiplier(self):
        """scale is the very multiplier given, not 1 / scale_inv (which differs for this one)."""
        s = torch.tensor(1.459067940711975)
        assert not torch.equal(torch.reciprocal(torch.reciprocal(s)), s)
        q = ss.Quantized(torch.zeros(2, dtype=E4M3), scale=s, scale_inv=torch.reciprocal(s))
        assert q.scale is s

    def test_one_scale_derives_the_other(self):
        """Given only scale, scale_inv is its reciprocal; given only scale_inv, scale is."""
        s = torch.tensor(4.0)
        assert ss.Quantized(torch.zeros(1, dtype=E4M3), scale=s).scale_inv.item() == 0.25
        assert ss.Quantized(torch.zeros(1, dtype=E4M3), scale_inv=s).scale.item() == 0.25
        with pytest.raises(ScaleStateError, match="scale or scale_inv"):
            ss.Quantized(torch.zeros(1, dtype=E4M3))

    def test_scales_are_keyword_only(self):
        """The two scales are passed by name, so one is never taken for the other."""
        with pytest.raises(TypeError):
            ss.Quantized(torch.zeros(1, dtype=E4M3), torch.tensor(0.5))  # type: ignore[misc]

    def test_rejects_non_fp8_data(self):
        """data must be a float8 dtype; the error names what it got."""
        with pytest.raises(ScaleStateError, match=r"torch\.float32"):
            ss.Quantized(torch.zeros(2), scale=torch.tensor(1.0))

    def test_transpose_is_a_view_and_shares_scale(self):
        """t() without a transposed copy: a view of data, same 0-d scales."""
        q = _q([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        t = q.t()
        assert t.shape == (3, 2) and t.data.data_ptr() == q.data.data_ptr() and t.transposed is None
        assert t.scale is q.scale and t.scale_inv is q.scale_inv
        assert torch.equal(t.dequantize(), q.dequantize().t())

    def test_transpose_uses_the_transposed_copy(self):
        """t() with a transposed copy: that copy (contiguous), and the original as its transposed."""
        base = _q([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        copy = base.data.t().contiguous()
        q = ss.Quantized(base.data, scale=base.scale, scale_inv=base.scale_inv, transposed=copy)
        t = q.t()
        assert t.data is copy and t.data.is_contiguous() and t.transposed is q.data
        assert torch.equal(t.dequantize(), q.dequantize().t())
        assert t.t().data is q.data

    def test_transpose_of_row_scales(self):
        """2-d scales are transposed with the data, so dequantize still matches."""
        data = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(E4M3)
        scale = torch.tensor([[2.0], [4.0]])
        q = ss.Quantized(data, scale=scale, scale_inv=torch.reciprocal(scale))
        assert torch.equal(q.t().dequantize(), q.dequantize().t())

    def test_transpose_needs_2d(self):
        """t() of a 1-d Quantized is an error naming the shape."""
        with pytest.raises(ScaleStateError, match=r"\(3,\)"):
            _q([1.0, 2.0, 3.0]).t()

    def test_read_only(self):
        """A Quantized cannot be changed after it is made."""
        q = _q([1.0])
        with pytest.raises(AttributeError, match="read-only"):
            q.scale_inv = torch.tensor(2.0)  # type: ignore[misc]
        with pytest.raises(AttributeError, match="read-only"):
            del q.data

    def test_repr(self):
        """The repr names shape, dtype, scale, and whether a transposed copy is carried."""
        assert repr(_q([[1.0, 2.0]])) == "<Quantized((1, 2), torch.float8_e4m3fn, scale=2)>"


class TestCompile:
    @pytest.mark.parametrize("fullgraph", [False, True])
    def test_traceable(self, fullgraph):
        """torch.compile builds, uses and returns Quantized objects without a graph break."""

        def fn(x):
            s = torch.tensor(2.0)
            q = ss.Quantized((x * s).to(E4M3), scale=s, scale_inv=torch.reciprocal(s))
            return q.t(), q.dequantize()

        torch._dynamo.reset()
        q, y = torch.compile(fn, fullgraph=fullgraph, backend="eager")(torch.ones(2, 3))
        assert isinstance(q, ss.Quantized) and q.shape == (3, 2) and y.tolist() == [[1.0] * 3] * 2
