"""scalestate.backends.emulation_cpu: table lookups and reused buffers give the plain operations' bits,
and an FP8 layer's eager step asks the allocator for no more large blocks than a float32 layer's."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import scalestate as ss
from scalestate.backends import CastRequest, CastSpec
from scalestate.backends.emulation import SAVED_COPY_BYTES, EmulationBackend
from scalestate.backends.emulation_cpu import (
    CLAMP_CHECK_MIN_NUMEL,
    PAIRED_MIN_NUMEL,
    SCRATCH_MIN_NUMEL,
    CodeTables,
    Scratch,
    dequantize_into,
    gather,
    host_abs_max,
    quiet,
    readable,
    saturate,
)
from scalestate.backends.emulation_kept import KeptCopies
from scalestate.math import abs_max
from scalestate.quantized import Quantized
from scalestate.testing import OpLog, assert_same

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Float32 values as their bit patterns: NaNs compare by payload and sign too."""
    return t.contiguous().view(torch.int32)


def every_code(dtype: torch.dtype, rows: int = 1040) -> torch.Tensor:
    """Every one of the 256 codes (NaNs included), ``rows`` times over, as a (rows, 256) tensor."""
    return torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(dtype)


class TestGather:
    @pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
    @pytest.mark.parametrize("layout", ["rows", "transposed", "odd_count", "odd_offset"])
    @pytest.mark.parametrize("into", [False, True], ids=["fresh", "into_scratch"])
    def test_the_bits_of_torchs_conversion(self, dtype, layout, into):
        """Every code, paired or not (an odd count, an odd offset), in either memory order:
        ``data.float() * scale_inv``, bit for bit."""
        assert every_code(dtype).numel() >= PAIRED_MIN_NUMEL
        data = every_code(dtype)
        data = {
            "rows": data,
            "transposed": data.t().contiguous().t(),
            "odd_count": data.reshape(-1)[:PAIRED_MIN_NUMEL + 1],
            "odd_offset": data.reshape(-1)[1 : PAIRED_MIN_NUMEL + 1],
        }[layout]
        for scale_inv in (None, torch.tensor(0.37), torch.tensor(3.0e-5)):
            want = data.float() if scale_inv is None else data.float() * scale_inv
            got = gather(CodeTables(), data, scale_inv, (Scratch(), "out") if into else None)
            assert got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(bits(got), bits(want)), (layout, scale_inv)

    @pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
    def test_below_the_pairing_threshold_single_codes(self, dtype):
        """Below PAIRED_MIN_NUMEL codes, one code per lookup in the table of 256 scaled values: the bits."""
        data = every_code(dtype, rows=PAIRED_MIN_NUMEL // 256 - 2)
        scale_inv = torch.tensor(0.37)
        assert torch.equal(bits(gather(CodeTables(), data, scale_inv)), bits(data.float() * scale_inv))

    def test_into_scratch_writes_the_named_buffer(self):
        scratch, data = Scratch(), every_code(torch.float8_e4m3fn)
        got = gather(CodeTables(), data, torch.tensor(2.0), (scratch, "out"))
        assert got.data_ptr() == scratch("out", data.numel(), torch.float32, data.device).data_ptr()

    @pytest.mark.parametrize("into", [False, True], ids=["alone", "with-scratch"])
    def test_out_takes_the_values_with_or_without_scratch(self, into):
        scratch, data, scale_inv = Scratch(), every_code(torch.float8_e4m3fn), torch.tensor(2.0)
        out = torch.empty(data.numel())
        got = gather(CodeTables(), data, scale_inv, (scratch, "out") if into else None, out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(bits(got), bits(data.float() * scale_inv))


class TestSaturate:
    @pytest.mark.parametrize(("dtype", "fp8_max"), [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)],
                             ids=FP8_IDS)
    def test_the_bits_of_the_plain_cast(self, dtype, fp8_max):
        torch.manual_seed(0)
        x = torch.randn(64, 128) * 1000
        x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e38])
        for scratch in (None, Scratch()):
            for scale in (torch.tensor(1.0), torch.tensor(0.01), torch.tensor(7.5)):
                want = (x * scale).clamp_(-fp8_max, fp8_max).to(dtype)
                got = saturate(x, scale, fp8_max, dtype, scratch)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                assert got.stride() == want.stride()
            got_t = saturate(x.t(), torch.tensor(0.5), fp8_max, dtype, scratch)  # not contiguous: the plain cast
            assert torch.equal(got_t.view(torch.uint8), (x.t() * 0.5).clamp_(-fp8_max, fp8_max).to(dtype)
                               .view(torch.uint8))


    @pytest.mark.parametrize(("dtype", "fp8_max"), [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)],
                             ids=FP8_IDS)
    def test_a_known_amax_leaves_out_only_a_clamp_that_changes_nothing(self, dtype, fp8_max):
        """With the amax, the clamp is skipped exactly where ``|amax * scale| <= fp8_max``, and the bits are
        the plain cast's either way: at the boundary, one float32 step above it, for NaN and infinite
        elements, and for a negative scale."""
        torch.manual_seed(0)
        x = torch.randn(CLAMP_CHECK_MIN_NUMEL // 64, 64)
        amax = x.abs().amax()
        at_max = torch.tensor(fp8_max) / amax
        above = torch.nextafter(at_max, torch.tensor(float("inf")))
        cases = [(x, at_max), (x, above), (x, torch.tensor(0.5)), (x, -above), (x, -torch.tensor(0.5))]
        for special in (float("nan"), float("inf")):
            y = x.clone()
            y[3, 7] = special
            cases.append((y, torch.tensor(0.5)))
        for (xs, scale), host in itertools.product(cases, (False, True)):
            known = xs.abs().amax()
            want = (xs * scale).clamp_(-fp8_max, fp8_max).to(dtype)
            with OpLog() as log:  # the amax as a tensor, or as host_abs_max reads it (a float unless NaN)
                got = saturate(xs, scale, fp8_max, dtype, None, host_abs_max(xs) if host else known)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), float(scale)
            fits = bool(((known * scale).abs() <= fp8_max).item())
            assert ("aten.clamp_.default" in log.ops) == (not fits), (float(scale), host, log.ops)
        assert not bool(((amax * above).abs() <= fp8_max).item()), "the step above the boundary must clamp"
        small = x[:-1]  # below CLAMP_CHECK_MIN_NUMEL the clamp runs without a check
        with OpLog() as log:
            saturate(small, torch.tensor(0.5), fp8_max, dtype, None, small.abs().amax())
        assert "aten.clamp_.default" in log.ops


