"""scalestate.backends: registry, entry points, the two CPU backends."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch

import scalestate as ss
from scalestate.backends import (
    CastSpec,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend,
)
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend, _cuda_layout
from scalestate.errors import BackendUnavailableError, ScaleStateError, UnknownBackendError
from scalestate.quantized import Quantized

E4M3 = CastSpec(torch.float8_e4m3fn, 448.0)
E5M2 = CastSpec(torch.float8_e5m2, 57344.0)


class _Unavailable(EmulationBackend):
    name = "nowhere"

    def available(self, device=None):
        return False, "needs a device that does not exist"


class TestRegistry:
    def test_builtins(self):
        """emulation and scaled_mm are registered and available on CPU here."""
        report = available_backends("cpu")
        assert report["emulation"][0] and report["scaled_mm"][0]

    def test_unknown_lists_registered_names(self):
        """An unknown name lists every registered name."""
        with pytest.raises(UnknownBackendError) as info:
            get_backend("tpu9000")
        assert "emulation" in str(info.value) and "scaled_mm" in str(info.value)
        with pytest.raises(UnknownBackendError):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="tpu9000")

    def test_register_and_use(self):
        """A registered factory is used by a manager, one instance per manager."""
        register_backend("mine", EmulationBackend)
        a = ss.ScalingStateManager(ss.DelayedScaling(), backend="mine")
        b = ss.ScalingStateManager(ss.DelayedScaling(), backend="mine")
        assert isinstance(a.backend, EmulationBackend) and a.backend is not b.backend

    def test_duplicate_needs_replace(self):
        """Registering a taken name is refused unless replace=True."""
        with pytest.raises(ScaleStateError, match="replace=True"):
            register_backend("emulation", EmulationBackend)
        register_backend("emulation", ScaledMMBackend, replace=True)
        assert isinstance(get_backend("emulation"), ScaledMMBackend)

    @pytest.mark.parametrize("name", ["", "auto", "has space", 3])
    def test_bad_names(self, name):
        """Malformed names and the reserved 'auto' are refused."""
        with pytest.raises(ScaleStateError):
            register_backend(name, EmulationBackend)

    def test_factory_must_be_callable(self):
        """A non-callable factory is refused at registration."""
        with pytest.raises(ScaleStateError, match="callable"):
            register_backend("x", 42)  # type: ignore[arg-type]

    def test_incomplete_backend(self):
        """A backend lacking a method is refused with the method's name."""
        register_backend("half", lambda: object())
        with pytest.raises(ScaleStateError, match="available"):
            get_backend("half")

    def test_unavailable_says_why(self):
        """An unavailable backend's error carries its reason."""
        register_backend("nowhere", _Unavailable)
        with pytest.raises(BackendUnavailableError, match="does not exist"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="nowhere", device="cpu")
        assert available_backends()["nowhere"] == (False, "needs a device that does not exist")

    def test_unavailable_found_at_first_cast_without_device(self):
        """With no device given, availability is checked for the first tensor's device."""
        register_backend("nowhere", _Unavailable)
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="nowhere")
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with pytest.raises(BackendUnavailableError, match="does not exist"):
            h.quantize(torch.ones(2), ss.Role.INPUT)

    def test_auto_is_settled_on_the_state_device(self):
        """Without a device, 'auto' is chosen at the first cast, for that tensor's device."""
        m = ss.ScalingStateManager(ss.DelayedScaling())
        assert "backend='auto'" in repr(m)
        m.register("fc", roles=(ss.Role.INPUT,)).quantize(torch.ones(2), ss.Role.INPUT)
        assert m.backend.name == "emulation" and "backend='emulation'" in repr(m)

    def test_auto_skips_a_broken_backend(self, caplog):
        """A registered backend whose factory fails does not stop 'auto' from trying the next."""

        def broken():
            raise ImportError("libfp8kernels.so: cannot open shared object file")

        register_backend("cuda", broken)
        with caplog.at_level(logging.INFO, logger="scalestate"):
            backend = resolve_backend("auto", torch.device("cuda"))
        assert backend.name in ("scaled_mm", "emulation")

    def test_backend_needs_a_name(self):
        """A backend object without a string name is refused, by registry and manager alike."""

        class Nameless(EmulationBackend):
            name = None  # type: ignore[assignment]

        register_backend("nameless", Nameless)
        with pytest.raises(ScaleStateError, match="'name'"):
            get_backend("nameless")
        with pytest.raises(ScaleStateError, match="'name'"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend=Nameless())

    def test_auto_picks_and_logs(self, caplog):
        """'auto' on CPU picks the emulation backend and says so on the scalestate logger."""
        with caplog.at_level(logging.INFO, logger="scalestate"):
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend="auto", device="cpu")
        assert m.backend.name == "emulation"
        assert "chose 'emulation'" in caplog.text

    def test_manager_accepts_instance(self):
        """A backend object can be passed directly."""
        b = ScaledMMBackend()
        assert ss.ScalingStateManager(ss.DelayedScaling(), backend=b).backend is b


