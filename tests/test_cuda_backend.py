"""The ``cuda`` backend's Triton kernels, bit-exact against the emulation backend.

On a machine without a CUDA GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``conftest.py`` before anything imports them),
on CPU tensors, through the reference rounding path (integer operations on
the float32 bits) that the GPU build also compiles. The shapes are small and
the kernels' blocks large: each program instance costs milliseconds here.

FP8 data is compared bitwise with every NaN encoding counted as one value
(torch's CPU conversion and NVIDIA's give negative NaN different bytes);
float32 scales and amaxes are compared with ``torch.equal`` after mapping
NaN to one value the same way.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import scalestate as ss
from helpers import RECIPES, assert_bitwise, assert_same_quantized, random_step_state, same_bits, train
from scalestate.backends import CastRequest, CastSpec, StepUpdate, get_backend
from scalestate.granularity import Granularity, GranularityKind
from scalestate.math import ScaleRule

pytest.importorskip("triton", reason="the cuda backend's kernels need Triton (the test extra installs it)")
if torch.cuda.is_available():
    pytestmark = pytest.mark.skip(reason="a CUDA GPU is visible: tests/test_cuda_backend_gpu.py runs these on it")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
GRANULARITIES = {
    "tensor": None,
    "row": Granularity(GranularityKind.ROW, 0, False),
    "row_pow2": Granularity(GranularityKind.ROW, 0, True),
    "tile128": Granularity(GranularityKind.TILE, 128, True),
    "tile8": Granularity(GranularityKind.TILE, 8, False),
    "block128": Granularity(GranularityKind.BLOCK, 128, True),
    "block8": Granularity(GranularityKind.BLOCK, 8, False),
    "mx": Granularity(GranularityKind.MX, 32, True),
}


@pytest.fixture(scope="module")
def cuda():
    return get_backend("cuda")


@pytest.fixture(scope="module")
def emulation():
    return get_backend("emulation")


def _special(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``x`` with NaN, +-inf, a subnormal, a value above the format's max, a rounding tie and an all-zero row."""
    flat = x.view(-1)
    n = flat.numel()
    values = [float("nan"), float("inf"), -float("inf"), 1e-40, MAX[fmt] * 3, -0.0, 2.0 ** -7 * 1.5]
    for i, v in enumerate(values[: max(n - 1, 0)]):
        flat[(i * 37) % n] = v
    if x.dim() >= 2 and x.shape[-2] > 2:
        x[..., 1, :] = 0.0
    return x


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, fmt: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1] if shape else 1)
    if special:
        x = _special(x, fmt)
    return x.to(dtype)


SHAPES = [(9, 300), (1, 7), (7, 1), (2, 3, 130), (40, 33)]


@pytest.mark.parametrize("granularity", list(GRANULARITIES), ids=str)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cast_matches_emulation(cuda, emulation, granularity, fmt, dtype):
    """Every recipe's cast, every format and input dtype: data, scales and the recorded amax are the
    emulation's, over partial tiles, 1-row, 1-column, 3-d and non-contiguous inputs, with NaN, +-inf,
    subnormals, ties, values above the max and all-zero rows; recorded and unrecorded."""
    g = GRANULARITIES[granularity]
    checked = 0
    for i, (shape, special) in enumerate(itertools.product(SHAPES, (False, True))):
        x = _inputs(shape, dtype, fmt, seed=i, special=special)
        variants = [x]
        if x.dim() == 2 and min(x.shape) > 1:
            variants.append(x.t())  # non-contiguous 2-d: read through its strides
        if x.dim() == 3:
            variants.append(x.transpose(0, 1))  # non-contiguous 3-d: made contiguous first
        for v in variants:
            if g is not None and g.kind == GranularityKind.BLOCK and v.dim() < 2:
                continue
            for transpose, recorded in itertools.product((False, True) if v.dim() == 2 else (False,), (False, True)):
                spec = CastSpec(fmt, MAX[fmt], ScaleRule(), g)
                jit = g is None and recorded  # per tensor: a given scale unrecorded, just in time recorded
                outs = []
                for backend in (cuda, emulation):
                    record = torch.tensor(0.5) if recorded else None
                    q = backend.cast(CastRequest(v, spec, torch.tensor(3.25), jit, record, transpose))
                    outs.append((q, record))
                (got, got_rec), (want, want_rec) = outs
                assert_same_quantized(got, want)
                assert (got_rec is None and want_rec is None) or same_bits(got_rec, want_rec)
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize(
    "rule",
    [ScaleRule(), ScaleRule(margin=2), ScaleRule(power_of_2=True), ScaleRule(amax_floor=1e-12),
     ScaleRule(margin=1, power_of_2=True)],
    ids=["plain", "margin2", "pow2", "floor", "margin_pow2"],
)
@pytest.mark.parametrize("jit", ["given", "own", "device_true", "device_false"])
def test_per_tensor_scale_rules(cuda, emulation, rule, jit):
    """Just-in-time scales follow the rule (margin, power of two, amax floor) exactly, for amaxes
    from subnormal to huge, zero and NaN included; the device-side jit flag chooses per tensor."""
    flag = {"given": False, "own": True, "device_true": torch.tensor(True), "device_false": torch.tensor(False)}[jit]
    for amax in (1e-44, 1e-30, 1e-13, 3e-5, 1.0, 447.9, 6e4, 3e38, 0.0, float("nan")):
        x = torch.tensor([[amax, -amax / 3, amax / 7, 0.0]])
        spec = CastSpec(E4M3, 448.0, rule, None)
        got_rec, want_rec = torch.tensor(0.0), torch.tensor(0.0)
        got = cuda.cast(CastRequest(x, spec, torch.tensor(0.75), flag, got_rec, True))
        want = emulation.cast(CastRequest(x, spec, torch.tensor(0.75), flag, want_rec, True))
        assert_same_quantized(got, want)
        assert same_bits(got_rec, want_rec)


