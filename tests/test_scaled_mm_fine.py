"""scalestate.backends.scaled_mm with fine-grained operands: what runs in torch's kernels, what falls back.

On CPU (torch 2.13) the kernel takes per-tensor and row-wise scales; block-wise
and MX products raise, or with ``fallback="emulation"`` are the emulation's
products, bit for bit. The CUDA layouts are checked on ``meta`` tensors, which
torch's meta checks treat as CUDA ones; the few tests that need the GPU
kernels are at the end, skipped elsewhere with the hardware they need.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import scalestate as ss
from scalestate import backends as registry
from scalestate.backends import CastRequest, CastSpec, get_backend, resolve_backend, supports
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.layout import block_args, rowwise_args, swizzle_32_4_4
from scalestate.errors import BackendUnavailableError
from scalestate.finegrained import e8m0_to_float32
from scalestate.granularity import Granularity, GranularityKind
from scalestate.quantized import Quantized
from scalestate.testing import OpLog, registered_backend

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROW = Granularity(GranularityKind.ROW, 0, False)
TILE = Granularity(GranularityKind.TILE, 128, True)
BLOCK = Granularity(GranularityKind.BLOCK, 128, True)
MX = Granularity(GranularityKind.MX, 32, True)
FINE = {
    "rowwise": ss.RowwiseScaling(),
    "block": ss.BlockScaling(),
    "mx": ss.MXFP8Scaling(),
}
#: Shapes with partial tiles and blocks at every edge, and whole ones.
SHAPES = [(7, 13, 5), (64, 96, 48), (130, 257, 129), (256, 512, 384)]
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
U = 2.0**-24  # float32 unit roundoff


class _ScaledMMOnCPU(ScaledMMBackend):
    """scaled_mm answering availability and support as on the CPU, whatever device it is asked about."""

    def available(self, device=None):
        return super().available(CPU)

    def supports(self, recipe, device=None):
        return super().supports(recipe, CPU)


class _Unavailable(EmulationBackend):
    def available(self, device=None):
        return False, "not here"


def cast(x, g, dtype=E4M3) -> Quantized:
    """``x`` cast in both orientations by the emulation backend, as ``ss.nn.Linear`` asks for fine recipes."""
    spec = CastSpec(dtype, 448.0 if dtype == E4M3 else 57344.0, granularity=g)
    return EmulationBackend().cast(CastRequest(x, spec, torch.tensor(1.0), True, None, True))


def operands(kind, m, k, n, dtype_a=E4M3):
    """The forward product's operands of a linear layer: ``x`` (m, k) along k, the weight (n, k) transposed."""
    x, w = torch.randn(m, k) * 3, torch.randn(n, k)
    ga, gb = {"rowwise": (ROW, ROW), "block": (TILE, BLOCK), "tiles": (TILE, TILE), "mx": (MX, MX)}[kind]
    return cast(x, ga, dtype_a).rowwise(), cast(w, gb).rowwise().t()


def bound(a: Quantized, b: Quantized) -> torch.Tensor:
    """How far two float32 products of the same FP8 operands may differ, elementwise.

    Each sum of ``K`` float32 terms, in any order (sequential, blocked, pairwise),
    lies within ``gamma(K) * sum |a_ik b_kj|`` of the exact sum, with
    ``gamma(n) = n u / (1 - n u)`` (the standard bound for floating-point
    summation). Forming each term from the FP8 data and the scales adds at most
    two roundings per term (``data * scale_inv`` rounded, the product rounded;
    or the scales applied to the sum), hence ``gamma(K + 2)``. Two results each
    within that of the exact sum are within twice that of each other.
    """
    k = a.shape[1]
    gamma = (k + 2) * U / (1 - (k + 2) * U)
    return 2 * gamma * (a.dequantize().double().abs() @ b.dequantize().double().abs())


def assert_within(got, ref, tol):
    excess = (got.double() - ref.double()).abs() - tol
    assert bool((excess <= 0).all()), f"exceeds the bound by up to {excess.max().item():g}"


# ---------------------------------------------------------------- products on CPU


