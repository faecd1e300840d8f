"""Compiled grouped layers with the group sizes on the device: one graph for every routing, eager's bits."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import scalestate as ss
from helpers import RECIPES, assert_same_quantized
from scalestate.backends import CastRequest, GroupedCastRequest, GroupedOperand, SupportsDeviceGroups
from scalestate.backends.base import cast_spec
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.capability import cpu_runs_functional
from scalestate.nn.grouped_opaque import describe_spec
from scalestate.quantized import Orientation
from scalestate.testing import TinyLM, assert_same

E, IN, OUT = 4, 32, 48
#: Tokens per expert at each step (32 in all): a new pattern of empty experts at almost every step.
SIZES = [[8, 0, 16, 8], [4, 12, 0, 16], [0, 0, 32, 0], [1, 1, 1, 29], [16, 16, 0, 0]]


class _Checkpointed(torch.nn.Module):
    """The layer under torch's non-reentrant checkpoint: its forward is recomputed in backward."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.utils.checkpoint.checkpoint(self.layer, x, sizes, use_reentrant=False)
        return y


def _run(
    recipe: ss.Recipe,
    compiler: str | None,
    *,
    bias: bool = False,
    fullgraph: bool = True,
    microbatches: int = 1,
    checkpoint: bool = False,
    backend: str = "emulation",
    sizes_per_step: list[list[int]] = SIZES,
    device: str = "cpu",
    stats: bool = False,
    dynamic_rows: bool = False,
) -> tuple[list, int]:
    """Train a GroupedLinear over SIZES (sizes as tensors), compiled with ``compiler`` or eager (``None``):
    (outputs, gradients and state after every step, number of compiled frames). ``microbatches``: passes
    per step, the later ones with the step's sizes reversed; ``checkpoint``: the layer is checkpointed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(recipe, backend=backend, collect_stats=stats)
    layer = ss.nn.GroupedLinear(E, IN, OUT, bias=bias, manager=manager, name="moe").to(device)
    model = _Checkpointed(layer) if checkpoint else layer
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    counter = CompileCounterWithBackend(compiler) if compiler else None
    run = torch.compile(model, fullgraph=fullgraph, backend=counter) if counter else model
    gen = torch.Generator().manual_seed(1)
    out: list = []
    for sizes in sizes_per_step:
        for microbatch in range(microbatches):
            step_sizes = sizes if microbatch == 0 else sizes[::-1]
            x = (torch.randn(sum(step_sizes), IN, generator=gen) * 4).to(device).requires_grad_()
            if dynamic_rows:
                torch._dynamo.mark_dynamic(x, 0)
            with manager.forward():
                y = run(x, torch.tensor(step_sizes, device=device))
            with manager.backward():
                (y**2).mean().backward()
            out += [y.detach(), x.grad]
        out += [p.grad.clone() for p in layer.parameters()]
        opt.step()
        opt.zero_grad()
        manager.step()
        out.append(manager.state_dict())
        if stats:
            out.append({name: list(values.values()) for name, values in manager.stats().items()})
    return out, counter.frame_count if counter else 0


@pytest.mark.parametrize(
    ("recipe", "compiler"),
    [
        (ss.DelayedScaling(history_len=4), "aot_eager"),
        (ss.CurrentScaling(), "aot_eager"),
        (ss.DelayedScaling(history_len=4), "inductor"),
    ],
    ids=["delayed-aot_eager", "current-aot_eager", "delayed-inductor"],
)
def test_compiles_once_for_every_routing(recipe: ss.Recipe, compiler: str) -> None:
    """Group sizes as a tensor: one compiled graph over five routings (empty experts changing at every
    step), with the eager layer's outputs, gradients, histories and scales, bitwise; empty experts record
    nothing (their state is eager's, where they cast nothing)."""
    got, frames = _run(recipe, compiler)
    want, _ = _run(recipe, None)
    assert frames == 1
    assert_same(got, want, name=f"compiled ({compiler}) vs eager")


@pytest.mark.skipif(not cpu_runs_functional(), reason="this torch has no CPU kernel of F.scaled_mm (torch < 2.13)")
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_scaled_mm_on_cpu_compiles_once_for_every_routing(compiler: str) -> None:
    """The scaled_mm backend on a CPU where F.scaled_mm takes its products: its grouped layers keep the
    sizes on the device too, one graph for every routing (1-token experts included), bitwise its eager
    layer, which multiplies expert by expert."""
    recipe = ss.DelayedScaling(history_len=4)
    got, frames = _run(recipe, compiler, backend="scaled_mm")
    want, _ = _run(recipe, None, backend="scaled_mm")
    assert frames == 1
    assert_same(got, want, name=f"compiled ({compiler}) scaled_mm vs eager")


#: Tokens per expert with a number of rows that changes at every step (2 to 40).
VARYING_SIZES = [[8, 0, 16, 8], [4, 12, 0, 1], [0, 0, 40, 0], [1, 1, 0, 0], [16, 16, 0, 3]]


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.MXFP8Scaling()], ids=["delayed", "mxfp8"])
@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked_dynamic"])
def test_a_changing_number_of_rows(recipe: ss.Recipe, marked: bool) -> None:
    """A number of rows that changes at every step: with the rows marked dynamic
    (torch._dynamo.mark_dynamic(x, 0)) one graph serves every step; unmarked, the first change compiles
    once more (torch's automatic dynamic shapes), and no later one does. Bitwise eager either way."""
    got, frames = _run(recipe, "aot_eager", sizes_per_step=VARYING_SIZES, dynamic_rows=marked)
    want, _ = _run(recipe, None, sizes_per_step=VARYING_SIZES)
    assert frames == (1 if marked else 2)
    assert_same(got, want, name=f"compiled vs eager, a changing number of rows, {type(recipe).__name__}")


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_microbatches_and_checkpointing_on_the_device_path(checkpoint: bool) -> None:
    """Two microbatches per step (different routings), the layer plain or under torch's checkpoint inside
    the compiled region: still one graph, and bitwise the eager, un-checkpointed layer (each step's amaxes
    are the max over its microbatches)."""
    recipe = ss.DelayedScaling(history_len=4)
    got, frames = _run(recipe, "aot_eager", microbatches=2, checkpoint=checkpoint)
    want, _ = _run(recipe, None, microbatches=2)
    assert frames == 1
    assert_same(got, want, name=f"compiled ({'checkpointed' if checkpoint else 'plain'}) vs eager, 2 microbatches")


