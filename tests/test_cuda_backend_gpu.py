"""The ``cuda`` backend on a CUDA GPU: the hardware FP8 conversion, bitwise parity, no host sync, CUDA graphs.

What only a GPU shows, and the CPU suite cannot (there the kernels run under
Triton's interpreter, through the integer rounding path only):

* the hardware conversion (``cvt.rn.satfinite``, the kernels' ``HW=True``)
  equals the reference rounding (``HW=False``, integer operations on the
  float32 bits) and torch's CUDA conversion on all 2^32 float32 bit patterns,
  for E4M3 and E5M2;
* every cast of the backend (per tensor and every fine-grained granularity,
  float32 and bfloat16 inputs, given and just-in-time scales, recorded,
  transposed) and its step update equal the emulation backend's on the GPU;
* forward, backward and ``step()`` never synchronize with the host;
* ``step()``, and a whole training step, captured in a CUDA graph and replayed
  equal eager execution.

FP8 data is compared bitwise with every NaN encoding counted as one value
(torch's CUDA conversion and the kernels may give a NaN different bytes);
float32 scales and amaxes with ``torch.equal`` after mapping NaN to one value
the same way.

Skipped without an sm89+ CUDA GPU, and under ``TRITON_INTERPRET=1`` (then the
kernels run on CPU tensors only; tests/test_cuda_backend.py covers that).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import triton  # the test extra installs it
import triton.language as tl

import scalestate as ss
from helpers import assert_same_quantized, random_step_state, same_bits
from scalestate.backends import CastRequest, CastSpec, StepUpdate, get_backend
from scalestate.backends.cuda import kernels
from scalestate.granularity import Granularity, GranularityKind
from scalestate.math import ScaleRule


def _why_skipped() -> str | None:
    if not torch.cuda.is_available():
        return "needs an sm89+ CUDA GPU; none is visible to torch"
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return f"needs an sm89+ CUDA GPU; {torch.cuda.get_device_name()} is sm_{cc[0]}{cc[1]}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: the kernels then run on CPU tensors only; unset it to run the GPU checks"
    return None


SKIP = _why_skipped()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
#: Per format, the constexprs of kernels.to_fp8_code: largest finite value's float32 bits, mantissa bits, bias.
FORMAT = {E4M3: (0x43E00000, 3, 7), E5M2: (0x47600000, 2, 15)}
#: Per format, the smallest NaN code without the sign bit: E4M3 has one (S.1111.111), E5M2 three (S.11111.xx).
NAN_MIN = {E4M3: 0x7F, E5M2: 0x7D}
GRANULARITIES = {
    "tensor": None,
    "row": Granularity(GranularityKind.ROW, 0, False),
    "tile128": Granularity(GranularityKind.TILE, 128, True),
    "block128": Granularity(GranularityKind.BLOCK, 128, True),
    "mx": Granularity(GranularityKind.MX, 32, True),
}
RECIPES = {
    "delayed": ss.DelayedScaling(history_len=4),
    "current": ss.CurrentScaling(),
    "rowwise": ss.RowwiseScaling(),
    "block": ss.BlockScaling(),
    "mxfp8": ss.MXFP8Scaling(),
    # NVFP4's casts run as torch operations on the GPU (no kernel of its own), its products emulated on sm90
    "nvfp4": ss.NVFP4Scaling(global_scale="delayed", history_len=4),
}
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def cuda():
    backend = get_backend("cuda")
    ok, why = backend.available(CUDA)
    assert ok, why
    return backend


@pytest.fixture(scope="module")
def emulation():
    return get_backend("emulation")


def _nan_code(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where FP8 bytes encode a NaN: E4M3 ``S.1111.111``; E5M2 ``S.11111.xx`` with ``xx`` non-zero."""
    return (codes.to(torch.int32) & 0x7F) >= NAN_MIN[dtype]


# ------------------------------------------------------------------ (a) the hardware conversion, all inputs
CHUNK = 1 << 28