class TestRowwiseOnCPU:
    @pytest.mark.parametrize(("m", "k", "n"), SHAPES)
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_through_the_kernel_agrees_with_emulation(self, m, k, n, with_bias):
        """Row-wise products run in torch.nn.functional.scaled_mm and agree with the emulation within
        the float32 summation bound (bitwise in torch 2.13 on the CPUs measured, not asserted)."""
        a, b = operands("rowwise", m, k, n)
        bias = torch.randn(n) if with_bias else None
        calls = []
        real = F.scaled_mm

        def spy(*args, **kwargs):
            calls.append(args[3])
            return real(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(F, "scaled_mm", spy)
            got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
        ref = EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
        assert calls == [F.ScalingType.RowWise]
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert_within(got, ref, bound(a, b))

    @pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
    def test_low_precision_outputs(self, out_dtype):
        """The product is taken in float32, the bias added, and rounded once, as in the emulation:
        at most one rounding step of the output dtype apart, where the float32 sums differ."""
        a, b = operands("rowwise", 48, 200, 40)
        bias = torch.randn(40, dtype=out_dtype)
        got = ScaledMMBackend().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        ref = EmulationBackend().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        ulp = ref.float().abs() * torch.finfo(out_dtype).eps
        assert got.dtype == out_dtype
        assert_within(got, ref, bound(a, b) + ulp.double())

    def test_mixed_formats(self):
        """E5M2 times E4M3 (the backward products of Format.HYBRID) runs too."""
        a, b = operands("rowwise", 16, 64, 8, dtype_a=E5M2)
        got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32)
        assert_within(got, EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32), bound(a, b))

    def test_per_tensor_kernel_with_scales_applied_after(self, monkeypatch):
        """Where the row-wise kernel is not used (CUDA outputs other than bfloat16, torch without
        torch.nn.functional.scaled_mm), the per-tensor kernel multiplies the data with unit scales and
        the row and column scales are applied to its float32 result: also within the bound."""
        import scalestate.backends.scaled_mm.capability as module

        monkeypatch.setattr(module, "cpu_runs_functional", lambda: False)
        a, b = operands("rowwise", 33, 300, 17)
        bias = torch.randn(17)
        got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
        ref = EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
        assert_within(got, ref, bound(a, b))

    def test_short_tiles_are_rows(self):
        """1 x 128 tiles along a K of at most 128 are one scale per row: they run in the row-wise kernel."""
        a, b = operands("tiles", 9, 100, 11)
        got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32)
        assert_within(got, EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32), bound(a, b))

    def test_empty_product(self):
        """K = 0 (or M, N = 0): zeros plus the bias, without a kernel."""
        a = cast(torch.randn(4, 0), ROW).rowwise()
        b = cast(torch.randn(3, 0), ROW).rowwise().t()
        bias = torch.randn(3)
        got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
        assert torch.equal(got, bias.expand(4, 3))


class TestBlockAndMXOnCPU:
    @pytest.mark.parametrize(
        ("kind", "words", "where"),
        [
            ("block", "1 x 128 tiles times 128 x 128 blocks", "sm90"),
            ("tiles", "1 x 128 tiles times 1 x 128 tiles", "sm90"),
            ("mx", "E8M0-scaled MX blocks of 32 times E8M0-scaled MX blocks of 32", "sm100"),
        ],
    )
    def test_raises_without_fallback(self, kind, words, where):
        """The error names the granularity, the device and what would run it (GPU, fallback, emulation)."""
        a, b = operands(kind, 130, 257, 129)
        with pytest.raises(BackendUnavailableError) as info:
            ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.float32)
        message = str(info.value)
        for part in (words, "CPU", where, 'ScaledMMBackend(fallback="emulation")', 'backend="emulation"'):
            assert part in message, (part, message)

    @pytest.mark.parametrize(
        ("kind", "m", "k", "n"),
        # 1 x 128 tiles times 1 x 128 tiles along a K of at most 128 are row-wise (test_short_tiles_are_rows)
        [(kind, *shape) for kind in ("block", "tiles", "mx") for shape in SHAPES if kind != "tiles" or shape[1] > 128],
    )
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    def test_fallback_is_the_emulation(self, kind, m, k, n, out_dtype):
        """With fallback="emulation" the product is the emulation backend's, bit for bit, and no kernel runs."""
        a, b = operands(kind, m, k, n)
        bias = torch.randn(n, dtype=out_dtype)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(F, "scaled_mm", _forbidden)
            mp.setattr(torch, "_scaled_mm", _forbidden)
            got = ScaledMMBackend(fallback="emulation").scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        ref = EmulationBackend().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        assert torch.equal(got, ref)

    def test_other_tile_sizes_name_what_torch_takes(self):
        """1 x 64 tiles: no torch kernel at all; the message says which tiles torch takes."""
        x, w = torch.randn(8, 200), torch.randn(16, 200)
        g64, b64 = Granularity(GranularityKind.TILE, 64, True), Granularity(GranularityKind.BLOCK, 64, True)
        with pytest.raises(BackendUnavailableError, match="1 x 64 tiles times 64 x 64 blocks") as info:
            ScaledMMBackend().scaled_mm(cast(x, g64).rowwise(), cast(w, b64).rowwise().t(), out_dtype=torch.float32)
        assert "1 x 128 tiles and 128 x 128 blocks" in str(info.value)

    def test_per_tensor_times_fine(self):
        """Mixed granularities do not run in one kernel."""
        qa = EmulationBackend().cast(CastRequest(torch.randn(4, 8), CastSpec(E4M3, 448.0), torch.tensor(1.0), True))
        b = cast(torch.randn(3, 8), ROW).rowwise().t()
        with pytest.raises(BackendUnavailableError, match="a per-tensor scale times row-wise scales"):
            ScaledMMBackend().scaled_mm(qa, b, out_dtype=torch.float32)
        ref = EmulationBackend().scaled_mm(qa, b, out_dtype=torch.float32)
        assert torch.equal(ScaledMMBackend(fallback="emulation").scaled_mm(qa, b, out_dtype=torch.float32), ref)