def test_rounding_over_bit_patterns(cuda, emulation):
    """The reference rounding against torch's conversion (through the emulation backend, scale 1)
    on every pattern of the high 16 float32 bits, each with six low halves (ties, carries, sticky
    bits), and 2^20 random patterns: about 1.4 million inputs per format."""
    high = torch.arange(-(2**15), 2**15, dtype=torch.int32) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    patterns = (high[:, None] | lows[None, :]).reshape(-1)
    gen = torch.Generator().manual_seed(0)
    patterns = torch.cat([patterns, torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=gen)])
    x = patterns.view(torch.float32).reshape(-1, 1024)
    for fmt in (E4M3, E5M2):
        spec = CastSpec(fmt, MAX[fmt], ScaleRule(), None)
        got = cuda.cast(CastRequest(x, spec, torch.tensor(1.0), False, None, False))
        want = emulation.cast(CastRequest(x, spec, torch.tensor(1.0), False, None, False))
        assert_same_quantized(got, want)


@pytest.mark.parametrize("policy", ["skip", "fallback", "no_count"])
@pytest.mark.parametrize(
    "rule",
    [ScaleRule(), ScaleRule(amax_compute="most_recent"), ScaleRule(margin=3, power_of_2=True),
     ScaleRule(amax_floor=1e-12)],
    ids=["max", "most_recent", "margin_pow2", "floor"],
)
@pytest.mark.parametrize("history_len", [1, 5, 16])
def test_step_update_matches_emulation(cuda, emulation, policy, rule, history_len):
    """The one-launch step update: counts, the fallback policy's forgetting, the roll, the history's
    amax, the new scales and the cleared accumulators, over random histories and step amaxes with
    zeros, NaN and infinities, for 300 slots of both formats."""
    n = 300
    history, step, scales, fp8_max, counts = random_step_state(n, history_len)
    states = []
    for backend in (cuda, emulation):
        h, s, a, c = history.clone(), scales.clone(), step.clone(), counts.clone()
        ptrs = (h.data_ptr(), s.data_ptr(), a.data_ptr())
        backend.update(StepUpdate(h, s, a, fp8_max, rule, None if policy == "no_count" else c, policy == "fallback"))
        assert (h.data_ptr(), s.data_ptr(), a.data_ptr()) == ptrs
        states.append((h, s, a, c))
    for got, want in zip(*states, strict=True):
        assert same_bits(got, want)
    assert not torch.equal(states[0][0], history) and torch.equal(states[0][2], torch.zeros(n))


def test_step_update_of_no_slots(cuda):
    """A manager with no slots steps without launching anything."""
    h, s, a = torch.zeros(0, 4), torch.ones(0), torch.zeros(0)
    cuda.update(StepUpdate(h, s, a, torch.zeros(0), ScaleRule()))
    assert h.shape == (0, 4)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(
    ("mechanism", "granularity", "schedule", "evaluate"),
    [("non_reentrant", "none", "plain", True), ("non_reentrant", "model", "plain", False),
     ("reentrant", "block", "1f1b", False), ("non_reentrant", "none", "manual_recompute", False)],
    ids=["microbatches_eval", "checkpoint", "reentrant_1f1b", "manual_recompute"],
)
def test_training_is_emulation_bitwise(recipe, mechanism, granularity, schedule, evaluate):
    """Training through the cuda backend's kernels (checkpointed or not, microbatches, 1F1B,
    explicit recompute, evaluation passes) is bitwise the emulation backend's: outputs, gradients,
    parameters, histories, scales and pending amaxes at every step."""
    kwargs = dict(kind="mlp", mechanism=mechanism, granularity=granularity, schedule=schedule, evaluate=evaluate,
                  steps=3, microbatches=2)
    got = train(RECIPES[recipe], "cuda", **kwargs)
    want = train(RECIPES[recipe], "emulation", **kwargs)
    assert got.manager.backend.name == "cuda"
    assert_bitwise(got, want)


