"""scalestate.backends.scaled_mm: per-tensor FP8 products through torch's scaled-matmul kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scalestate.backends import CastRequest, CastSpec, resolve_backend
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.capability import cpu_runs_functional
from scalestate.backends.scaled_mm.layout import tensorwise_operands
from scalestate.errors import BackendUnavailableError
from scalestate.quantized import Orientation, Quantized

E4M3 = CastSpec(torch.float8_e4m3fn, 448.0)
E5M2 = CastSpec(torch.float8_e5m2, 57344.0)


def cast(x, spec=E4M3, transpose=False) -> Quantized:
    return EmulationBackend().cast(CastRequest(x, spec, torch.tensor(1.0), True, None, transpose))


def _laid_out(x: torch.Tensor, spec: CastSpec, layout: str) -> Quantized:
    """``x`` cast, its data row-major (``"row"``) or the transposed view of a row-major cast (``"col"``)."""
    return cast(x.t().contiguous(), spec).t() if layout == "col" else cast(x, spec)


def _row_major(q: Quantized) -> Quantized:
    """The same values with their data laid out row-major."""
    return Quantized.of(Orientation(q.data.contiguous(), q.scale, q.scale_inv))


@pytest.mark.skipif(not cpu_runs_functional(), reason="this torch has no CPU kernel of F.scaled_mm (torch < 2.13)")
class TestPerTensorOnCPU:
    """On CPU, per-tensor products take torch.nn.functional.scaled_mm: it dequantizes both operands into
    row-major float32 and multiplies them, which is the emulation's product of row-major operands."""

    @pytest.mark.parametrize(
        "shape", [(1, 1, 1), (1, 64, 48), (2, 64, 48), (33, 17, 65), (64, 128, 32), (100, 200, 60), (512, 512, 512)]
    )
    @pytest.mark.parametrize("formats", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)])
    @pytest.mark.parametrize("layouts", ["row-col", "row-row", "col-col"])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_bitwise_the_emulation_of_row_major_operands(self, shape, formats, layouts, out_dtype, with_bias):
        """Every shape (one or two rows too), pair of formats, operand layout, output dtype and bias:
        torch.equal to the emulation's product of the same operands laid out row-major."""
        m, k, n = shape
        torch.manual_seed(m + k + n)
        a_layout, b_layout = layouts.split("-")
        qa = _laid_out(torch.randn(m, k) * 30, formats[0], a_layout)
        qb = _laid_out(torch.randn(k, n) / 7, formats[1], b_layout)
        bias = torch.randn(n, dtype=out_dtype) if with_bias else None
        ref = EmulationBackend().scaled_mm(_row_major(qa), _row_major(qb), out_dtype=out_dtype, bias=bias)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_scaled_mm", _refuse)  # the slow CPU kernel must not be reached
            got = ScaledMMBackend().scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias)
        assert got.dtype == out_dtype
        assert torch.equal(got, ref)

    @pytest.mark.parametrize("shape", [(3, 64, 48), (33, 17, 65), (512, 512, 512)])
    def test_bitwise_the_emulation_from_three_rows(self, shape):
        """Measured here: with three rows or more, the emulation's product of a column-major second operand
        (which it multiplies as laid out) has the same bits too; with one or two, torch.mm sums it in
        another order (the test above compares those with row-major operands)."""
        m, k, n = shape
        qa, qb = cast(torch.randn(m, k) * 30), cast(torch.randn(n, k) / 7).t()
        want = EmulationBackend().scaled_mm(qa, qb, out_dtype=torch.float32)
        assert torch.equal(ScaledMMBackend().scaled_mm(qa, qb, out_dtype=torch.float32), want)

    def test_through_a_manager(self):
        """A Linear on the scaled_mm backend (every product of three rows or more): outputs and gradients
        bitwise the emulation backend's."""
        import scalestate as ss

        results = []
        for backend in ("emulation", "scaled_mm"):
            torch.manual_seed(0)
            manager = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend, device="cpu")
            layer = ss.nn.Linear(48, 40, manager=manager, name="fc")
            x = torch.randn(24, 48, requires_grad=True)
            for _ in range(2):
                out = layer(x)
                out.square().sum().backward()
                manager.step()
            results.append((out, x.grad, layer.weight.grad))
        for want, got in zip(*results, strict=True):
            assert torch.equal(got, want)

    def test_older_torch_takes_the_per_tensor_kernel(self, monkeypatch):
        """Without the functional CPU kernel (torch before 2.13), torch._scaled_mm multiplies: within
        the float32 summation bound of the emulation."""
        import scalestate.backends.scaled_mm.capability as module

        monkeypatch.setattr(module, "cpu_runs_functional", lambda: False)
        backend = ScaledMMBackend()
        assert "torch._scaled_mm" in backend.available(torch.device("cpu"))[1]
        qa, qb = cast(torch.randn(16, 32)), cast(torch.randn(8, 32))
        calls = []
        real = torch._scaled_mm

        def spy(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", spy)
        got = backend.scaled_mm(qa, qb.t(), out_dtype=torch.float32)
        ref = EmulationBackend().scaled_mm(qa, qb.t(), out_dtype=torch.float32)
        assert calls == [1]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def _refuse(*args, **kwargs):
    raise AssertionError("torch._scaled_mm was called")


class TestScaledMM:
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_agrees_with_emulation(self, out_dtype, with_bias):
        """torch._scaled_mm matches the emulation within 1e-5 relative (fp32) / 1 bf16 ulp."""
        qa, qb = cast(torch.randn(64, 96)), cast(torch.randn(48, 96))
        bias = torch.randn(48, dtype=out_dtype) if with_bias else None
        ref = EmulationBackend().scaled_mm(qa, qb.t(), out_dtype=out_dtype, bias=bias).float()
        got = ScaledMMBackend().scaled_mm(qa, qb.t(), out_dtype=out_dtype, bias=bias).float()
        tol = 1e-5 if out_dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())

    def test_mixed_formats(self):
        """E5M2 x E4M3 (the backward products) works on CPU."""
        qa, qb = cast(torch.randn(8, 16), E5M2), cast(torch.randn(16, 4))
        ref = EmulationBackend().scaled_mm(qa, qb, out_dtype=torch.float32)
        torch.testing.assert_close(ScaledMMBackend().scaled_mm(qa, qb, out_dtype=torch.float32), ref)

    def test_transposed_copies_give_the_same_product(self):
        """Operands with transposed copies multiply to the same bits; a row-major second operand is
        taken from its copy where the kernel wants column-major (torch._scaled_mm), and as it is where
        any layout does (F.scaled_mm on CPU): never copied again."""
        g, w = torch.randn(16, 8), torch.randn(8, 32)
        want = ScaledMMBackend().scaled_mm(cast(g), cast(w), out_dtype=torch.float32)
        qg, qw = cast(g, transpose=True), cast(w, transpose=True)
        seen = []
        functional = cpu_runs_functional()
        owner, entry = (F, "scaled_mm") if functional else (torch, "_scaled_mm")
        real = getattr(owner, entry)

        def spy(a, b, *args, **kwargs):
            seen.append(b)
            return real(a, b, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(owner, entry, spy)
            assert torch.equal(ScaledMMBackend().scaled_mm(qg, qw, out_dtype=torch.float32), want)
        assert qw.transposed is not None
        assert seen[0].data_ptr() == (qw.data if functional else qw.transposed).data_ptr()

    def test_cpu_availability_reason(self):
        """Available on CPU in this torch, with a reason naming it."""
        ok, reason = ScaledMMBackend().available(torch.device("cpu"))
        assert ok and "CPU" in reason
        assert ("torch.nn.functional.scaled_mm" in reason) == cpu_runs_functional()

    def test_wants_transposed(self):
        """Its CUDA products take row-major times column-major operands, so modules ask for copies there;
        on a CPU where F.scaled_mm takes them, any layout does, and no copies are made."""
        assert ScaledMMBackend().wants_transposed(torch.device("cuda"))
        assert ScaledMMBackend().wants_transposed(torch.device("cpu")) == (not cpu_runs_functional())
        assert not EmulationBackend().wants_transposed(torch.device("cpu"))

    def test_cuda_layout(self):
        """cuBLASLt's rules, checked on CPU through the layout helper: layouts made, odd dimensions
        zero-padded (the product is unchanged), two E5M2 operands refused."""
        e5 = Quantized(torch.zeros(16, 16, dtype=torch.float8_e5m2), scale_inv=torch.tensor(1.0))
        with pytest.raises(BackendUnavailableError, match="two E5M2"):
            tensorwise_operands(e5, e5, pad=True)
        a = Quantized(torch.randn(20, 24).to(torch.float8_e4m3fn), scale_inv=torch.tensor(1.0))
        b = Quantized(torch.randn(40, 24).to(torch.float8_e4m3fn), scale_inv=torch.tensor(1.0)).t()
        pa, pb = tensorwise_operands(a, b, pad=True)
        assert pa.shape == (20, 32) and pb.shape == (32, 48)
        assert pa.is_contiguous() and pb.t().is_contiguous()
        one = torch.tensor(1.0)
        want = torch._scaled_mm(a.data, b.data, scale_a=one, scale_b=one, out_dtype=torch.float32)
        got = torch._scaled_mm(pa, pb, scale_a=one, scale_b=one, out_dtype=torch.float32)[:, :40]
        assert torch.equal(got, want)

    def test_dequantize_inherited(self):
        """The scaled_mm backend keeps the emulation's dequantize."""
        q = Quantized(torch.tensor([2.0]).to(torch.float8_e4m3fn), scale_inv=torch.tensor(0.5))
        assert ScaledMMBackend().dequantize(q).item() == 1.0

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message; a GPU is present")
    def test_cuda_unavailable_reason(self):
        """Asking for CUDA without a GPU says so."""
        ok, reason = ScaledMMBackend().available(torch.device("cuda"))
        assert not ok and "CUDA" in reason
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            resolve_backend("scaled_mm", torch.device("cuda"))