def _forbidden(*args, **kwargs):
    raise AssertionError("a kernel ran where the emulation was expected")


# ---------------------------------------------------------------- the CUDA layouts, checked on meta tensors


def _on_meta(q: Quantized) -> Quantized:
    """``q`` on the meta device, strides kept (torch's meta checks apply the CUDA rules to meta tensors)."""
    return Quantized(q.data.to("meta"), scale=q.scale.to("meta"), scale_inv=q.scale_inv.to("meta"), tile=q.tile)


def _interpret(args, kwargs) -> torch.Tensor:
    """The float32 product the arguments of ``torch.nn.functional.scaled_mm`` stand for, read with the
    conventions of torch's meta checks (shapes and strides of each ScalingType), on CPU."""
    a_data, b_data, sa, ta, sb, tb = args
    st = F.ScalingType
    m, k = a_data.shape
    n = b_data.shape[1]
    rows_k = torch.arange(k) // (32 if ta == st.BlockWise1x32 else 128)
    if ta == st.BlockWise1x32:
        fa = _unswizzle(sa, m, -(-k // 32))[:, rows_k]
        fb = _unswizzle(sb, n, -(-k // 32))[:, rows_k].t()
    else:
        # 1 x 128: a's (M, K/128) read [m, kb]; 128 x 128: (L4, M/128) read [kb, mb]
        fa = sa[:, rows_k] if ta == st.BlockWise1x128 else sa[rows_k][:, torch.arange(m) // 128].t()
        # 1 x 128: b's (N, K/128) read [n, kb]; 128 x 128: (L4, N/128) read [kb, nb]
        fb = sb[:, rows_k].t() if tb == st.BlockWise1x128 else sb[rows_k][:, torch.arange(n) // 128]
    return (a_data.float() * fa) @ (b_data.float() * fb)


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) float32 scales of a 32x4x4-swizzled E8M0 tensor, from the layout's formula."""
    tiles_c = -(-cols // 4)
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    offset = ((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return e8m0_to_float32(flat)[offset]


#: torch's block-wise and MX pairs of scaling types, with the granularities that make them.
PAIRS = {
    "1x128-128x128": ((GranularityKind.TILE, GranularityKind.BLOCK), (TILE, BLOCK)),
    "1x128-1x128": ((GranularityKind.TILE, GranularityKind.TILE), (TILE, TILE)),
    "128x128-1x128": ((GranularityKind.BLOCK, GranularityKind.TILE), (BLOCK, TILE)),
    "1x32-1x32": ((GranularityKind.MX, GranularityKind.MX), (MX, MX)),
}


class TestCudaLayouts:
    @pytest.mark.parametrize("pair", sorted(PAIRS))
    @pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), *SHAPES])
    def test_meta_checks_accept_the_arguments(self, pair, m, k, n):
        """Data and scales as laid out for CUDA pass torch's checks (run on meta tensors, as CUDA ones),
        partial tiles and blocks included; the output is cut back to (m, n)."""
        kinds, (ga, gb) = PAIRS[pair]
        a = cast(torch.randn(m, k), ga).rowwise()
        b = cast(torch.randn(n, k), gb).rowwise().t()
        args, kwargs = block_args(kinds, _on_meta(a), _on_meta(b))
        out = F.scaled_mm(*args, **kwargs, output_dtype=torch.bfloat16)
        assert out.shape[0] >= m and out.shape[1] >= n

    @pytest.mark.parametrize("pair", sorted(PAIRS))
    @pytest.mark.parametrize(("m", "k", "n"), SHAPES)
    def test_arguments_mean_the_emulated_product(self, pair, m, k, n):
        """Read back with those conventions, the padded data and laid-out scales give the emulation's
        product (within the float32 summation bound: padding changes the sums' blocking)."""
        kinds, (ga, gb) = PAIRS[pair]
        a = cast(torch.randn(m, k), ga).rowwise()
        b = cast(torch.randn(n, k), gb).rowwise().t()
        got = _interpret(*block_args(kinds, a, b))[:m, :n]
        ref = EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32)
        assert_within(got, ref, bound(a, b))

    @pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), *SHAPES])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_rowwise_arguments(self, m, k, n, with_bias):
        """The row-wise kernel's arguments on CUDA (bfloat16 out) pass the checks, and mean the product."""
        a, b = operands("rowwise", m, k, n)
        bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
        args, kwargs = rowwise_args(_on_meta(a), _on_meta(b), None if bias is None else bias.to("meta"))
        assert F.scaled_mm(*args, **kwargs).shape == (m, -(-n // 16) * 16)
        (a_data, b_data, sa, _, sb, _), kwargs = rowwise_args(a, b, bias)
        got = ((a_data.float() * sa) @ (b_data.float() * sb))[:, :n]
        assert_within(got, EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32), bound(a, b))
        if with_bias:
            assert torch.equal(kwargs["bias"][:n], bias) and not kwargs["bias"][n:].any()

    def test_weight_gradient_operand_layout(self):
        """The input-gradient product's weight (the columnwise orientation, scales row-major) passes too."""
        w = cast(torch.randn(200, 96), BLOCK)
        a = cast(torch.randn(24, 200), TILE).rowwise()
        b = w.columnwise().t()
        pair = (GranularityKind.TILE, GranularityKind.BLOCK)
        args, kwargs = block_args(pair, _on_meta(a), _on_meta(b))
        assert F.scaled_mm(*args, **kwargs, output_dtype=torch.bfloat16).shape == (24, 128)
        got = _interpret(*block_args(pair, a, b))[:, :96]
        assert_within(got, EmulationBackend().scaled_mm(a, b, out_dtype=torch.float32), bound(a, b))

    @pytest.mark.parametrize(("rows", "cols"), [(1, 1), (128, 4), (130, 5), (300, 9)])
    def test_swizzle_formula(self, rows, cols):
        """Entry (r, c) of the scales lands where cuBLAS's 32x4x4 layout puts it; padding is E8M0 one."""
        codes = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
        flat = swizzle_32_4_4(codes.view(torch.float8_e8m0fnu))
        assert flat.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
        assert torch.equal(_unswizzle(flat, rows, cols), e8m0_to_float32(codes.view(torch.float8_e8m0fnu)))
        padding = torch.ones(flat.numel(), dtype=torch.bool)
        tiles_c = -(-cols // 4)
        r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        padding[((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = False
        assert bool((flat.view(torch.uint8)[padding] == 127).all())


# ---------------------------------------------------------------- supports()


class TestSupports:
    @pytest.mark.parametrize(
        ("name", "plain", "with_fallback"),
        [("rowwise", True, True), ("block", False, True), ("mx", False, True)],
    )
    def test_cpu(self, name, plain, with_fallback):
        """On CPU in torch 2.13: per-tensor and row-wise run; block-wise and MX only through the fallback."""
        recipe = FINE[name]
        ok, reason = ScaledMMBackend().supports(recipe, "cpu")
        assert ok is plain and type(recipe).__name__ in reason and "CPU" in reason
        ok, reason = ScaledMMBackend(fallback="emulation").supports(recipe, CPU)
        assert ok is with_fallback
        assert ("falls back to emulation" in reason or "fall back to emulation" in reason) is (not plain)

    @pytest.mark.parametrize("recipe", [ss.DelayedScaling(), ss.CurrentScaling()])
    def test_per_tensor_where_available(self, recipe):
        assert ScaledMMBackend().supports(recipe, CPU) == ScaledMMBackend().available(CPU)

    def test_reasons_name_granularity_device_and_alternative(self):
        ok, reason = ScaledMMBackend().supports(ss.BlockScaling(), CPU)
        assert not ok
        for part in ("1 x 128 tiles", "128 x 128 blocks", "CPU", "sm90", "fallback=", "backend=\"emulation\""):
            assert part in reason, (part, reason)
        ok, reason = ScaledMMBackend().supports(ss.MXFP8Scaling(), CPU)
        assert not ok and "MX blocks of 32" in reason and "sm100" in reason

    def test_other_block_sizes_run_nowhere(self, monkeypatch):
        _fake_gpu(monkeypatch, (9, 0), "12.9")
        ok, reason = ScaledMMBackend().supports(ss.BlockScaling(block=64), "cuda")
        assert not ok and "1 x 64 tiles" in reason

    @pytest.mark.parametrize(
        ("capability", "cuda", "runs"),
        [
            ((8, 0), "12.9", {}),
            ((8, 9), "12.9", {"rowwise"}),
            ((9, 0), "12.4", {"rowwise"}),
            ((9, 0), "12.9", {"rowwise", "block"}),
            ((10, 0), "12.9", {"rowwise", "mx"}),
            ((12, 0), "12.9", {"rowwise", "mx"}),
        ],
    )
    def test_cuda_by_compute_capability(self, monkeypatch, capability, cuda, runs):
        """On CUDA, from the compute capability and the CUDA build, as torch's sources require:
        row-wise on sm89+, 1 x 128 / 128 x 128 on sm90 with CUDA 12.9+, MX on sm100+."""
        _fake_gpu(monkeypatch, capability, cuda)
        for name, recipe in FINE.items():
            ok, reason = ScaledMMBackend().supports(recipe, "cuda")
            assert ok is (name in runs), (name, reason)
            if capability >= (8, 9) and not ok:
                assert f"sm{capability[0]}{capability[1]}" in reason or f"CUDA {cuda}" in reason, reason
        assert ScaledMMBackend().supports(ss.DelayedScaling(), "cuda")[0] is (capability >= (8, 9))

    def test_cuda_two_e5m2_operands(self, monkeypatch):
        """Format.E5M2 gives two E5M2 operands in the weight-gradient product: cuBLASLt refuses them."""
        _fake_gpu(monkeypatch, (9, 0), "12.9")
        ok, reason = ScaledMMBackend().supports(ss.RowwiseScaling(format=ss.Format.E5M2), "cuda")
        assert not ok and "two E5M2" in reason
        assert ScaledMMBackend().supports(ss.RowwiseScaling(format=ss.Format.HYBRID), "cuda")[0]

    def test_emulation_supports_everything(self):
        for recipe in [ss.DelayedScaling(), *FINE.values()]:
            assert EmulationBackend().supports(recipe, CPU)[0]

    def test_no_tensor_operations(self):
        """supports() is answered from the device and the build: no tensor operation runs."""
        backend = ScaledMMBackend(fallback="emulation")
        with OpLog() as log:
            for recipe in [ss.DelayedScaling(), *FINE.values()]:
                backend.supports(recipe, CPU)
        assert log.ops == []

    def test_module_function_without_the_method(self):
        """A backend without supports(): per-tensor recipes where available, fine-grained ones refused."""

        class Plain:
            name = "plain"

            def available(self, device=None):
                return True, "runs"

            def cast(self, request):
                raise NotImplementedError

            def wants_transposed(self, device):
                return False

            def scaled_mm(self, a, b, *, out_dtype, bias=None):
                raise NotImplementedError

            def update(self, update):
                raise NotImplementedError

        assert isinstance(Plain(), registry.Backend)  # the runtime check does not ask for supports()
        assert not isinstance(Plain(), registry.SupportsRecipe)
        assert supports(Plain(), ss.DelayedScaling(), "cpu") == (True, "runs")
        ok, reason = supports(Plain(), ss.BlockScaling(), "cpu")
        assert not ok and "no supports() method" in reason and "BlockScaling" in reason and "1 x 128 tiles" in reason
        assert supports(ScaledMMBackend(), ss.MXFP8Scaling(), "cpu") == ScaledMMBackend().supports(
            ss.MXFP8Scaling(), "cpu"
        )


def _fake_gpu(monkeypatch, capability, cuda_version):
    """Make torch report a CUDA GPU of ``capability``, built for ``cuda_version`` (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.version, "hip", None)


# ---------------------------------------------------------------- the constructor


class TestConstructor:
    def test_default_and_registry(self):
        assert ScaledMMBackend().fallback is None
        assert registry.get_backend("scaled_mm").fallback is None  # type: ignore[attr-defined]
        assert ScaledMMBackend(fallback="emulation").fallback == "emulation"
        assert repr(ScaledMMBackend(fallback="emulation")) == "ScaledMMBackend(fallback='emulation')"

    def test_bad_values(self):
        with pytest.raises(TypeError, match="fallback must be None or the string 'emulation'"):
            ScaledMMBackend(fallback=True)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="fallback must be None or 'emulation'; got 'eager'"):
            ScaledMMBackend(fallback="eager")  # type: ignore[arg-type]


# ---------------------------------------------------------------- managers


class TestManagers:
    @pytest.mark.parametrize("name", ["block", "mx"])
    def test_bound_manager_fails_early(self, name):
        """A manager whose backend does not run its recipe on its device fails when bound, with the reason."""
        with pytest.raises(BackendUnavailableError, match="does not support") as info:
            ss.ScalingStateManager(FINE[name], backend="scaled_mm", device="cpu")
        assert type(FINE[name]).__name__ in str(info.value) and "fallback=" in str(info.value)

    def test_fails_at_the_first_cast_without_a_device(self):
        """Without a device, the binding (and so the check) happens at the first cast, before any cast runs."""
        m = ss.ScalingStateManager(ss.BlockScaling(), backend=ScaledMMBackend())
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with pytest.raises(BackendUnavailableError, match="1 x 128 tiles"):
            h.quantize(torch.randn(4, 8), ss.Role.INPUT)

    @pytest.mark.parametrize("name", sorted(FINE))
    def test_supported_combinations_bind(self, name):
        ss.ScalingStateManager(FINE[name], backend=ScaledMMBackend(fallback="emulation"), device="cpu")
        ss.ScalingStateManager(FINE[name], backend="emulation", device="cpu")
        ss.ScalingStateManager(ss.DelayedScaling(), backend="scaled_mm", device="cpu")

    def test_resolve_backend_checks_the_recipe(self):
        with pytest.raises(BackendUnavailableError, match="does not support MXFP8Scaling"):
            resolve_backend("scaled_mm", CPU, recipe=ss.MXFP8Scaling())
        assert resolve_backend("scaled_mm", CPU, recipe=ss.RowwiseScaling()).name == "scaled_mm"

    def test_auto_skips_backends_without_support(self, caplog):
        """'auto' passes over a backend that does not run the recipe on the device, and says why.

        'auto' on CPU asks only the emulation backend, so the test asks it for a CUDA device, whose
        order is cuda, scaled_mm, emulation: 'cuda' is replaced by scaled_mm answering as on this CPU, the real
        scaled_mm is replaced by an unavailable one (so that no GPU changes the answers).
        """
        with (
            registered_backend("cuda", _ScaledMMOnCPU, replace=True),
            registered_backend("scaled_mm", _Unavailable, replace=True),
        ):
            with caplog.at_level(logging.INFO, logger="scalestate"):
                assert resolve_backend("auto", CUDA, recipe=ss.BlockScaling()).name == "emulation"
            assert "backend='auto' chose 'emulation'" in caplog.text
            assert resolve_backend("auto", CUDA, recipe=ss.RowwiseScaling()).name == "scaled_mm"
            assert resolve_backend("auto", CUDA, recipe=ss.DelayedScaling()).name == "scaled_mm"

    def test_auto_error_names_the_recipe(self):
        """When no backend runs the recipe, the error names the recipe and each backend's reason."""
        with (
            registered_backend("cuda", _ScaledMMOnCPU, replace=True),
            registered_backend("scaled_mm", _Unavailable, replace=True),
            registered_backend("emulation", _ScaledMMOnCPU, replace=True),
            pytest.raises(BackendUnavailableError) as info,
        ):
            resolve_backend("auto", CUDA, recipe=ss.MXFP8Scaling())
        message = str(info.value)
        assert message.startswith("no backend can run MXFP8Scaling on cuda: cuda: ")
        assert "scaled_mm: not here" in message and message.count("MX") >= 3
        assert type(get_backend("emulation")) is EmulationBackend  # the built-ins are back

    def test_moving_checks_again(self):
        """manager.to(device) binds again, and checks the recipe there."""
        m = ss.ScalingStateManager(ss.RowwiseScaling(), backend="scaled_mm", device="cpu")
        m.to("cpu")
        assert m.backend.name == "scaled_mm"


# ---------------------------------------------------------------- ss.nn.Linear


class _Recorder(ScaledMMBackend):
    """Checks every product against the emulation's product of the same operands, within the bound."""

    def __init__(self) -> None:
        super().__init__(fallback="emulation")

    def scaled_mm(self, a, b, *, out_dtype, bias=None):
        got = super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        ref = EmulationBackend.scaled_mm(self, a, b, out_dtype=out_dtype, bias=bias)
        assert_within(got, ref, bound(a, b) + (0 if out_dtype == torch.float32 else ref.float().abs().double()
                                                 * torch.finfo(out_dtype).eps))
        return got


class TestLinear:
    @pytest.mark.parametrize("name", sorted(FINE))
    def test_forward_backward(self, name):
        """ss.nn.Linear under ScaledMMBackend(fallback="emulation"): row-wise products run in the kernel and
        agree with the emulation within the summation bound; block-wise and MX products are the emulation's,
        so the whole step is bitwise the emulation backend's."""
        recipe = FINE[name]
        results = []
        kernel = []
        real = F.scaled_mm

        def spy(*args, **kwargs):
            kernel.append(args[3])
            return real(*args, **kwargs)

        for backend in (EmulationBackend(), _Recorder()):
            m = ss.ScalingStateManager(recipe, backend=backend)
            torch.manual_seed(0)
            layer = ss.nn.Linear(160, 72, manager=m, name="fc")
            # 160 tokens: more than one 1 x 128 tile along every contraction dimension of a 1 x 128 operand
            # (the weight-gradient product of up to 128 tokens would be row-wise, and run in the kernel)
            x = torch.randn(2, 80, 160, generator=torch.Generator().manual_seed(1), requires_grad=True)
            upstream = torch.randn(2, 80, 72, generator=torch.Generator().manual_seed(2))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(F, "scaled_mm", spy)
                with m.forward():
                    y = layer(x)
                with m.backward():
                    (y * upstream).sum().backward()
            m.step()
            results.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
        assert kernel == ([F.ScalingType.RowWise] * 3 if name == "rowwise" else [])
        for ref, got in zip(*results, strict=True):
            if name == "rowwise":  # each already checked against the bound, product by product
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            else:
                assert torch.equal(got, ref)


# ---------------------------------------------------------------- on the GPU kernels (skipped elsewhere)

_CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
_CUDA_BUILD = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])


@pytest.mark.skipif(_CAP < (8, 9), reason="needs an sm89+ CUDA GPU (Ada, Hopper, Blackwell)")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_rowwise(out_dtype):
    a, b = operands("rowwise", 100, 300, 72)
    a, b = _to_cuda(a), _to_cuda(b)
    got = ScaledMMBackend().scaled_mm(a, b, out_dtype=out_dtype).float().cpu()
    ref = EmulationBackend().scaled_mm(a, b, out_dtype=out_dtype).float().cpu()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@pytest.mark.skipif(
    _CAP[0] != 9 or _CUDA_BUILD < (12, 9), reason="needs an sm90 GPU (Hopper) and torch built for CUDA 12.9+"
)
@pytest.mark.parametrize("kind", ["block", "tiles"])
def test_cuda_blockwise(kind):
    a, b = operands(kind, 130, 257, 129)
    a, b = _to_cuda(a), _to_cuda(b)
    got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.bfloat16).float().cpu()
    ref = EmulationBackend().scaled_mm(a, b, out_dtype=torch.bfloat16).float().cpu()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@pytest.mark.skipif(_CAP < (10, 0), reason="needs an sm100+ GPU (Blackwell) for MXFP8 products")
def test_cuda_mx():
    a, b = operands("mx", 130, 257, 129)
    a, b = _to_cuda(a), _to_cuda(b)
    got = ScaledMMBackend().scaled_mm(a, b, out_dtype=torch.bfloat16).float().cpu()
    ref = EmulationBackend().scaled_mm(a, b, out_dtype=torch.bfloat16).float().cpu()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def _to_cuda(q: Quantized) -> Quantized:
    return Quantized(q.data.cuda(), scale=q.scale.cuda(), scale_inv=q.scale_inv.cuda(), tile=q.tile)