@pytest.mark.parametrize(
    ("backend", "compiler"),
    [("emulation", "aot_eager"), ("emulation", "inductor"), ("scaled_mm", "aot_eager")],
)
def test_bias_keeps_the_sizes_on_the_device(backend: str, compiler: str) -> None:
    """A per-expert bias: added to each expert's product inside the grouped product, its gradient summed
    over each expert's own rows by one operator; still one graph for every routing, and bitwise the eager
    layer (outputs, every gradient, the bias's included, and the state)."""
    if backend == "scaled_mm" and not cpu_runs_functional():
        pytest.skip("this torch has no CPU kernel of F.scaled_mm (torch < 2.13): scaled_mm takes the host path")
    recipe = ss.DelayedScaling(history_len=4)
    got, frames = _run(recipe, compiler, bias=True, backend=backend)
    want, _ = _run(recipe, None, bias=True, backend=backend)
    assert frames == 1
    assert_same(got, want, name=f"compiled ({compiler}, {backend}) with bias vs eager")


#: Tokens per expert for the fine-grained recipes: groups longer than a 128-token tile and a 32-token
#: MX block, so that blocks along the tokens start at each expert's first token, and 1-token experts
#: (171 tokens at every step: a new number of rows would compile once more, for a dynamic size).
FINE_SIZES = [[130, 0, 40, 1], [0, 161, 10, 0], [33, 33, 0, 105], [1, 0, 0, 170]]
#: Block scaling twice: 128-token tiles (the default) and 8-token ones (many tiles in each expert).
FINE_RECIPES = [ss.RowwiseScaling(), ss.BlockScaling(), ss.BlockScaling(block=8), ss.MXFP8Scaling()]


