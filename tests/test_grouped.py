"""`ss.nn.GroupedLinear`: expert e is, bitwise, an `ss.nn.Linear` named "<name>.<e>" on its tokens."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import scalestate as ss
from helpers import MECHANISMS, RECIPES, assert_same_quantized, backend_for, checkpointer
from scalestate.testing import CastSpy, OpLog, assert_same

E, IN, OUT = 4, 32, 64
#: Tokens per expert, per step and microbatch: empty experts on some steps, every expert on others.
SIZES = [
    [[16, 0, 8, 24], [0, 16, 16, 0]],
    [[8, 8, 8, 8], [32, 0, 0, 16]],
    [[0, 0, 48, 0], [16, 16, 0, 16]],
]


class Loop(nn.Module):
    """The reference: one ss.nn.Linear per expert, named as GroupedLinear names its experts."""

    def __init__(self, manager: ss.ScalingStateManager, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            ss.nn.Linear(IN, OUT, bias=bias is not None, manager=manager, name=f"moe.{e}") for e in range(E)
        )
        with torch.no_grad():
            for e, layer in enumerate(self.experts):
                layer.weight.copy_(weight[e])
                if bias is not None:
                    layer.bias.copy_(bias[e])

    def forward(self, x: Tensor, sizes: list[int]) -> Tensor:
        parts = [layer(part) for layer, part, n in zip(self.experts, x.split(sizes), sizes, strict=True) if n]
        return torch.cat(parts)

    def stacked_grads(self) -> list[Tensor]:
        grads = [torch.stack([layer.weight.grad for layer in self.experts])]
        if self.experts[0].bias is not None:
            grads.append(torch.stack([layer.bias.grad for layer in self.experts]))
        return grads


def _run(
    recipe: ss.Recipe, backend: str, grouped: bool, *, bias: bool = False, wrap: str | None = None,
    stats: bool = False, order: tuple[int, int] = (0, 1), device: str = "cpu",
) -> dict:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(recipe, backend=backend_for(recipe, backend), collect_stats=stats)
    layer = ss.nn.GroupedLinear(E, IN, OUT, bias=bias, manager=manager if grouped else _scratch(), name="moe")
    if not grouped:
        layer = Loop(manager, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    layer.to(device)
    sized = Sized(layer)
    run = checkpointer(wrap)(sized) if wrap else sized
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    out: dict[str, list] = {"y": [], "dx": [], "dw": [], "state": []}
    for step, step_sizes in enumerate(SIZES):
        inputs = [(torch.randn(sum(sizes), IN, generator=gen) * (1 + step)).to(device) for sizes in step_sizes]
        inputs = [x.requires_grad_() for x in inputs]
        for i in order:
            sizes, x = step_sizes[i], inputs[i]
            sized.sizes = sizes
            with manager.forward():
                y = run(x)
            with manager.backward():
                (y**2).mean().backward()
            out["y"].append(y.detach())
            out["dx"].append(x.grad)
        grads = layer.stacked_grads() if not grouped else [p.grad.clone() for p in layer.parameters()]
        out["dw"].append(grads)
        opt.step()
        opt.zero_grad()
        manager.step()
        out["state"].append(manager.state_dict())
        if stats:
            out.setdefault("stats", []).append({n: list(s.values()) for n, s in manager.stats().items()})
    return out


def _scratch() -> ss.ScalingStateManager:
    return ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")


class Sized(nn.Module):
    """Calls the layer with the group sizes set on it, so that checkpoint wrappers see a one-input module."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.sizes: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x, self.sizes)


@pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_grouped_equals_one_linear_per_expert(recipe: ss.Recipe, backend: str) -> None:
    """Outputs, input and weight gradients, histories and scales, every step: bitwise, empty experts included."""
    assert_same(_run(recipe, backend, grouped=True), _run(recipe, backend, grouped=False), name="grouped vs loop")


@pytest.mark.parametrize("recipe", [RECIPES["delayed"], RECIPES["mxfp8"]], ids=["delayed", "mxfp8"])
def test_grouped_with_bias_equals_loop(recipe: ss.Recipe) -> None:
    assert_same(
        _run(recipe, "emulation", grouped=True, bias=True), _run(recipe, "emulation", grouped=False, bias=True)
    )


