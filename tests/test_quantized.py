"""scalestate.quantized: FP8 data with the exact scale it was cast with."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate.errors import ScaleStateError
from scalestate.finegrained import FineQuantized, quantize_blocks, quantize_tiles
from scalestate.quantized import FP8_MAX, Orientation, Quantized

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


def _orientation(values, scale=2.0, tile=None) -> Orientation:
    s = torch.tensor(scale)
    return Orientation((torch.tensor(values) * s).to(E4M3), s, torch.reciprocal(s), tile)


def _same_orientation(o: Orientation, p: Orientation) -> bool:
    return o.data is p.data and o.scale is p.scale and o.scale_inv is p.scale_inv and o.tile == p.tile


def _same_record(q: Quantized, r: Quantized) -> bool:
    """The very same tensors (identity), tiles and structure."""
    if q.other is None or r.other is None:
        return q.other is r.other and _same_orientation(q.primary, r.primary)
    return _same_orientation(q.primary, r.primary) and _same_orientation(q.other, r.other)


class TestRecord:
    """A Quantized is one orientation record, and optionally the other; the flat fields read them."""

    def test_fields_read_the_orientations(self):
        """data, scale, scale_inv, tile are the primary's; transposed and the t_ fields the other's."""
        rows = _orientation([[1.0, 2.0, 3.0]], tile=(1, 3))
        cols = _orientation([[1.0], [2.0], [3.0]], scale=4.0, tile=(1, 1))
        q = Quantized.of(rows, cols)
        assert q.primary is rows and q.other is cols
        assert (q.data, q.scale, q.scale_inv, q.tile) == (rows.data, rows.scale, rows.scale_inv, rows.tile)
        assert q.transposed is cols.data and q.t_scale is cols.scale and q.t_scale_inv is cols.scale_inv
        assert q.t_tile == (1, 1)

    def test_keyword_constructor_makes_the_same_record(self):
        """ss.Quantized(data, scale=..., transposed=...) and Quantized.of(...) hold the same orientations;
        a per-tensor other orientation shares the primary's scales."""
        rows = _orientation([[1.0, 2.0], [3.0, 4.0]])
        copy = rows.data.t().contiguous()
        q = ss.Quantized(rows.data, scale=rows.scale, scale_inv=rows.scale_inv, transposed=copy)
        assert _same_record(q, Quantized.of(rows, Orientation(copy, rows.scale, rows.scale_inv)))
        assert ss.Quantized(rows.data, scale=rows.scale, scale_inv=rows.scale_inv).other is None

    def test_of_checks_the_dtype(self):
        """Quantized.of refuses data that is not FP8, like the constructor."""
        s = torch.tensor(1.0)
        with pytest.raises(ScaleStateError, match=r"torch\.float32"):
            Quantized.of(Orientation(torch.zeros(2), s, s))

    @pytest.mark.parametrize("with_other", [False, True])
    @pytest.mark.parametrize("tiled", [False, True])
    def test_flatten_round_trip(self, with_other, tiled):
        """flatten() gives 3 tensors (6 with the other orientation) and a layout without tensors;
        unflatten() rebuilds the very same record."""
        x = torch.randn(4, 256)
        q = quantize_tiles(x, E4M3, columnwise=with_other).quantized if tiled else ss.Quantized(
            x.to(E4M3), scale=torch.tensor(1.0), transposed=x.t().contiguous().to(E4M3) if with_other else None
        )
        tensors, layout = q.flatten()
        assert len(tensors) == (6 if with_other else 3)
        assert not any(isinstance(v, torch.Tensor) for v in layout)
        assert _same_record(Quantized.unflatten(tensors, layout), q)

    def test_t_swaps_the_orientations(self):
        """With the other orientation, t() swaps the two records; rowwise() and columnwise() pick one."""
        q = quantize_tiles(torch.randn(8, 256), E4M3, columnwise=True)
        t = q.t()
        assert t.primary is q.other and t.other is q.primary
        assert q.rowwise().primary is q.primary and q.rowwise().other is None
        assert q.columnwise().primary is q.other and q.columnwise().other is None

    def test_fine_quantized_is_a_quantized_with_its_amax(self):
        """The fine-grained functions return the same record, with the tensor's amax beside it."""
        w = torch.randn(130, 200)
        q = quantize_blocks(w, E4M3, columnwise=True)
        assert isinstance(q, Quantized) and isinstance(q, FineQuantized)
        assert torch.equal(q.amax, w.abs().amax())
        assert q.t_data is q.transposed and q.other is not None and q.other.tile == (128, 128)
        plain = q.quantized
        assert type(plain) is Quantized and _same_record(plain, q)
        assert repr(q).startswith("<FineQuantized((130, 200)")

    def test_fp8_max_is_torch_finfo(self):
        """The one table of format maxima is torch's own finfo, and the recipe reads it."""
        from scalestate.recipe import fp8_max

        for dtype, value in FP8_MAX.items():
            assert value == torch.finfo(dtype).max == fp8_max(dtype)
        assert set(FP8_MAX) == {torch.float8_e4m3fn, torch.float8_e5m2}


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

    def test_record_traceable(self):
        """Quantized.of, flatten, unflatten and the orientation swap trace in one graph."""

        def fn(x):
            s = torch.tensor(2.0)
            rows = Orientation((x * s).to(E4M3), s, torch.reciprocal(s))
            q = Quantized.of(rows, Orientation(rows.data.t().contiguous(), s, rows.scale_inv))
            r = Quantized.unflatten(*q.flatten()).t()
            return r, r.dequantize(), r.other.dequantize()

        torch._dynamo.reset()
        x = torch.randn(2, 3)
        r, y, z = torch.compile(fn, fullgraph=True, backend="eager")(x)
        assert type(r) is Quantized and r.shape == (3, 2) and r.other is not None
        assert torch.equal(y, fn(x)[1]) and torch.equal(z, fn(x)[2])