@pytest.mark.parametrize(
    "recipe", [*FINE_RECIPES, RECIPES["nvfp4"]], ids=["rowwise", "block128", "block8", "mxfp8", "nvfp4"]
)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fine_grained_recipes_compile_once_for_every_routing(recipe: ss.Recipe, bias: bool) -> None:
    """Fine-grained recipes (row-wise, 1x128 tiles with 128x128 weight blocks, MX, and NVFP4 with a delayed
    tensor level, the random Hadamard transform and stochastic rounding): each expert's casts run inside
    two operators of their own, so the sizes stay on the device: one graph for every routing (groups
    longer than a block along the tokens, empty and 1-token experts), bitwise the eager layer: outputs,
    gradients (the bias's too), each expert's amax histories and scales. Two microbatches per step (the
    second routed the other way round), so that an expert empty in the first and not in the second draws
    NVFP4's stochastic rounding as eager does (a draw is counted for the experts with tokens only)."""
    got, frames = _run(recipe, "aot_eager", bias=bias, sizes_per_step=FINE_SIZES, microbatches=2)
    want, _ = _run(recipe, None, bias=bias, sizes_per_step=FINE_SIZES, microbatches=2)
    assert frames == 1
    assert_same(got, want, name=f"compiled {type(recipe).__name__} vs eager")


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_fine_grained_microbatches_checkpointing_and_inductor(checkpoint: bool) -> None:
    """A fine-grained recipe on the device path under inductor, two microbatches per step, the layer
    plain or under torch's checkpoint in the compiled region: one graph, bitwise the eager layer."""
    recipe = ss.MXFP8Scaling()
    got, frames = _run(recipe, "inductor", microbatches=2, checkpoint=checkpoint, sizes_per_step=FINE_SIZES)
    want, _ = _run(recipe, None, microbatches=2, sizes_per_step=FINE_SIZES)
    assert frames == 1
    assert_same(got, want, name=f"compiled MXFP8 ({'checkpointed' if checkpoint else 'plain'}) vs eager")


@pytest.mark.skipif(not cpu_runs_functional(), reason="this torch has no CPU kernel of F.scaled_mm (torch < 2.13)")
@pytest.mark.parametrize("recipe", FINE_RECIPES, ids=["rowwise", "block128", "block8", "mxfp8"])
def test_scaled_mm_fine_grained_recipes_compile_once(recipe: ss.Recipe) -> None:
    """The scaled_mm backend with fine-grained recipes (row-wise products through F.scaled_mm on CPU,
    block and MX ones through its emulation fallback): each expert's casts and the backend's own products
    inside the operators, one graph for every routing, bitwise its eager layer."""
    got, frames = _run(recipe, "aot_eager", backend=ScaledMMBackend(fallback="emulation"), sizes_per_step=FINE_SIZES)
    want, _ = _run(recipe, None, backend=ScaledMMBackend(fallback="emulation"), sizes_per_step=FINE_SIZES)
    assert frames == 1
    assert_same(got, want, name=f"compiled scaled_mm {type(recipe).__name__} vs eager")


