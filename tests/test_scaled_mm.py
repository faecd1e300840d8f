"""scalestate.backends.scaled_mm: FP8 products through torch._scaled_mm."""

from __future__ import annotations

import pytest
import torch

from scalestate.backends import CastRequest, CastSpec, resolve_backend
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.layout import tensorwise_operands
from scalestate.errors import BackendUnavailableError
from scalestate.quantized import Quantized

E4M3 = CastSpec(torch.float8_e4m3fn, 448.0)
E5M2 = CastSpec(torch.float8_e5m2, 57344.0)


def cast(x, spec=E4M3, transpose=False) -> Quantized:
    return EmulationBackend().cast(CastRequest(x, spec, torch.tensor(1.0), True, None, transpose))


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
        """Operands with transposed copies multiply to the same bits; a row-major second
        operand is taken from its copy, not copied again."""
        g, w = torch.randn(16, 8), torch.randn(8, 32)
        want = ScaledMMBackend().scaled_mm(cast(g), cast(w), out_dtype=torch.float32)
        qg, qw = cast(g, transpose=True), cast(w, transpose=True)
        seen = []
        real = torch._scaled_mm

        def spy(a, b, *args, **kwargs):
            seen.append(b)
            return real(a, b, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_scaled_mm", spy)
            assert torch.equal(ScaledMMBackend().scaled_mm(qg, qw, out_dtype=torch.float32), want)
        assert qw.transposed is not None and seen[0].data_ptr() == qw.transposed.data_ptr()

    def test_cpu_availability_reason(self):
        """Available on CPU in this torch, with a reason naming it."""
        ok, reason = ScaledMMBackend().available(torch.device("cpu"))
        assert ok and "CPU" in reason

    def test_wants_transposed(self):
        """Its products take row-major times column-major operands, so modules ask for copies."""
        assert ScaledMMBackend().wants_transposed(torch.device("cpu"))
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