@triton.jit
def _rounding_kernel(ref_ptr, bad_ptr, first_ptr, start, MAX_BITS: tl.constexpr, MBITS: tl.constexpr,
                     BIAS: tl.constexpr, NAN_MIN: tl.constexpr, BLOCK: tl.constexpr):
    """For the float32 bit patterns ``start + i``: the reference code into ``ref_ptr``, the number of
    patterns whose hardware code differs into ``bad_ptr``, the smallest such ``i`` into ``first_ptr``.
    ``NAN_MIN``: the smallest NaN code without its sign bit."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = (start + i).to(tl.float32, bitcast=True)
    hw = kernels.to_fp8_code(x, MAX_BITS, MBITS, BIAS, True)
    ref = kernels.to_fp8_code(x, MAX_BITS, MBITS, BIAS, False)
    tl.store(ref_ptr + i, ref.to(tl.uint8))
    # every NaN encoding counts as one value (NaN codes differ in the sign and, for E5M2, the mantissa)
    both_nan = ((hw & 0x7F) >= NAN_MIN) & ((ref & 0x7F) >= NAN_MIN)
    bad = (hw != ref) & ~both_nan
    tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), axis=0))
    tl.atomic_min(first_ptr, tl.min(tl.where(bad, i, 0x7FFFFFFF), axis=0))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_hardware_conversion_on_every_float32(fmt):
    """All 2^32 float32 bit patterns, in 16 chunks of 2^28, scaled by 1: the hardware conversion's code
    (``HW=True``) equals the reference rounding's (``HW=False``), and the reference equals torch's CUDA
    ``clamp(x, -max, max).to(fp8)``. Every NaN encoding counts as one value."""
    max_bits, mbits, bias = FORMAT[fmt]
    ref = torch.empty(CHUNK, dtype=torch.uint8, device=CUDA)
    bad = torch.zeros((), dtype=torch.int32, device=CUDA)
    first = torch.full((), 0x7FFFFFFF, dtype=torch.int32, device=CUDA)
    offsets = torch.arange(CHUNK, dtype=torch.int32, device=CUDA)
    block = 1024
    hw_bad, torch_bad = [], []
    for k in range(1 << 4):
        start = k << 28
        start -= (1 << 32) if start >= (1 << 31) else 0  # as int32: start + i never overflows
        bad.zero_()
        first.fill_(0x7FFFFFFF)
        _rounding_kernel[(CHUNK // block,)](ref, bad, first, start, MAX_BITS=max_bits, MBITS=mbits, BIAS=bias,
                                            NAN_MIN=NAN_MIN[fmt], BLOCK=block)
        if int(bad) or int(first) != 0x7FFFFFFF:
            hw_bad.append(f"{int(bad)} patterns from 0x{(start + int(first)) & 0xFFFFFFFF:08x}")
        x = (offsets + start).view(torch.float32)
        want = x.clamp(-MAX[fmt], MAX[fmt]).to(fmt).view(torch.uint8)
        both_nan = _nan_code(ref, fmt) & _nan_code(want, fmt)
        differs = (ref != want) & ~both_nan
        if n := int(differs.sum()):
            where = int(differs.nonzero()[0])
            torch_bad.append(f"{n} patterns from 0x{(start + where) & 0xFFFFFFFF:08x}")
        del x, want, both_nan, differs
    assert not hw_bad, f"hardware conversion differs from the reference: {hw_bad}"
    assert not torch_bad, f"reference differs from torch's CUDA conversion: {torch_bad}"


# ------------------------------------------------------------------ (b) the backend against emulation, on the GPU
def _special(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``x`` with NaN, +-inf, a subnormal, a value above the format's max, a rounding tie and an all-zero row."""
    flat = x.view(-1)
    n = flat.numel()
    values = [float("nan"), float("inf"), -float("inf"), 1e-40, MAX[fmt] * 3, -0.0, 2.0**-7 * 1.5, -float("nan")]
    for i, v in enumerate(values[: max(n - 1, 0)]):
        flat[(i * 37) % n] = v
    if x.dim() >= 2 and x.shape[-2] > 2:
        x[..., 1, :] = 0.0
    return x