@pytest.mark.parametrize(
    "recipe",
    [ss.DelayedScaling(history_len=4), ss.RowwiseScaling(), RECIPES["nvfp4"]],
    ids=["delayed", "rowwise", "nvfp4"],
)
def test_collect_stats_on_the_device(recipe: ss.Recipe) -> None:
    """collect_stats=True: the operators count what each expert's casts did, added to the slots of the
    experts with tokens only: one graph for every routing, and the statistics (and everything else) of
    the eager layer, bitwise, over two microbatches per step."""
    sizes = SIZES if recipe.granularity(ss.Role.INPUT) is None else FINE_SIZES
    got, frames = _run(recipe, "aot_eager", bias=True, stats=True, microbatches=2, sizes_per_step=sizes)
    want, _ = _run(recipe, None, bias=True, stats=True, microbatches=2, sizes_per_step=sizes)
    assert frames == 1
    assert_same(got, want, name=f"compiled vs eager with collect_stats, {type(recipe).__name__}")


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.CurrentScaling()], ids=["delayed", "current"])
def test_backends_without_grouped_products_run_the_operators(recipe: ss.Recipe, monkeypatch) -> None:
    """A per-tensor recipe on a backend whose grouped products are not its own on the device (scaled_mm on
    CUDA: torch's kernels, one per expert), here the scaled_mm backend told so on CPU: the operators run its
    per-expert casts and products, with the slots' scales, one graph for every routing, bitwise eager
    (histories, just-in-time scales of the first step, empty experts)."""
    monkeypatch.setattr(ScaledMMBackend, "grouped_products", lambda self, device: False)
    got, frames = _run(recipe, "aot_eager", backend="scaled_mm", bias=True)
    want, _ = _run(recipe, None, backend="scaled_mm", bias=True)
    assert frames == 1
    assert_same(got, want, name=f"compiled scaled_mm {type(recipe).__name__} through the operators vs eager")


@pytest.mark.parametrize(
    "recipe", [ss.DelayedScaling(), ss.BlockScaling(block=8), RECIPES["nvfp4"]], ids=["delayed", "block8", "nvfp4"]
)
@pytest.mark.parametrize("products", ["emulation", "scaled_mm:emulation"])
def test_opaque_operators_pass_torchs_checks(recipe: ss.Recipe, products: str) -> None:
    """The two operators that run a grouped layer's experts in compiled code where a grouped cast cannot:
    fake tensors, schema and autograd registration as torch checks them, empty and 1-row groups included."""
    roles = (ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT)
    specs = [describe_spec(cast_spec(recipe, role)) for role in roles]
    offsets = torch.tensor([5, 5, 6, 18], dtype=torch.int32)  # 2 rows past the last group: zeros
    x, w, g = torch.randn(20, IN), torch.randn(E, OUT, IN), torch.randn(20, OUT)
    scales, jit = torch.rand(3, E) + 0.5, torch.tensor([True, False, True, False]).expand(3, E)
    signs, keys = torch.ones(16), torch.arange(E, dtype=torch.int64)
    bias = torch.randn(E, OUT)
    forward = (x, w, bias, offsets, scales[:2], jit[:2], signs, *specs[:2], products, torch.bfloat16, True)
    torch.library.opcheck(torch.ops.scalestate.grouped_experts_forward, forward)
    for need_x, need_w in [(True, True), (True, False), (False, True)]:
        backward = (g, x, w, offsets, scales, jit, signs, keys, *specs, products, need_x, need_w, need_w)
        torch.library.opcheck(torch.ops.scalestate.grouped_experts_backward, backward)
    out = torch.ops.scalestate.grouped_experts_forward(*forward)[0]
    assert out.shape == (20, OUT) and not out[18:].any()
    with pytest.raises(ss.errors.UnknownBackendError, match="unknown backend description 'cuda'"):
        torch.ops.scalestate.grouped_experts_forward(*forward[:9], "cuda", *forward[10:])


@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16], ids=["no_bias", "f32_bias", "bf16_bias"])
def test_grouped_mm_operator_passes_torchs_checks(bias: torch.dtype | None) -> None:
    """scalestate::grouped_mm, rows by group times 3-d weights, with and without a bias per group, and
    rows by rows into one product per group: torch's operator checks, empty and 1-row groups included."""
    offsets = torch.tensor([5, 5, 6, 18], dtype=torch.int32)
    a, b = torch.randn(20, IN), torch.randn(E, IN, OUT)
    b_bias = None if bias is None else torch.randn(E, OUT).to(bias)
    torch.library.opcheck(torch.ops.scalestate.grouped_mm, (a, b, offsets, False, b_bias))
    torch.library.opcheck(torch.ops.scalestate.grouped_mm, (a.t().contiguous(), torch.randn(20, OUT), offsets, True))