@pytest.mark.parametrize("recipe", [RECIPES["delayed"], RECIPES["rowwise"]], ids=["delayed", "rowwise"])
def test_collect_stats_per_expert(recipe: ss.Recipe) -> None:
    """collect_stats counts each expert as its own Linear would be counted."""
    got = _run(recipe, "emulation", grouped=True, stats=True)
    assert_same(got, _run(recipe, "emulation", grouped=False, stats=True))
    assert {"moe.0", "moe.3"} <= set(got["stats"][-1])
    both = 2 if recipe.granularity(ss.Role.INPUT) is not None else 1  # fine-grained casts count both orientations
    assert got["stats"][0]["moe.1"][0].cast_elements == 16 * IN * both  # step 0: expert 1's input, 16 tokens


def test_microbatch_order_independence() -> None:
    """Scaling state and weights after each step do not depend on the order of its microbatches."""
    a = _run(RECIPES["delayed"], "emulation", grouped=True)
    b = _run(RECIPES["delayed"], "emulation", grouped=True, order=(1, 0))
    assert_same([a["state"], a["dw"]], [b["state"], b["dw"]])


def test_resume_is_bitwise(tmp_path) -> None:
    """Save after a step, load into a fresh layer and manager, go on: bitwise the uninterrupted run."""

    def steps(manager: ss.ScalingStateManager, layer: ss.nn.GroupedLinear, opt, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for sizes in ([8, 0, 16, 8], [0, 8, 8, 16]):
                with manager.forward():
                    y = layer(torch.randn(32, IN, generator=gen), sizes)
                with manager.backward():
                    (y**2).mean().backward()
            opt.step()
            opt.zero_grad()
            manager.step()

    def fresh() -> tuple:
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
        return manager, layer, torch.optim.SGD(layer.parameters(), lr=0.1)

    manager, layer, opt = fresh()
    steps(manager, layer, opt, 2, seed=1)
    torch.save({"m": manager.state_dict(), "l": layer.state_dict()}, tmp_path / "ckpt.pt")
    steps(manager, layer, opt, 2, seed=2)
    manager2, layer2, opt2 = fresh()
    saved = torch.load(tmp_path / "ckpt.pt")
    manager2.load_state_dict(saved["m"])
    layer2.load_state_dict(saved["l"])
    steps(manager2, layer2, opt2, 2, seed=2)
    assert_same([manager2.state_dict(), layer2.state_dict()], [manager.state_dict(), layer.state_dict()])


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("recipe", [RECIPES["delayed"], RECIPES["nvfp4"]], ids=["delayed", "nvfp4"])
def test_checkpointed_grouped_equals_plain(recipe: ss.Recipe, mechanism: str) -> None:
    """Activation checkpointing of every mechanism changes no bit (recompute records nothing)."""
    assert_same(_run(recipe, "emulation", grouped=True, wrap=mechanism), _run(recipe, "emulation", grouped=True))


def test_empty_expert_casts_and_records_nothing() -> None:
    """An expert without tokens: no cast of any role, its history and scale unchanged by step()."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    x = torch.randn(24, IN, requires_grad=True)
    with manager.forward():
        y = layer(x, torch.tensor([8, 0, 16, 0]))
    with manager.backward():
        y.sum().backward()
    manager.step()
    before = {e: [h.clone() for h in _state(layer.handles[e])] for e in range(E)}
    with CastSpy(manager) as spy, manager.forward():
        y = layer(torch.randn(8, IN, requires_grad=True), [8, 0, 0, 0])
    assert spy.casts_of(layer.views.of(layer.weight)[1]) == 0
    assert all(request.x.shape[0] != 0 for request in spy.requests)
    assert len(spy.requests) == 2  # expert 0's input and weight only
    with manager.backward():
        y.sum().backward()
    manager.step()
    for e in (1, 3):  # never received a token: still zero histories and scale 1
        assert_same(_state(layer.handles[e]), before[e])
        assert all(torch.equal(h, torch.zeros_like(h)) for h in _state(layer.handles[e])[::2])
    for e in (2,):  # empty in the second step only: unchanged by it
        assert_same(_state(layer.handles[e]), before[e])
    assert not torch.equal(_state(layer.handles[0])[0], before[0][0])


def _state(handle: ss.ScalingHandle) -> list[Tensor]:
    return [t for role in ss.Role for t in (handle.amax_history(role), handle.scale(role))]


def test_weight_cast_cached_per_expert() -> None:
    """Each used expert's weight is cast once per step, whatever the microbatches and recomputes (the
    uncached ones in one grouped cast); an expert first used in a later microbatch is cast then, alone;
    an optimizer step (in place) makes the next step cast them again."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    views = layer.views.of(layer.weight)
    for _ in range(2):
        with CastSpy(manager) as spy:
            for sizes in ([4, 4, 0, 8], [4, 4, 0, 8], [4, 4, 4, 4]):
                with manager.forward():
                    y = layer(torch.randn(16, IN), sizes)
                with manager.backward():
                    y.sum().backward()
        weight_casts = [r.sizes for r in spy.grouped_requests if r.sizes[0] == OUT]
        assert weight_casts == [(OUT, OUT, OUT)]  # experts 0, 1 and 3, once
        assert [spy.casts_of(v) for v in views] == [0, 0, 1, 0]  # expert 2, in the third microbatch
        opt.step()
        manager.step()
    assert layer.views.of(layer.weight) is views  # same tensors: in-place steps keep them