def _input(shape: tuple[int, ...], dtype: torch.dtype, fmt: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
    if special:
        x = _special(x, fmt)
    return x.to(dtype).to(CUDA)


#: Partial tiles and blocks at every edge, one and several programs, 3-d; each also as a transposed view.
SHAPES = [(40, 33), (2, 3, 130), (1000, 4100)]


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cast_matches_emulation(cuda, emulation, granularity, fmt, dtype):
    """Every granularity, format and input dtype on the GPU: data, transposed data, scales and the
    recorded amax equal the emulation backend's (torch's CUDA conversion), with NaN, +-inf, subnormals,
    ties, values above the max and all-zero rows; contiguous and not; given and just-in-time scales
    (per tensor: also the device-side flag), recorded or not, transposed or not."""
    g = GRANULARITIES[granularity]
    checked = 0
    for i, (shape, special) in enumerate(itertools.product(SHAPES, (False, True))):
        x = _input(shape, dtype, fmt, seed=i, special=special)
        views = [x, x.t()] if x.dim() == 2 else [x, x.transpose(0, 1)]
        for v in views:
            two_d = v.dim() == 2
            # (jit, recorded, transpose): a given scale unrecorded, just in time recorded, and the device flag
            cases: list[tuple[bool | torch.Tensor, bool, bool]] = [(False, False, False), (True, True, two_d)]
            if g is None:
                on, off = torch.tensor(True, device=CUDA), torch.tensor(False, device=CUDA)
                cases += [(on, True, two_d), (off, True, False)]
            for jit, recorded, transpose in cases:
                spec = CastSpec(fmt, MAX[fmt], ScaleRule(), g)
                outs = []
                for backend in (cuda, emulation):
                    record = torch.tensor(0.5, device=CUDA) if recorded else None
                    scale = torch.tensor(3.25, device=CUDA)
                    q = backend.cast(CastRequest(v, spec, scale, jit, record, transpose))
                    outs.append((q, record))
                (got, got_rec), (want, want_rec) = outs
                what = (f"shape {tuple(v.shape)} stride {v.stride()} special={special} jit={jit} "
                        f"recorded={recorded} transpose={transpose}")
                assert_same_quantized(got, want, what)
                assert (got_rec is None and want_rec is None) or same_bits(got_rec, want_rec), f"{what}: record"
                checked += 1
    assert checked >= 24


@pytest.mark.parametrize(
    "rule",
    [ScaleRule(margin=2), ScaleRule(power_of_2=True), ScaleRule(amax_floor=1e-12)],
    ids=["margin2", "pow2", "floor"],
)
def test_per_tensor_scale_rules_match_emulation(cuda, emulation, rule):
    """Just-in-time scales follow the rule exactly on the GPU, for amaxes from subnormal to huge, zero and NaN."""
    spec = CastSpec(E4M3, 448.0, rule, None)
    for amax in (1e-44, 1e-30, 1e-13, 3e-5, 1.0, 447.9, 6e4, 3e38, 0.0, float("nan")):
        x = torch.tensor([[amax, -amax / 3, amax / 7, 0.0]], device=CUDA)
        got_rec, want_rec = torch.zeros((), device=CUDA), torch.zeros((), device=CUDA)
        got = cuda.cast(CastRequest(x, spec, torch.tensor(0.75, device=CUDA), True, got_rec, True))
        want = emulation.cast(CastRequest(x, spec, torch.tensor(0.75, device=CUDA), True, want_rec, True))
        assert_same_quantized(got, want, f"amax {amax}")
        assert same_bits(got_rec, want_rec)


@pytest.mark.parametrize("policy", ["skip", "fallback", "no_count"])
@pytest.mark.parametrize(
    "rule",
    [ScaleRule(), ScaleRule(amax_compute="most_recent"), ScaleRule(margin=3, power_of_2=True, amax_floor=1e-12)],
    ids=["max", "most_recent", "margin_pow2_floor"],
)
@pytest.mark.parametrize(("n", "history_len"), [(300, 1), (10_000, 16), (50, 1024)])
def test_step_update_matches_emulation(cuda, emulation, policy, rule, n, history_len):
    """The one-launch step update on the GPU, in place: counts, the fallback policy's forgetting, the
    roll, the history's amax, the new scales and the cleared accumulators equal the emulation's, over
    random histories and step amaxes with zeros, NaN, infinities and subnormals, both formats."""
    history, step, scales, fp8_max, counts = random_step_state(n, history_len)
    states = []
    for backend in (cuda, emulation):
        h, s, a, c = (t.to(CUDA) for t in (history, scales, step, counts))
        ptrs = (h.data_ptr(), s.data_ptr(), a.data_ptr(), c.data_ptr())
        backend.update(StepUpdate(h, s, a, fp8_max.to(CUDA), rule, None if policy == "no_count" else c,
                                  policy == "fallback"))
        assert (h.data_ptr(), s.data_ptr(), a.data_ptr(), c.data_ptr()) == ptrs
        states.append((h, s, a, c))
    for name, got, want in zip(("history", "scales", "step_amax", "counts"), *states, strict=True):
        assert same_bits(got, want), name
    assert torch.equal(states[0][2], torch.zeros(n, device=CUDA))


# ------------------------------------------------------------------ (c) no host sync
DIMS = (256, 512, 256)
TOKENS = 128


def _mlp(manager: ss.ScalingStateManager, seed: int = 0) -> torch.nn.Module:
    """Two ss.nn.Linear layers with a ReLU between, bfloat16, on the GPU."""
    torch.manual_seed(seed)
    d0, d1, d2 = DIMS
    return torch.nn.Sequential(
        ss.nn.Linear(d0, d1, manager=manager, name="fc1", device=CUDA, dtype=torch.bfloat16),
        torch.nn.ReLU(),
        ss.nn.Linear(d1, d2, manager=manager, name="fc2", device=CUDA, dtype=torch.bfloat16),
    )


def _batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    """Inputs whose range grows every step (so the scales move)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(TOKENS, DIMS[0], generator=gen) * (1 + step)).to(CUDA, torch.bfloat16) for step in range(steps)
    ]


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_no_host_sync(recipe):
    """With CUDA sync debugging set to error: training forward, backward, an in-place weight update,
    ``step()`` and an evaluation forward run without a host-device sync (after one warm-up step)."""
    m = ss.ScalingStateManager(RECIPES[recipe], backend="cuda", device=CUDA)
    assert m.backend.name == "cuda"
    model = _mlp(m)
    xs = _batches(4)

    def train_step(x: torch.Tensor) -> None:
        with m.forward():
            loss = _loss(model(x))
        with m.backward():
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=0.01)  # the weights change: their casts are made again
                p.grad.zero_()
        m.step()

    train_step(xs[0])  # warm up: kernels compile and load, the state settles on the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs[1:]:
            train_step(x)
            with torch.no_grad():
                model(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert m.iteration == len(xs)


# ------------------------------------------------------------------ (d) step() in a CUDA graph
def _record(manager: ss.ScalingStateManager, step: int) -> None:
    """Record one step's amaxes in every slot, through the casts (the same values for any manager):
    forward casts of INPUT and WEIGHT, a backward cast of GRAD_OUTPUT; some steps have a NaN or an inf."""
    gen = torch.Generator().manual_seed(100 + step)
    with manager.forward():
        for i, handle in enumerate(manager.handles.values()):
            for role in (ss.Role.INPUT, ss.Role.WEIGHT):
                x = torch.randn(64, 32, generator=gen) * (1 + i) * (1 + step)
                if step == 3 and i % 5 == 0:
                    x[0, 0] = float("nan") if role is ss.Role.INPUT else float("inf")
                handle.quantize(x.to(CUDA), role)
    with manager.backward():
        for handle in manager.handles.values():
            g = torch.randn(64, 32, generator=gen) * 1e-3 * (1 + step)
            handle.quantize(g.to(CUDA), ss.Role.GRAD_OUTPUT)


@pytest.mark.parametrize("policy", ["skip", "fallback"])
@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_step_in_cuda_graph(recipe, policy):
    """``manager.step()`` captured once in a CUDA graph and replayed every step holds the very state
    (histories, scales, accumulators, non-finite counts) that eager ``step()`` calls give, for the
    same recorded amaxes, NaN and infinities included."""
    recipe_ = ss.DelayedScaling(history_len=16, margin=1) if recipe == "delayed" else RECIPES[recipe]
    managers = []
    for _ in range(2):
        m = ss.ScalingStateManager(recipe_, backend="cuda", device=CUDA, on_nonfinite=policy)
        for i in range(40):
            m.register(f"layer{i}")
        managers.append(m)
    eager, graphed = managers
    for m in managers:  # warm up, and the first step freezes the buffers' addresses
        _record(m, 0)
        m.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _record(graphed, 1)
        graphed.step()
        _record(eager, 1)
        eager.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for step in range(2, 7):
        _record(eager, step)
        eager.step()
        _record(graphed, step)
        graph.replay()
        torch.cuda.synchronize()
        for key, want in eager.buffers().items():
            assert same_bits(graphed.buffers()[key], want), f"step {step}: {key}"
        assert graphed.nonfinite_counts() == eager.nonfinite_counts(), f"step {step}"
    assert any(n for roles in eager.nonfinite_counts().values() for n in roles.values())


# ------------------------------------------------------------------ (e) a training step in a CUDA graph
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_training_step_in_cuda_graph(recipe):
    """A whole training step of a small MLP of ss.nn.Linear (forward, backward, an SGD step with
    momentum, ``manager.step()``) captured in a CUDA graph with static inputs, after warm-up steps on a
    side stream, and replayed: outputs, losses, gradients, parameters and the scaling state equal an
    eager run's bit for bit, step by step."""
    warmup, steps = 3, 4
    xs = _batches(warmup + steps)

    def train_step(model, opt, m, x):
        with m.forward():
            y = model(x)
            loss = _loss(y)
        with m.backward():
            loss.backward()
        opt.step()
        m.step()
        return y, loss

    def snapshot(model, m, y, loss):
        return {
            "output": y.detach().clone(), "loss": loss.detach().clone(),
            **{f"grad.{k}": p.grad.clone() for k, p in model.named_parameters()},
            **{f"param.{k}": p.detach().clone() for k, p in model.named_parameters()},
            **{k: v.clone() for k, v in m.buffers().items()},
        }

    # eager
    m_eager = ss.ScalingStateManager(RECIPES[recipe], backend="cuda", device=CUDA)
    model = _mlp(m_eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    want = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        y, loss = train_step(model, opt, m_eager, x)
        want.append(snapshot(model, m_eager, y, loss))

    # graphed
    m = ss.ScalingStateManager(RECIPES[recipe], backend="cuda", device=CUDA)
    assert m.backend.name == "cuda"
    model = _mlp(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    static_x = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs[:warmup]:
            static_x.copy_(x)
            opt.zero_grad(set_to_none=True)
            train_step(model, opt, m, static_x)
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y, static_loss = train_step(model, opt, m, static_x)
    for step in range(warmup, warmup + steps):
        static_x.copy_(xs[step])
        graph.replay()
        got = snapshot(model, m, static_y, static_loss)
        assert got.keys() == want[step].keys()
        for key, value in want[step].items():
            assert same_bits(got[key], value), f"step {step}: {key}"