class _Replaced(EmulationBackend):
    """A backend that replaces only the emulation's product (the docs' example of a backend of one's own)."""

    def scaled_mm(self, a, b, *, out_dtype, bias=None):  # type: ignore[no-untyped-def]
        return super().scaled_mm(a, b, out_dtype=torch.float32, bias=bias).mul(2).to(out_dtype)


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.MXFP8Scaling()], ids=["delayed", "mxfp8"])
def test_a_backend_of_ones_own_keeps_its_own_products(recipe: ss.Recipe) -> None:
    """A subclass of the emulation backend with a product of its own: compiled grouped layers do not stand
    the emulation's grouped products or operators in for it (they take the host path, compiling per
    pattern of sizes), and give its eager bits."""
    assert not _Replaced().grouped_products(torch.device("cpu"))
    sizes = FINE_SIZES if recipe.granularity(ss.Role.INPUT) is not None else SIZES
    got, _ = _run(recipe, "aot_eager", backend=_Replaced(), fullgraph=False, sizes_per_step=sizes)
    want, _ = _run(recipe, None, backend=_Replaced(), sizes_per_step=sizes)
    assert_same(got, want, name=f"compiled vs eager, a backend of one's own, {type(recipe).__name__}")


def test_no_tokens_gives_no_parameter_gradient() -> None:
    """No tokens at all: compiled code, as eager, casts and multiplies nothing, and leaves the parameters
    without a gradient (an optimizer then leaves them alone, as eager's)."""
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.GroupedLinear(E, IN, OUT, bias=True, manager=manager, name="moe")
        run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        x = torch.randn(0, IN, requires_grad=True)
        with manager.forward():
            y = run(x, torch.zeros(E, dtype=torch.int64))
        with manager.backward():
            (y.sum() + x.sum()).backward()
        grads.append((layer.weight.grad, layer.bias.grad, y.shape))
        manager.step()
    assert grads[0] == grads[1] == (None, None, (0, OUT))


def test_grouped_sum_is_each_groups_own_sum() -> None:
    """scalestate::grouped_sum: each group's rows summed in float32 exactly as a sum of that slice alone
    (bf16 and float32 rows, empty and 1-row groups, rows past the last group ignored), and an operator
    that passes torch's own checks (fake tensor, schema, autograd registration)."""
    sizes = [5, 0, 300, 1, 0]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(sum(sizes) + 3, 24) * 100).to(dtype)
        got = torch.ops.scalestate.grouped_sum(x, offsets)
        parts = x[: sum(sizes)].split(sizes)
        assert got.dtype == torch.float32 and got.shape == (len(sizes), 24)
        for g, part in enumerate(parts):
            assert torch.equal(got[g], part.sum(0, dtype=torch.float32))
        torch.library.opcheck(torch.ops.scalestate.grouped_sum, (x, offsets))


def test_moe_model_compiles_once() -> None:
    """TinyLM with MoE blocks, converted: its router sorts on the device in compiled code, so that the
    whole model is one graph for every routing, bitwise the eager model."""

    def run(compiled: bool) -> tuple[list, int]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        model = ss.nn.convert(TinyLM(vocab=64, d_model=32, n_layers=2, n_heads=2, moe=(4, 2)), manager)
        counter = CompileCounterWithBackend("aot_eager")
        forward = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        out: list = []
        for _ in range(4):
            tokens = torch.randint(0, 64, (2, 16), generator=gen)
            with manager.forward():
                y = forward(tokens)
            with manager.backward():
                y.float().square().mean().backward()
            out.append(y.detach())
            opt.step()
            opt.zero_grad()
            manager.step()
            out.append(manager.state_dict())
        return out, counter.frame_count

    (got, frames), (want, _) = run(True), run(False)
    assert frames == 1
    assert_same(got, want, name="compiled MoE model vs eager")