@pytest.mark.parametrize("recipe", ["delayed", "block"])
def test_resume_is_emulation_bitwise(tmp_path, recipe):
    """A state saved by a cuda-backend manager loads into an emulation one (and back), and training
    resumed from it continues exactly as the emulation run does."""
    torch.manual_seed(0)
    runs = {}
    for name in ("cuda", "emulation"):
        m = ss.ScalingStateManager(RECIPES[recipe], backend=name)
        torch.manual_seed(0)
        model = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), m)
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            if step == 2:
                path = tmp_path / f"{name}.pt"
                torch.save(m.state_dict(), path)
                other = ss.ScalingStateManager(RECIPES[recipe], backend="emulation" if name == "cuda" else "cuda")
                for key in m.handles:
                    other.register(key)
                other.load_state_dict(torch.load(path, weights_only=True))
                assert same_bits(other.state_dict()["scale"], m.state_dict()["scale"])
            x = torch.randn(4, 32, generator=gen) * (step + 1)
            with m.forward():
                loss = model(x).square().mean()
            with m.backward():
                loss.backward()
            m.step()
        runs[name] = m.state_dict()
    for key in ("amax_history", "scale", "step_amax"):
        assert same_bits(runs["cuda"][key], runs["emulation"][key]), key


def test_available_names_the_interpreter(cuda):
    """Under the interpreter the backend runs on CPU and says that it is for testing only;
    'auto' never picks it on CPU."""
    ok, why = cuda.available(torch.device("cpu"))
    assert ok and "interpreter" in why and "testing" in why
    assert ss.ScalingStateManager(ss.DelayedScaling(), backend="auto", device="cpu").backend.name == "emulation"
    ok, why = cuda.supports(ss.MXFP8Scaling(), "cpu")
    assert ok and "emulation" in why
    assert "interpreter" in repr(cuda)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter without TRITON_INTERPRET, run outside the source tree (whose
    ``scalestate/`` folder, without ``backends/``, would shadow the installed package)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=cwd,
                          timeout=120)


def test_available_says_why_not(tmp_path):
    """Without the interpreter: no on CPU (use emulation, or set TRITON_INTERPRET=1 for tests), no on a
    machine without a CUDA GPU, and without Triton a reason naming the extra to install; a manager
    asking for it fails at once with that reason."""
    code = (
        "import torch, scalestate as ss\n"
        "from scalestate.backends import get_backend\n"
        "b = get_backend('cuda')\n"
        "print(b.available(torch.device('cpu')))\n"
        "print(b.available(torch.device('cuda')))\n"
        "try:\n"
        "    ss.ScalingStateManager(ss.DelayedScaling(), backend='cuda', device='cpu')\n"
        "except ss.errors.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr
    cpu, gpu, refused = result.stdout.strip().splitlines()
    assert cpu.startswith("(False") and "TRITON_INTERPRET=1" in cpu and "emulation" in cpu
    assert gpu.startswith("(False") and ("CUDA" in gpu or "GPU" in gpu)
    assert refused.startswith("refused:") and "TRITON_INTERPRET" in refused
    missing = _run("import sys; sys.modules['triton'] = None\n" + code, tmp_path)
    assert missing.returncode == 0, missing.stderr
    assert 'pip install "scalestate[cuda]"' in missing.stdout.splitlines()[0]


def test_empty_and_unsupported_tiles_use_the_reference(cuda, emulation):
    """Empty tensors and tiles whose size is not a power of two are cast by the emulation's code."""
    for x, g in [(torch.zeros(0, 5), None), (torch.randn(4, 30), Granularity(GranularityKind.TILE, 12, False))]:
        spec = CastSpec(E4M3, 448.0, ScaleRule(), g)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = cuda.cast(CastRequest(x, spec, torch.tensor(2.0), True, None, False))
        assert_same_quantized(got, emulation.cast(CastRequest(x, spec, torch.tensor(2.0), True, None, False)))


@pytest.mark.parametrize(
    ("recipe", "compiler"),
    [(r, "aot_eager") for r in RECIPES] + [("delayed", "inductor"), ("block", "inductor")],
)
def test_compiled_training_is_eager(recipe, compiler):
    """torch.compile(fullgraph=True) of a model on the cuda backend: the kernels are opaque custom ops
    (``scalestate_cuda::cast_*``), nothing recompiles after warm-up, and training is bitwise eager's
    (invariant 13), checkpointed."""
    kwargs = dict(kind="mlp", mechanism="non_reentrant", granularity="model", steps=4, microbatches=2, lr=0.01)
    # torch 2.13's tracer fails when it recompiles a frame and the recompile meets a cast op the
    # first compile did not (the same code compiled for another recipe): start from a clean compiler.
    torch.compiler.reset()
    eager = train(RECIPES[recipe], "cuda", **kwargs)
    compiled = train(RECIPES[recipe], "cuda", compile_kwargs={"fullgraph": True, "backend": compiler}, **kwargs)
    assert compiled.compiles_after_warmup == 0
    assert_bitwise(eager, compiled)