def test_evaluation_records_nothing() -> None:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    with torch.no_grad():
        layer(torch.randn(12, IN), [3, 3, 3, 3])
    pending = manager.buffers()["step_amax"]
    assert torch.equal(pending, torch.zeros_like(pending))


def test_names_and_rank_local_slots() -> None:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    a = ss.nn.GroupedLinear(2, IN, OUT, manager=manager)
    b = ss.nn.GroupedLinear(2, IN, OUT, manager=manager, reduce=False, first_expert=2, name="ep")
    assert [h.name for h in a.handles] == ["grouped_linear.0", "grouped_linear.1"]
    assert [h.name for h in b.handles] == ["ep.2", "ep.3"]
    assert "slots=ep.2..3" in repr(b)
    assert [h.reduce for h in a.handles + b.handles] == [True, True, False, False]


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        ([4, 4, 4], ss.errors.ArgumentValueError, "3 entries for 4 experts"),
        ([4, 4, 4, 5], ss.errors.ArgumentValueError, "sums to 17"),
        ([8, -4, 4, 8], ss.errors.ArgumentValueError, "non-negative"),
        (torch.tensor([4.0, 4.0, 4.0, 4.0]), ss.errors.ArgumentTypeError, "integer tensor"),
        ("4444", ss.errors.ArgumentTypeError, "sequence of ints"),
    ],
)
def test_bad_group_sizes(sizes: object, error: type[Exception], match: str) -> None:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager)
    with pytest.raises(error, match=match):
        layer(torch.randn(16, IN), sizes)  # type: ignore[arg-type]


def test_bad_shapes_and_arguments() -> None:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager)
    with pytest.raises(ss.errors.CastError, match=r"input must be \(tokens, 32\)"):
        layer(torch.randn(16, IN + 1), [4, 4, 4, 4])
    with pytest.raises(ss.errors.ArgumentTypeError, match="4 ScalingHandles"):
        ss.nn.grouped_linear(torch.randn(4, IN), layer.weight, None, [4, 0, 0, 0], layer.handles[:2])
    with pytest.raises(ss.errors.CastError, match="num_experts, out_features, in_features"):
        ss.nn.grouped_linear(torch.randn(4, IN), layer.weight[0], None, [4], layer.handles[:1])
    with pytest.raises(ss.errors.ArgumentValueError, match="num_experts must be a positive int"):
        ss.nn.GroupedLinear(0, IN, OUT, manager=manager)


def test_all_experts_empty() -> None:
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager)
    with OpLog() as log, manager.forward():
        y = layer(torch.randn(0, IN), [0, 0, 0, 0])
    assert y.shape == (0, OUT)
    assert not any("amax" in op or "abs" in op for op in log.ops)