def test_device_grouped_cast_matches_one_cast_per_group() -> None:
    """cast_grouped_rows with the sizes as a tensor (a zero among them, a NaN, a zero group of values)
    against one cast per group: the same bits and records; an empty group records maximum(record, 0)."""
    backend = EmulationBackend()
    sizes = [3, 0, 5, 4]
    x = torch.randn(12, IN) * torch.tensor([1.0, 1e-3, 1e3]).repeat_interleave(4)[:, None]
    x[9, 2] = float("nan")
    x[3:8] = 0.0
    spec = cast_spec(ss.DelayedScaling(), ss.Role.INPUT)
    scale = torch.tensor([2.0, 8.0, 0.5, 1.0])
    for jit in (True, False, torch.tensor([True, False, False, True])):
        record = torch.tensor([0.5, 3.0, 0.0, 1e4])
        rows = backend.cast_grouped_rows(
            GroupedCastRequest(x, spec, torch.tensor(sizes), scale, jit, record)
        )
        want_record = torch.tensor([0.5, 3.0, 0.0, 1e4])
        for g, part in enumerate(x.split(sizes)):
            if not sizes[g]:
                continue
            jit_g = jit if isinstance(jit, bool) else bool(jit[g])
            want = backend.cast(CastRequest(part, spec, scale[g].clone(), jit_g, want_record[g]))
            start = sum(sizes[:g])
            got = ss.Quantized.of(Orientation(rows.data[start : start + sizes[g]], rows.scale[g], rows.scale_inv[g]))
            assert_same_quantized(got, want, f"group {g}, jit {jit}")
        assert torch.equal(rows.group_of_row, torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 3, 3]))
        assert torch.equal(record.isnan(), want_record.isnan())
        assert torch.equal(record.nan_to_num(), want_record.nan_to_num())


@pytest.mark.parametrize("backend", [EmulationBackend(), ScaledMMBackend()], ids=["emulation", "scaled_mm"])
def test_grouped_products_match_one_product_per_group(backend: EmulationBackend) -> None:
    """grouped_scaled_mm against the backend's scaled_mm of each group, for the three products of a layer
    (rows by 3-d weights, both layouts; a transposed gradient by rows), empty and 1-row groups included."""
    if not backend.grouped_products(torch.device("cpu")):
        pytest.skip(f"{backend!r} has no grouped products on this CPU (torch < 2.13: no F.scaled_mm CPU kernel)")
    sizes = [5, 0, 17, 1]
    counts = torch.tensor(sizes)
    offsets = counts.cumsum(0).to(torch.int32)
    group_of_row = torch.repeat_interleave(torch.arange(E), counts)
    spec = cast_spec(ss.CurrentScaling(), ss.Role.INPUT)

    def cast(t: torch.Tensor) -> ss.Quantized:
        return backend.cast(CastRequest(t, spec, torch.ones(()), True))

    x, g = torch.randn(23, IN), torch.randn(23, OUT)
    qx = [cast(p) for p in x.split(sizes)]
    qg = [cast(p) for p in g.split(sizes)]
    qw = [cast(w) for w in torch.randn(E, OUT, IN)]
    xs = GroupedOperand(torch.cat([q.data for q in qx]), torch.stack([q.scale_inv for q in qx])[group_of_row, None])
    gs = GroupedOperand(torch.cat([q.data for q in qg]), torch.stack([q.scale_inv for q in qg])[group_of_row, None])
    ws = GroupedOperand(torch.stack([q.data for q in qw]), torch.stack([q.scale_inv for q in qw]).view(E, 1, 1))
    f32, bf16 = torch.float32, torch.bfloat16
    used = [e for e, n in enumerate(sizes) if n]
    wt = ws._replace(data=ws.data.transpose(1, 2))
    forward = backend.grouped_scaled_mm(xs, wt, offsets, out_dtype=f32)
    assert torch.equal(forward, torch.cat([backend.scaled_mm(qx[e], qw[e].t(), out_dtype=f32) for e in used]))
    for dtype in (f32, bf16):  # a bias per group, added as scaled_mm adds it, then the one rounding
        bias = torch.randn(E, OUT).to(dtype)
        with_bias = backend.grouped_scaled_mm(xs, wt, offsets, out_dtype=dtype, bias=bias)
        want = [backend.scaled_mm(qx[e], qw[e].t(), out_dtype=dtype, bias=bias[e]) for e in used]
        assert torch.equal(with_bias, torch.cat(want))
    with pytest.raises(ss.errors.CastError, match="one row per group of a 3-d b"):
        backend.grouped_scaled_mm(xs, wt, offsets, out_dtype=f32, bias=torch.zeros(E, IN))
    grad_x = backend.grouped_scaled_mm(gs, ws, offsets, out_dtype=bf16)
    assert torch.equal(grad_x, torch.cat([backend.scaled_mm(qg[e], qw[e], out_dtype=bf16) for e in used]))
    transposed = gs._replace(data=gs.data.t(), scale_inv=gs.scale_inv.t())
    grad_w = backend.grouped_scaled_mm(transposed, xs, offsets, out_dtype=f32)
    assert torch.equal(grad_w[1], torch.zeros(OUT, IN))
    for e in used:
        assert torch.equal(grad_w[e], backend.scaled_mm(qg[e].t(), qx[e], out_dtype=f32))


