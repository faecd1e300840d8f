"""NVFP4 products on the ``scaled_mm`` backend: the operand and scale layouts torch's checks ask for
(run on the meta device, where torch applies its CUDA checks), refusals naming the hardware, and the
product itself where a Blackwell GPU runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scalestate as ss
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.layout import nvfp4_args, swizzle_32_4_4
from scalestate.errors import BackendUnavailableError
from scalestate.nvfp4 import quantize_nvfp4

SHAPES = [(32, 64, 48), (17, 40, 33), (128, 256, 128), (5, 7, 3), (200, 96, 130)]


def _on_meta(value: object) -> object:
    """The same tensors (shapes, strides, dtypes) on the meta device, where torch's CUDA checks run."""
    if isinstance(value, list):
        return [_on_meta(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _operands(m: int, k: int, n: int, two_d: bool) -> tuple[ss.Quantized, ss.Quantized]:
    gen = torch.Generator().manual_seed(m * k + n)
    a = quantize_nvfp4(torch.randn(m, k, generator=gen)).quantized
    b = quantize_nvfp4(torch.randn(n, k, generator=gen), two_d=two_d).quantized.t()
    return a, b


class TestLayout:
    @pytest.mark.parametrize("two_d", [False, True])
    @pytest.mark.parametrize(("m", "k", "n"), SHAPES)
    def test_passes_torchs_checks(self, m, k, n, two_d):
        """The arguments satisfy torch's own checks of an NVFP4 product (row-major a, column-major b,
        multiples of 16 bytes, swizzled E4M3 block scales of the padded sizes, float32 second levels)."""
        a, b = _operands(m, k, n, two_d)
        args, kwargs = nvfp4_args(a, b)
        out = F.scaled_mm(*[_on_meta(x) for x in args], **kwargs, output_dtype=torch.bfloat16)
        assert out.shape[0] == m and out.shape[1] == n + (-n % 16)

    def test_torchs_checks_are_live(self):
        """Not vacuous: scales without the swizzle's padding fail the same checks."""
        a, b = _operands(17, 40, 33, False)
        args, kwargs = nvfp4_args(a, b)
        bad = list(args)
        bad[2] = [a.scale_inv.reshape(-1), a.primary.tensor_scale_inv.reshape(1)]
        with pytest.raises(RuntimeError, match="NV scaling"):
            F.scaled_mm(*[_on_meta(x) for x in bad], **kwargs, output_dtype=torch.bfloat16)

    def test_swizzled_e4m3_positions(self):
        """Block scale (r, c) of a 200 x 7 grid lands at tile * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4
        (tiles of 128 x 4, row-major); the padding is E4M3 zero, not byte 127 (NaN in E4M3)."""
        rows, cols = 200, 7
        codes = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols) % 120 + 1
        flat = swizzle_32_4_4(codes.to(torch.uint8).view(torch.float8_e4m3fn)).view(torch.uint8)
        assert flat.numel() == 256 * 8
        tiles_per_row = 2
        for r in range(rows):
            for c in range(cols):
                tile = (r // 128) * tiles_per_row + c // 4
                assert flat[tile * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4] == codes[r, c]
        assert int((flat == 0).sum()) == 256 * 8 - rows * cols

    def test_weight_blocks_repeat_down_their_rows(self):
        """16 x 16 weight blocks give each of their 16 rows the block's scale (the kernel takes 1 x 16)."""
        a, b = _operands(16, 64, 40, True)
        args, _ = nvfp4_args(a, b)
        s = b.primary.scale_inv.view(torch.uint8)  # (3, 4): 40 rows in blocks of 16
        row_scales = s.repeat_interleave(16, dim=0)[:40]
        assert torch.equal(args[4][0].view(torch.uint8), swizzle_32_4_4(row_scales.view(s.dtype)).view(torch.uint8))

    def test_operands_in_another_orientation_are_refused(self):
        a, b = _operands(16, 32, 16, False)
        with pytest.raises(BackendUnavailableError, match="stored along K"):
            nvfp4_args(a.t(), b)


class TestWhereItRuns:
    def test_cpu_is_refused_naming_the_hardware(self):
        ok, why = ScaledMMBackend().supports(ss.NVFP4Scaling(), "cpu")
        assert not ok and "sm100+ GPU (Blackwell)" in why and 'fallback="emulation"' in why
        ok, why = ScaledMMBackend(fallback="emulation").supports(ss.NVFP4Scaling(), "cpu")
        assert ok and "fall back to emulation" in why

    def test_a_manager_refuses_at_binding(self):
        with pytest.raises(BackendUnavailableError, match=r"sm100\+ GPU"):
            ss.ScalingStateManager(ss.NVFP4Scaling(), backend="scaled_mm", device="cpu")

    def test_fallback_products_are_the_emulations(self):
        """With fallback="emulation", a layer's outputs and gradients are bitwise the emulation backend's."""
        results = []
        for backend in ("emulation", ScaledMMBackend(fallback="emulation")):
            torch.manual_seed(0)
            m = ss.ScalingStateManager(ss.NVFP4Scaling(), backend=backend)
            layer = ss.nn.Linear(32, 48, manager=m, name="fc")
            x = torch.randn(24, 32, requires_grad=True)
            with m.forward():
                y = layer(x)
            with m.backward():
                y.square().sum().backward()
            results.append((y.detach(), x.grad, layer.weight.grad))
        for got, want in zip(results[1], results[0], strict=True):
            assert torch.equal(got, want)


def _blackwell() -> str | None:
    if not torch.cuda.is_available():
        return "needs an sm100+ GPU (Blackwell); no CUDA device is visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        return f"needs an sm100+ GPU (Blackwell) for torch's NVFP4 kernel; found sm{major}{minor}"
    return None


@pytest.mark.skipif(_blackwell() is not None, reason=_blackwell() or "")
@pytest.mark.parametrize("two_d", [False, True])
def test_product_on_blackwell_matches_emulation(two_d):
    """torch's NVFP4 kernel against the emulated product of the same operands (accumulation order differs)."""
    a, b = _operands(256, 512, 384, two_d)
    a, b = (ss.Quantized.unflatten(tuple(t.cuda() for t in q.flatten()[0]), q.flatten()[1]) for q in (a, b))
    got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32)
    want = ss.backends.get_backend("emulation").scaled_mm(a, b, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
