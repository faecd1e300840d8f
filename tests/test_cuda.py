"""On a CUDA GPU: both backends, bitwise checkpoint parity, and no host-device sync.

Skipped on machines without a CUDA GPU (the skip reason says so); the rest of
the suite covers the same behaviour on CPU.
"""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from helpers import assert_bitwise, backend_for, train
from scalestate.errors import BackendUnavailableError
from scalestate.testing import sqnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible to torch")

SM89 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_sm89 = pytest.mark.skipif(not SM89, reason="torch._scaled_mm on CUDA needs an sm89+ GPU (Ada, Hopper)")
GPU_BACKENDS = ["emulation", pytest.param("scaled_mm", marks=needs_sm89)]


class TestBackendsOnCuda:
    @needs_sm89
    def test_auto_picks_the_kernels(self):
        """On an sm89+ GPU, 'auto' picks the cuda backend (Triton's kernels) when Triton imports,
        else scaled_mm."""
        import importlib.util

        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="auto", device="cuda")
        assert m.backend.name == ("cuda" if importlib.util.find_spec("triton") else "scaled_mm")

    @pytest.mark.parametrize("backend", GPU_BACKENDS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_linear_sqnr(self, backend, dtype):
        """FP8 Linear on the GPU: output >= 25 dB, gradients >= 20 dB against fp32."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend)
        ref = torch.nn.Linear(256, 128, device="cuda", dtype=dtype)
        fp8 = ss.nn.Linear(256, 128, manager=m, device="cuda", dtype=dtype)
        fp8.load_state_dict(ref.state_dict())
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda", dtype=dtype)
            g = torch.randn(64, 128, device="cuda", dtype=dtype)
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref(x1).backward(g)
            with m.forward():
                y = fp8(x2)
            with m.backward():
                y.backward(g)
            assert m.device.type == "cuda"
            assert sqnr(ref(x1), y) >= 25.0
            assert sqnr(x1.grad, x2.grad) >= 20.0 and sqnr(ref.weight.grad, fp8.weight.grad) >= 20.0
            ref.zero_grad()
            fp8.zero_grad()
            m.step()

    @needs_sm89
    @pytest.mark.parametrize(
        ("n_in", "n_out", "tokens"),
        [(128, 64, 32), (24, 40, 20)],
        ids=["aligned", "odd_shapes_padded"],
    )
    def test_scaled_mm_agrees_with_emulation(self, n_in, n_out, tokens):
        """cuBLASLt FP8 products match the float32 emulation within 1e-3 relative, odd
        dimensions (not multiples of 16, padded internally) included."""
        results = []
        for backend in ("emulation", "scaled_mm"):
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend)
            torch.manual_seed(0)
            layer = ss.nn.Linear(n_in, n_out, manager=m, device="cuda")
            x = torch.randn(tokens, n_in, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            x.requires_grad_()
            y = layer(x)
            y.square().sum().backward()
            results.append((y.detach(), x.grad, layer.weight.grad))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3 * a.abs().max().item())

    @needs_sm89
    def test_two_e5m2_operands_error(self):
        """E5M2 x E5M2 cannot run on cuBLASLt: the error says what to do."""
        m2 = ss.ScalingStateManager(ss.DelayedScaling(format=ss.Format.E5M2), backend="scaled_mm")
        layer2 = ss.nn.Linear(32, 32, manager=m2, device="cuda")
        with pytest.raises(BackendUnavailableError, match="two E5M2"):
            layer2(torch.randn(16, 32, device="cuda"))


class TestParityOnCuda:
    @pytest.mark.parametrize("backend", GPU_BACKENDS)
    @pytest.mark.parametrize("mechanism", ["non_reentrant", "reentrant", "selective"])
    def test_checkpoint_parity(self, recipe, backend, mechanism):
        """Every block checkpointed vs none, 5 steps on the GPU: bitwise equal."""
        backend = backend_for(recipe, backend)  # 1 x 8 tiles and MX on sm90: emulated products
        ref = train(recipe, backend, device="cuda")
        got = train(recipe, backend, device="cuda", mechanism=mechanism, granularity="block")
        assert_bitwise(ref, got)

    @pytest.mark.parametrize("backend", GPU_BACKENDS)
    def test_1f1b(self, backend):
        """1F1B with checkpointing on the GPU: bitwise equal to the plain loop."""
        recipe = ss.DelayedScaling(history_len=4)
        ref = train(recipe, backend, device="cuda", microbatches=4)
        got = train(recipe, backend, device="cuda", microbatches=4, schedule="1f1b",
                    mechanism="non_reentrant", granularity="block")
        assert_bitwise(ref, got)


class TestNoHostSync:
    @pytest.mark.parametrize("backend", GPU_BACKENDS)
    def test_forward_backward_step_never_sync(self, recipe, backend):
        """With CUDA sync debugging set to error, forward, recompute, backward and step() run clean."""
        from helpers import Model

        m = ss.ScalingStateManager(recipe, backend=backend_for(recipe, backend))
        model = Model(m, mechanism="non_reentrant", granularity="block").cuda()
        xs = [torch.randn(2, 8, 32, device="cuda") * (i + 1) for i in range(3)]
        model(xs[0]).sum().backward()  # warm up: state moves to the GPU, kernels load
        m.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in xs:
                with m.forward():
                    y = model(x)
                with m.backward():
                    y.square().mean().backward()
                m.step()
                with torch.no_grad():
                    model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert m.iteration == 4


class TestDeviceOnCuda:
    def test_cuda_without_index(self):
        """device='cuda' means the current GPU: tensors on cuda:0 cast without a device error."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", device="cuda")
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with m.forward():
            h.quantize(torch.ones(4, device="cuda"), ss.Role.INPUT)
        m.step()
        assert m.device == torch.device("cuda", torch.cuda.current_device())

    def test_follows_first_cast_to_the_gpu(self):
        """With no device given, the state moves to the GPU at the first cast, values kept."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with m.forward():
            h.quantize(torch.full((4,), 2.0, device="cuda"), ss.Role.INPUT)
        m.step()
        assert m.device.type == "cuda" and h.amax_history(ss.Role.INPUT)[-1].item() == 2.0