def test_which_backends_keep_sizes_on_the_device() -> None:
    """The emulation backend's grouped products are its own everywhere; scaled_mm's are on a CPU where
    F.scaled_mm takes its products, and not on CUDA, where its products are torch's kernels, one per
    group (its compiled grouped layers take the host path there, and a direct call is refused)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(EmulationBackend(), SupportsDeviceGroups)
    assert EmulationBackend().grouped_products(cpu)
    assert ScaledMMBackend().grouped_products(cpu) == cpu_runs_functional()
    assert not ScaledMMBackend().grouped_products(cuda)
    meta = GroupedOperand(torch.empty(4, 8, dtype=torch.float8_e4m3fn, device="meta"), torch.ones(4, 1, device="meta"))
    weights = GroupedOperand(torch.empty(2, 8, 3, dtype=torch.float8_e4m3fn, device="meta"), torch.ones(2, 1, 1))
    with pytest.raises(ss.errors.BackendUnavailableError, match="only on a CPU with"):
        ScaledMMBackend().grouped_scaled_mm(meta, weights, torch.tensor([2, 4]), out_dtype=torch.float32)


def test_sort_by_expert_on_device_matches_the_host_sort() -> None:
    """on_device=True: the same order and tokens, the counts as a tensor, nothing read on the host."""
    index = torch.randint(0, 6, (40, 2), generator=torch.Generator().manual_seed(0))
    order, tokens, sizes = ss.nn.sort_by_expert(index, 6)
    d_order, d_tokens, d_sizes = ss.nn.sort_by_expert(index, 6, on_device=True)
    assert torch.equal(d_order, order) and torch.equal(d_tokens, tokens)
    assert d_sizes.dtype == torch.int64 and d_sizes.tolist() == sizes


def test_bad_device_sizes_are_refused() -> None:
    """A group-size tensor of the wrong shape is refused by name in compiled code (the compiler runs the
    frame eagerly to raise it), as in eager code."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    torch._dynamo.reset()
    run = torch.compile(layer, backend="aot_eager")
    refused = pytest.raises(ss.errors.ArgumentTypeError, match="group_sizes must be a 1-d integer tensor")
    with manager.forward(), refused:
        run(torch.randn(8, IN), torch.tensor([[4, 4]]))


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag")
def test_operators_that_read_sizes_on_the_host_stay_out_of_cuda_graphs() -> None:
    """The operators that read group ends on the host when they run (a device synchronization) are tagged
    cudagraph_unsafe, so that torch.compile(mode="reduce-overhead") does not capture them in a CUDA graph."""
    import scalestate.backends.emulation  # noqa: F401  (registers scalestate::grouped_mm)

    for name in ("grouped_mm", "grouped_sum", "grouped_experts_forward", "grouped_experts_backward"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.scalestate, name).default.tags, name