class TestEntryPoints:
    def test_third_party_registration(self, tmp_path, monkeypatch):
        """A distribution declaring the 'scalestate.backends' entry point is found by name."""
        (tmp_path / "thirdparty_fp8.py").write_text(
            textwrap.dedent(
                """
                from scalestate.backends.emulation import EmulationBackend

                class ThirdParty(EmulationBackend):
                    name = "thirdparty"
                """
            )
        )
        dist = tmp_path / "thirdparty_fp8-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-fp8\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(
            "[scalestate.backends]\nthirdparty = thirdparty_fp8:ThirdParty\nauto = thirdparty_fp8:ThirdParty\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        assert "thirdparty" in available_backends()
        assert "auto" not in available_backends()
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="thirdparty")
        assert type(m.backend).__name__ == "ThirdParty"
        monkeypatch.delitem(sys.modules, "thirdparty_fp8", raising=False)


class TestEmulationCast:
    def test_exact_values_roundtrip(self):
        """Values representable in E4M3 survive a cast with scale 1 exactly."""
        x = torch.tensor([0.0, 1.0, -2.0, 448.0, 0.015625])
        q, amax = EmulationBackend().quantize(x, torch.tensor(1.0), E4M3, False)
        assert torch.equal(q.dequantize(), x) and amax.item() == 448.0

    def test_saturates(self):
        """Values beyond the range saturate to +-fp8_max instead of becoming NaN."""
        x = torch.tensor([1000.0, -1e6, float("inf")])
        q, _ = EmulationBackend().quantize(x, torch.tensor(1.0), E4M3, False)
        assert q.dequantize().tolist() == [448.0, -448.0, 448.0]

    def test_scale_applied_and_inverse_carried(self):
        """data = x * scale; scale_inv = 1 / scale."""
        x = torch.tensor([1.0, 0.5])
        q, _ = EmulationBackend().quantize(x, torch.tensor(4.0), E4M3, False)
        assert q.data.float().tolist() == [4.0, 2.0] and q.scale_inv.item() == 0.25

    def test_jit_scales_from_own_amax(self):
        """jit=True: the amax maps onto fp8_max, whatever scale was passed."""
        x = torch.tensor([2.0, -1.0])
        q, amax = EmulationBackend().quantize(x, torch.tensor(1.0), E4M3, True)
        assert q.data.float().tolist() == [448.0, -224.0] and amax.item() == 2.0

    def test_jit_tensor_decides_on_device(self):
        """A 0-d bool tensor chooses between own and given scale."""
        x = torch.tensor([2.0])
        b = EmulationBackend()
        q_true, _ = b.quantize(x, torch.tensor(1.0), E4M3, torch.tensor(True))
        q_false, _ = b.quantize(x, torch.tensor(1.0), E4M3, torch.tensor(False))
        assert q_true.data.float().item() == 448.0 and q_false.data.float().item() == 2.0

    def test_empty_tensor(self):
        """An empty tensor casts to an empty tensor with amax 0."""
        q, amax = EmulationBackend().quantize(torch.zeros(0, 4), torch.tensor(1.0), E4M3, True)
        assert q.shape == (0, 4) and amax.item() == 0.0

    def test_nan_amax_reported(self):
        """A NaN input yields a NaN amax for the manager to handle."""
        _, amax = EmulationBackend().quantize(torch.tensor([1.0, float("nan")]), torch.tensor(1.0), E4M3, False)
        assert torch.isnan(amax)

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
    def test_dequantize_table_matches_torch_cast_bitwise(self, dtype):
        """The CPU table path gives torch's own cast, for all 256 codes, plain and transposed."""
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
        scale_inv = torch.tensor(0.37)
        for data in (codes, codes.t()):
            got = EmulationBackend().dequantize(Quantized(data, scale_inv))
            want = data.float() * scale_inv
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(torch.isnan(got), torch.isnan(want))