@pytest.mark.parametrize(
    "fill", ["random", "negative", "zeros", "-zeros", "inf", "-inf", "nan"],
)
def test_host_abs_max_reads_the_max_of_abs_values(fill):
    """A float equal to abs_max's value (+0.0 for zeros, inf for infinities), or abs_max's NaN tensor."""
    torch.manual_seed(0)
    x = torch.randn(CLAMP_CHECK_MIN_NUMEL // 64, 64)
    if fill == "negative":
        x = -x.abs() - 1.0
    elif fill.endswith("zeros"):  # the max of |x| is +0.0 whatever the zeros' sign
        x = torch.zeros_like(x) if fill == "zeros" else torch.zeros_like(x).neg_()
    elif fill != "random":
        x[5, 9] = float(fill)
    got = host_abs_max(x)
    want = abs_max(x)
    if fill == "nan":
        assert isinstance(got, torch.Tensor) and torch.isnan(got) and got.shape == ()
    else:
        assert isinstance(got, float) and torch.equal(torch.tensor(got), want), (got, want)
        assert math.copysign(1.0, got) == 1.0


@pytest.mark.parametrize("fill", ["random", "inf", "nan"])
@pytest.mark.parametrize("before", [0.0, 1e30, float("nan")], ids=["zero", "larger", "nan"])
def test_an_eager_cpu_delayed_cast_records_the_plain_max(fill, before):
    """The slot's accumulator after an eager CPU cast with the slot's scale (its amax read on the host,
    recorded with one clamp_ and no 0-d maximum) equals max(accumulator, abs_max(x)): NaN if either is."""
    torch.manual_seed(0)
    x = torch.randn(CLAMP_CHECK_MIN_NUMEL // 64, 64) * 3
    if fill != "random":
        x[1, 2] = float(fill)
    record = torch.tensor(before)
    want = torch.maximum(torch.tensor(before), abs_max(x))
    spec = CastSpec(torch.float8_e4m3fn, 448.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        q = EmulationBackend().cast(CastRequest(x, spec, torch.tensor(2.0), False, record, False))
    assert_same([record], [want], bits=True)  # a NaN equals a NaN of the same bits
    assert torch.equal(q.data.view(torch.uint8), (x * 2.0).clamp(-448.0, 448.0).to(spec.dtype).view(torch.uint8))
    ran = [e.name for e in prof.events()]
    if fill != "nan":
        assert "aten::maximum" not in ran and "aten::neg" not in ran, ran


def test_an_eager_cpu_cast_clamps_only_beyond_the_range():
    """EmulationBackend.cast hands saturate its amax on the CPU: a scale that keeps every product in range
    runs no clamp (counted by torch.profiler, which is not a dispatch mode), one beyond it does; same bits."""
    torch.manual_seed(0)
    x = torch.randn(CLAMP_CHECK_MIN_NUMEL // 128, 128)
    backend = EmulationBackend()
    spec = CastSpec(torch.float8_e4m3fn, 448.0)
    for scale, clamps in ((torch.tensor(10.0), False), (torch.tensor(1000.0), True)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            q = backend.cast(CastRequest(x, spec, scale, False, None, False))
        ran = {e.name for e in prof.events()}
        assert ("aten::clamp_" in ran) == clamps, (float(scale), sorted(ran))
        assert torch.equal(q.data.view(torch.uint8), (x * scale).clamp(-448.0, 448.0).to(spec.dtype).view(torch.uint8))


class TestDequantizeInto:
    @pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
    @pytest.mark.parametrize("layout", ["rows", "transposed"])
    def test_the_bits_of_the_plain_dequantization_in_the_buffer(self, dtype, layout):
        """E4M3 through the table, E5M2 through torch's own conversion: ``data.float() * scale_inv`` in
        the named buffer, laid out as ``data``."""
        data = every_code(dtype)
        data = data if layout == "rows" else data.t().contiguous().t()
        scratch, scale_inv = Scratch(), torch.tensor(3.0e-5)
        got = dequantize_into(CodeTables(), data, scale_inv, (scratch, "out"))
        want = data.float() * scale_inv
        assert torch.equal(bits(got), bits(want)) and got.stride() == want.stride()
        assert got.data_ptr() == scratch("out", data.numel(), torch.float32, data.device).data_ptr()


class TestScratch:
    def test_reused_grown_and_per_thread(self):
        scratch = Scratch()
        first = scratch("a", 100, torch.float32, torch.device("cpu"))
        assert scratch("a", 50, torch.float32, torch.device("cpu")).data_ptr() == first.data_ptr()
        assert scratch("b", 100, torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr()
        grown = scratch("a", 1000, torch.float32, torch.device("cpu"))
        assert grown.numel() == 1000
        assert scratch("a", 10, torch.float32, torch.device("cpu")).data_ptr() == grown.data_ptr()
        other: list[int] = []
        thread = threading.Thread(target=lambda: other.append(scratch("a", 10, torch.float32,
                                                                     torch.device("cpu")).data_ptr()))
        thread.start()
        thread.join()
        assert other[0] != grown.data_ptr(), "two threads were handed one buffer"


class TestQuiet:
    def test_only_where_no_one_else_can_hold_a_result(self):
        x = torch.ones(4)
        assert quiet(x)
        assert not quiet(x.requires_grad_())
        with OpLog():
            assert not quiet(torch.ones(4)), "a dispatch mode on the stack sees (and may keep) every result"
        with torch.inference_mode():
            assert not quiet(torch.ones(4))
        assert not quiet(torch.ones(4, device="meta"))
        assert not quiet(torch.nn.Parameter(torch.ones(4), requires_grad=False))

    def test_readable_where_values_exist_on_the_host(self):
        assert readable(torch.ones(4), torch.ones((), requires_grad=True))  # a gradient does not matter
        with OpLog():
            assert not readable(torch.ones(4)), "under a dispatch mode the tensors may be fake"
        assert not readable(torch.ones(4, device="meta"))


def _train(recipe: ss.Recipe) -> list[torch.Tensor]:
    """Two layers of different sizes (the buffers grow, then serve both), two microbatches a step; every
    activation and gradient large enough to be written into the reused buffers."""
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(recipe, backend="emulation")
    model = torch.nn.Sequential(
        ss.nn.Linear(512, 384, manager=manager, name="a"), torch.nn.ReLU(),
        ss.nn.Linear(384, 256, manager=manager, name="b", bias=False),
    )
    assert SCRATCH_MIN_NUMEL <= 2048 * 256  # the smallest activation or gradient
    out: list[torch.Tensor] = []
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(2048, 512, requires_grad=True)
            with manager.forward():
                y = model(x)
            with manager.backward():
                y.square().mean().backward()
            out += [y.detach(), x.grad]
        manager.step()
        out += [p.grad for p in model.parameters()]
        model.zero_grad()
    return out + list(manager.buffers().values())


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.CurrentScaling()], ids=["delayed", "current"])
def test_training_with_reused_buffers_gives_the_plain_bits(recipe):
    """The same training, once as usual and once under an operation log (a dispatch mode: every cast and
    product then allocates its results as the plain expressions do): the same bits."""
    reused = _train(recipe)
    with OpLog():
        plain = _train(recipe)
    assert_same(reused, plain, bits=True)


def test_brief_copies_are_forgotten_when_their_buffer_is_taken():
    """A brief copy serves products until the next brief keep takes its buffer; then its data is dequantized
    afresh, and dequantize() never hands out a buffer."""
    torch.manual_seed(0)
    backend = EmulationBackend()

    def q(seed: int) -> Quantized:
        torch.manual_seed(seed)
        return backend.cast(CastRequest(torch.randn(1024, 512), CastSpec(torch.float8_e5m2, 57344.0),
                                        torch.tensor(1.0), True, None, False))

    first, second, w = q(1), q(2), q(3)
    assert first.data.numel() >= SCRATCH_MIN_NUMEL

    def plain(a: Quantized) -> torch.Tensor:
        return torch.mm(a.dequantize(), w.dequantize().t())

    backend.keep_dequantized(first, brief=True)
    assert torch.equal(backend.scaled_mm(first, w.t(), out_dtype=torch.float32), plain(first))
    backend.keep_dequantized(second, brief=True)  # takes the buffer that held first's copy
    for a in (first, second, first):
        assert torch.equal(backend.scaled_mm(a, w.t(), out_dtype=torch.float32), plain(a))
    held = backend.dequantize(second)
    backend.keep_dequantized(first, brief=True)
    assert torch.equal(held, second.dequantize()), "dequantize() returned a buffer a later keep overwrote"


def test_release_buffers_frees_them_and_training_goes_on_bitwise():
    torch.manual_seed(0)
    backend = EmulationBackend()
    manager = ss.ScalingStateManager(ss.CurrentScaling(), backend=backend)
    layer = ss.nn.Linear(512, 512, manager=manager)
    x = torch.randn(2048, 512)
    assert backend.buffer_bytes() == 0
    with manager.forward():
        first = layer(x)
    held = backend.buffer_bytes()
    assert held >= 4 * x.numel(), held  # at least the input's float32 operand
    backend.release_buffers()
    assert backend.buffer_bytes() == 0
    with manager.forward():
        again = layer(x)
    assert torch.equal(again, first) and backend.buffer_bytes() == held


def test_a_brief_copy_serves_its_own_thread_only():
    """Another thread may overwrite its buffer at any time: no other thread is handed it."""
    kept, scratch = KeptCopies(), Scratch()
    q = Quantized(torch.ones(4, 8, dtype=torch.float8_e4m3fn), scale_inv=torch.tensor(2.0))
    values = scratch("brief0", 32, torch.float32, q.data.device).view(4, 8).fill_(2.0)
    kept.take_buffer(scratch, "brief0")
    kept.keep_brief(q.data, q.scale_inv, values, scratch, "brief0")
    assert kept.get(q, brief=True) is values and kept.get(q, brief=False) is None
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(kept.get(q, brief=True)))
    thread.start()
    thread.join()
    assert seen == [None]


def _large_blocks(step, min_bytes: int) -> int:
    """How many blocks of at least ``min_bytes`` one call of ``step`` allocates on CPU."""
    step()  # buffers, caches and tables are made in the first call
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(1 for e in prof.events() if e.self_cpu_memory_usage >= min_bytes)


@pytest.mark.parametrize("saved_copy_bytes", [SAVED_COPY_BYTES, 0], ids=["saved-copy", "no-saved-copy"])
def test_an_fp8_step_allocates_no_more_large_blocks_than_a_float32_step(saved_copy_bytes):
    """Each large block costs page faults (see the module's notes): an eager ss.nn.Linear's forward and
    backward allocates what torch.nn.Linear's does (output, input and weight gradients), the two FP8
    casts' data and the input's saved copy (keep_saved; none with saved_copy_bytes=0), and nothing else
    that grows with the tensors."""
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(
        ss.DelayedScaling(), backend=EmulationBackend(saved_copy_bytes=saved_copy_bytes)
    )
    layers = {"fp8": ss.nn.Linear(256, 256, manager=manager), "fp32": torch.nn.Linear(256, 256)}
    x, g = torch.randn(2048, 256, requires_grad=True), torch.randn(2048, 256)
    assert x.numel() >= SCRATCH_MIN_NUMEL

    def step(layer: torch.nn.Module) -> None:
        layer(x).backward(g)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    fp8_bytes = x.numel()  # the smallest large block: an FP8 copy of the input or its gradient
    blocks = {name: _large_blocks(lambda layer=layer: step(layer), fp8_bytes) for name, layer in layers.items()}
    assert blocks["fp8"] <= blocks["fp32"] + 2 + (saved_copy_bytes > 0), blocks