def test_one_grouped_cast_per_role_and_layer() -> None:
    """Per-tensor recipes: every used expert's input in one backend call, every output gradient in another,
    and the used experts' weights in a third, once per step (cached); all of the weight tensor uncopied."""
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    with CastSpy(manager) as spy:
        for _ in range(2):
            with manager.forward():
                y = layer(torch.randn(24, IN), [8, 0, 8, 8])
            with manager.backward():
                y.sum().backward()
    # input, the used experts' weights (once: cached), gradient; then input and gradient again
    assert [r.sizes for r in spy.grouped_requests] == [(8, 8, 8), (OUT, OUT, OUT), (8, 8, 8), (8, 8, 8), (8, 8, 8)]
    assert spy.requests == []
    assert all(r.record is not None for r in spy.grouped_requests)
    layer.weight.data.mul_(2)
    layer.invalidate_casts()
    with CastSpy(manager) as spy, manager.forward():
        layer(torch.randn(32, IN), [8, 8, 8, 8])
    weights = spy.grouped_requests[1]
    assert weights.sizes == (OUT,) * E and weights.x.data_ptr() == layer.weight.data_ptr()  # every expert: no copy


def test_grouped_cast_matches_one_cast_per_group() -> None:
    """quantize_grouped against one handle.quantize per group: the same bits and the same records,
    NaN and zero groups included, just in time and from history."""
    sizes = [3, 0, 5, 4]
    x = torch.randn(12, IN) * torch.tensor([1.0, 1e-3, 1e3]).repeat_interleave(4)[:, None]
    x[9, 2] = float("nan")
    x[3:8] = 0.0
    for step in range(2):
        got, want = [], []
        for grouped in (True, False):
            torch.manual_seed(0)
            manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=2), backend="scaled_mm")
            handles = ss.nn.register_experts(manager, "g", E)
            for _ in range(step):  # a step of history for experts 0 and 2 only
                with manager.forward():
                    ss.nn.quantize_grouped([handles[0], handles[2]], x[:8] * 4 + 1, [4, 4], ss.Role.INPUT)
                manager.step()
            with manager.forward():
                if grouped:
                    qs = ss.nn.quantize_grouped(handles, x, sizes, ss.Role.INPUT, transpose=True)
                else:
                    parts = x.split(sizes)
                    qs = tuple(h.quantize(p, ss.Role.INPUT, transpose=True) if n else None
                               for h, p, n in zip(handles, parts, sizes, strict=True))
            (got if grouped else want).append([qs, manager.buffers()["step_amax"].clone()])
        assert got[0][0][1] is None
        for g in (0, 2, 3):
            assert_same_quantized(got[0][0][g], want[0][0][g], f"group {g}")
        assert torch.equal(got[0][1].isnan(), want[0][1].isnan())
        assert torch.equal(got[0][1].nan_to_num(), want[0][1].nan_to_num())


def _compiled_run(compiled: bool, sizes: list[list[int]]) -> list:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    gen = torch.Generator().manual_seed(1)
    out: list = []
    for step_sizes in sizes:
        x = torch.randn(sum(step_sizes), IN, generator=gen, requires_grad=True)
        with manager.forward():
            y = run(x, step_sizes)
        with manager.backward():
            (y**2).mean().backward()
        out += [y.detach(), x.grad, layer.weight.grad.clone()]
        opt.step()
        opt.zero_grad()
        manager.step()
        out.append(manager.state_dict())
    return out


@pytest.mark.parametrize("changing", [False, True], ids=["fixed_sizes", "changing_sizes"])
def test_compiled_fullgraph_is_bitwise_eager(changing: bool) -> None:
    """torch.compile(fullgraph=True) under aot_eager traces the grouped layer, empty experts included, and
    gives eager's bits. Group sizes are Python ints: a new pattern may compile again (see docs/moe.md)."""
    sizes = [[8, 0, 16, 8], [4, 12, 0, 16], [16, 0, 8, 8]] if changing else [[8, 0, 16, 8]] * 3
    torch._dynamo.reset()
    assert_same(_compiled_run(True, sizes), _compiled_run(False, sizes), name="compiled vs eager")


def test_saved_and_copied_layers_train_like_the_original(tmp_path) -> None:
    """torch.save of the whole layer and copy.deepcopy work (the per-expert views start empty in a copy)."""
    import copy

    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    layer = ss.nn.GroupedLinear(E, IN, OUT, manager=manager, name="moe")
    x = torch.randn(8, IN)
    with manager.forward():
        want = layer(x, [4, 0, 4, 0])
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    for other in (loaded, copy.deepcopy(layer)):
        with other.handles[0].manager.forward():
            got = other(x, [4, 0, 4, 0])
        assert torch.equal(got, want)