class TestScaledMM:
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_agrees_with_emulation(self, out_dtype, with_bias):
        """torch._scaled_mm matches the emulation within 1e-5 relative (fp32) / 1 bf16 ulp."""
        a_hp, b_hp = torch.randn(64, 96), torch.randn(48, 96)
        emu = EmulationBackend()
        qa, _ = emu.quantize(a_hp, torch.tensor(1.0), E4M3, True)
        qb, _ = emu.quantize(b_hp, torch.tensor(1.0), E4M3, True)
        bias = torch.randn(48, dtype=out_dtype) if with_bias else None
        ref = emu.scaled_mm(qa, qb.t(), out_dtype=out_dtype, bias=bias).float()
        got = ScaledMMBackend().scaled_mm(qa, qb.t(), out_dtype=out_dtype, bias=bias).float()
        tol = 1e-5 if out_dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())

    def test_mixed_formats(self):
        """E5M2 x E4M3 (the backward products) works on CPU."""
        emu = EmulationBackend()
        qa, _ = emu.quantize(torch.randn(8, 16), torch.tensor(1.0), E5M2, True)
        qb, _ = emu.quantize(torch.randn(16, 4), torch.tensor(1.0), E4M3, True)
        ref = emu.scaled_mm(qa, qb, out_dtype=torch.float32)
        torch.testing.assert_close(ScaledMMBackend().scaled_mm(qa, qb, out_dtype=torch.float32), ref)

    def test_cpu_availability_reason(self):
        """Available on CPU in this torch, with a reason naming it."""
        ok, reason = ScaledMMBackend().available(torch.device("cpu"))
        assert ok and "CPU" in reason

    def test_cuda_layout(self):
        """cuBLASLt's rules: layouts made, odd dimensions zero-padded (the product is unchanged)."""
        e5 = torch.zeros(16, 16, dtype=torch.float8_e5m2)
        with pytest.raises(BackendUnavailableError, match="two E5M2"):
            _cuda_layout(e5, e5)
        a = torch.randn(20, 24).to(torch.float8_e4m3fn)
        b = torch.randn(40, 24).to(torch.float8_e4m3fn).t()
        pa, pb = _cuda_layout(a, b)
        assert pa.shape == (20, 32) and pb.shape == (32, 48)
        assert pa.is_contiguous() and pb.t().is_contiguous()
        one = torch.tensor(1.0)
        want = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        got = torch._scaled_mm(pa, pb, scale_a=one, scale_b=one, out_dtype=torch.float32)[:, :40]
        assert torch.equal(got, want)

    def test_dequantize_inherited(self):
        """The scaled_mm backend keeps the emulation's dequantize."""
        q = Quantized(torch.tensor([2.0]).to(torch.float8_e4m3fn), torch.tensor(0.5))
        assert ScaledMMBackend().dequantize(q).item() == 1.0

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message; a GPU is present")
    def test_cuda_unavailable_reason(self):
        """Asking for CUDA without a GPU says so."""
        ok, reason = ScaledMMBackend().available(torch.device("cuda"))
        assert not ok and "CUDA" in reason
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            resolve_backend("scaled_mm", torch.device("cuda"))
