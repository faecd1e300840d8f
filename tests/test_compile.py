"""torch.compile: the scaling state of compiled training is eager's (invariant 13).

Every run trains 5 steps of 2 microbatches with phase blocks and step()
outside the compiled model, checkpointing inside it, and a no_grad
evaluation pass after every step; from the third step on any recompilation
is an error, and dynamo's own counters must show no graph compiled after the
second step. Under ``aot_eager`` (which keeps every op's bits) everything is
compared bitwise: outputs, gradients, parameters, histories, scales. Under
inductor, the bias-free ReLU MLP is still bitwise (its kernels compute the
same bits as ATen); the transformer block's LayerNorm and GELU kernels differ
from ATen's by an ulp, so its state is compared within the tolerances below.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import pytest
import torch
from torch._dynamo.utils import counters

import scalestate as ss
from helpers import Record, assert_bitwise, train
from sac_programs import Policy, Program, Region, differences, run
from scalestate.testing import assert_same

RECIPES = {"delayed": ss.DelayedScaling(history_len=4), "current": ss.CurrentScaling()}
#: Fine-grained recipes (as in conftest.RECIPES), each on the one backend of
#: conftest.FINE_RECIPE_BACKEND, on a representative subset (TestFineGrained): every
#: checkpoint of the fullgraph MLP, the transformer block, and Inductor. All of the per-tensor
#: matrix for them would more than double this file.
FINE_RECIPES = {
    "rowwise": ss.RowwiseScaling(), "block": ss.BlockScaling(block=8), "mxfp8": ss.MXFP8Scaling(),
    # NVFP4 with a delayed per-tensor level, the random Hadamard transform and stochastic rounding
    "nvfp4": ss.NVFP4Scaling(global_scale="delayed", history_len=4),
}
FINE_BACKEND = {"rowwise": "scaled_mm", "block": "emulation", "mxfp8": "emulation", "nvfp4": "emulation"}
ALL_RECIPES = {**RECIPES, **FINE_RECIPES}
#: Checkpointing inside the compiled model: none, torch's non-reentrant checkpoint per block,
#: checkpoint_wrapper, ss.checkpoint.
CHECKPOINTS = {
    "none": ("non_reentrant", "none"),
    "non_reentrant": ("non_reentrant", "block"),
    "wrapper": ("wrapper", "block"),
    "ss": ("ss", "block"),  # ss.checkpoint: torch's own checkpoint inside a compiled region
}
TORCH_CHECKPOINTS = ["non_reentrant", "none", "wrapper"]

#: Inductor against eager for the transformer block: the largest difference of amax histories,
#: scales and outputs, relative to the tensor's largest magnitude. Inductor does not keep the bits
#: of layer norm, GELU and attention; an ulp of difference before a cast that lands on an FP8
#: rounding boundary flips that element's rounding (an E4M3 ulp is 2**-3 of its value), and the
#: flip propagates through later layers, steps and parameter updates. How often that happens
#: depends on the CPU's vector code: measured 3.5e-7 on one machine, 2.5e-2 after 5 steps on an
#: AVX-512 one (and 7e-4 with the weights held fixed). Half an E4M3 ulp bounds those, far below
#: what a wrong scale or a mixed-up history gives (a factor of 2 or more).
BLOCK_INDUCTOR_RTOL = 2**-4
#: ... and of parameters, in learning rates per step: AdamW's first steps divide each gradient
#: element by its own magnitude, so an ulp of difference in a near-zero gradient (or one FP8
#: rounding flipped by it) moves a parameter by up to the learning rate (measured: <= 0.2).
BLOCK_INDUCTOR_PARAM_LRS_PER_STEP = 1.0


@pytest.fixture(autouse=True)
def _compile_afresh(fresh_dynamo):
    """Each test compiles from scratch (see conftest's fresh_dynamo)."""


@functools.cache
def _eager(kind: str, recipe: str, backend: str, checkpoint: str) -> Record:
    mechanism, granularity = CHECKPOINTS[checkpoint]
    return train(ALL_RECIPES[recipe], backend, kind=kind, mechanism=mechanism, granularity=granularity, evaluate=True)


def _compiled(kind: str, recipe: str, backend: str, checkpoint: str, compiler: str, fullgraph: bool) -> Record:
    mechanism, granularity = CHECKPOINTS[checkpoint]
    rec = train(
        ALL_RECIPES[recipe], backend, kind=kind, mechanism=mechanism, granularity=granularity, evaluate=True,
        compile_kwargs={"backend": compiler, "fullgraph": fullgraph},
    )
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert rec.compiles_after_warmup == 0, f"{rec.compiles_after_warmup} graphs compiled after warm-up"
    return rec


def _evaluation_recorded_nothing(rec: Record) -> None:
    for step, pending in enumerate(rec.step_amaxes):
        assert not pending.any(), f"the evaluation pass after step {step} recorded {pending.tolist()}"


class TestAotEagerIsBitwise:
    """aot_eager keeps every op's bits: compiled training must equal eager exactly."""

    @pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
    @pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_mlp(self, recipe, backend, checkpoint, fullgraph):
        """A converted MLP: outputs, gradients, parameters, histories and scales, every step."""
        got = _compiled("mlp", recipe, backend, checkpoint, "aot_eager", fullgraph)
        assert_bitwise(_eager("mlp", recipe, backend, checkpoint), got)
        _evaluation_recorded_nothing(got)

    @pytest.mark.parametrize("checkpoint", TORCH_CHECKPOINTS)
    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_transformer_block(self, recipe, backend, checkpoint):
        """The tests' transformer blocks (attention, MLP, layer norms) under fullgraph."""
        got = _compiled("block", recipe, backend, checkpoint, "aot_eager", True)
        assert_bitwise(_eager("block", recipe, backend, checkpoint), got)
        _evaluation_recorded_nothing(got)

    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_transformer_block_default_mode(self, recipe):
        """The transformer blocks, checkpointed, in torch.compile's default mode (no graph break either)."""
        got = _compiled("block", recipe, "emulation", "non_reentrant", "aot_eager", False)
        assert_bitwise(_eager("block", recipe, "emulation", "non_reentrant"), got)
        _evaluation_recorded_nothing(got)


class TestInductor:
    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_mlp_is_bitwise(self, recipe, backend):
        """The bias-free ReLU MLP, checkpointed, fullgraph: bitwise eager's, state and parameters."""
        got = _compiled("mlp", recipe, backend, "non_reentrant", "inductor", True)
        assert_bitwise(_eager("mlp", recipe, backend, "non_reentrant"), got)
        _evaluation_recorded_nothing(got)

    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_transformer_block_within_tolerance(self, recipe):
        """The transformer blocks, checkpointed: histories, scales and outputs within
        BLOCK_INDUCTOR_RTOL of eager; parameters within BLOCK_INDUCTOR_PARAM_LRS_PER_STEP."""
        want = _eager("block", recipe, "emulation", "non_reentrant")
        got = _compiled("block", recipe, "emulation", "non_reentrant", "inductor", True)
        pairs = [*zip(got.outputs, want.outputs, strict=True), *zip(got.histories, want.histories, strict=True)]
        pairs += list(zip(got.scales, want.scales, strict=True))
        for a, b in pairs:
            assert (a - b).abs().max() <= BLOCK_INDUCTOR_RTOL * b.abs().max()
        lr = 0.05  # the harness's AdamW learning rate
        for step, (mine, theirs) in enumerate(zip(got.params, want.params, strict=True)):
            for name, value in theirs.items():
                assert (mine[name] - value).abs().max() <= BLOCK_INDUCTOR_PARAM_LRS_PER_STEP * lr * (step + 1)
        _evaluation_recorded_nothing(got)


class TestFineGrained:
    """The fine-grained recipes: bitwise under aot_eager and, for the MLP, Inductor."""

    @pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
    @pytest.mark.parametrize("recipe", sorted(FINE_RECIPES))
    def test_mlp_fullgraph(self, recipe, checkpoint):
        """The converted MLP under fullgraph, with each checkpoint: bitwise eager's, every step."""
        backend = FINE_BACKEND[recipe]
        got = _compiled("mlp", recipe, backend, checkpoint, "aot_eager", True)
        assert_bitwise(_eager("mlp", recipe, backend, checkpoint), got)
        _evaluation_recorded_nothing(got)

    @pytest.mark.parametrize("recipe", sorted(FINE_RECIPES))
    def test_transformer_block(self, recipe):
        """The transformer blocks, checkpointed, fullgraph: bitwise eager's."""
        backend = FINE_BACKEND[recipe]
        got = _compiled("block", recipe, backend, "non_reentrant", "aot_eager", True)
        assert_bitwise(_eager("block", recipe, backend, "non_reentrant"), got)
        _evaluation_recorded_nothing(got)

    @pytest.mark.parametrize("recipe", sorted(FINE_RECIPES))
    def test_mlp_inductor_is_bitwise(self, recipe):
        """The bias-free ReLU MLP, checkpointed, fullgraph, Inductor: bitwise eager's."""
        backend = FINE_BACKEND[recipe]
        got = _compiled("mlp", recipe, backend, "non_reentrant", "inductor", True)
        assert_bitwise(_eager("mlp", recipe, backend, "non_reentrant"), got)
        _evaluation_recorded_nothing(got)


class TestCompiledLayer:
    def test_first_cast_inside_a_compiled_checkpoint(self):
        """A manager whose first cast happens inside a compiled, checkpointed region settles its
        device and backend there (no graph break, no error)."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="scaled_mm")
        layer = ss.nn.Linear(16, 16, bias=False, manager=m)

        def fn(x):
            return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)

        x = torch.randn(4, 16, requires_grad=True)
        with m.forward():
            y = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        with m.backward():
            y.sum().backward()
        m.step()
        assert m.backend.name == "scaled_mm" and bool((m.state_dict()["amax_history"][:, -1] > 0).all())


class TestAmaxFloor:
    """A recipe's amax_floor engaged (every gradient below it): compiled training is eager's, bitwise."""

    @staticmethod
    def _run(recipe: ss.Recipe, compiler: str | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(recipe, backend="emulation")
        model = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(),
                                                  torch.nn.Linear(32, 8, bias=False)), manager)
        call = model if compiler is None else torch.compile(model, backend=compiler, fullgraph=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e12)
        gen = torch.Generator().manual_seed(1)
        out = []
        for step in range(4):
            if step == 2:
                torch._dynamo.config.error_on_recompile = True
            x = torch.randn(4, 16, generator=gen)
            with manager.forward():
                loss = call(x).square().mean() * 1e-14  # output gradients of about 1e-15..1e-16
            with manager.backward():
                loss.backward()
            out += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            manager.step()
        state = manager.state_dict()
        grad_rows = [role == "grad_output" for _, role in state["slots"]]
        assert ((state["amax_history"][grad_rows] > 0) & (state["amax_history"][grad_rows] < 1e-12)).all()
        assert (state["scale"][grad_rows] == torch.div(57344.0, torch.tensor(1e-12))).all()  # the floor's scale
        return out, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    @pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
    @pytest.mark.parametrize("recipe", ["current", "delayed"])
    def test_bitwise_eager(self, recipe, compiler, fresh_dynamo):
        """Gradients of every step and the state after the last, fullgraph, no recompilation after step 2."""
        rec = {"current": ss.CurrentScaling(amax_floor=1e-12),
               "delayed": ss.DelayedScaling(history_len=2, amax_floor=1e-12)}[recipe]
        grads, state = self._run(rec, compiler)
        want_grads, want_state = self._run(rec, None)
        assert not counters["graph_break"]
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
        for key, value in want_state.items():
            assert torch.equal(state[key], value), key


@pytest.mark.usefixtures("fresh_dynamo")
class TestSelectiveInCompiledRegion:
    """Selective checkpointing inside a fullgraph aot_eager region: the compiler applies the policy to its
    graph, where the casts are ordinary ops that may be saved; bitwise eager without checkpointing."""

    POLICIES: ClassVar[dict[str, frozenset[str] | None]] = {
        "products": frozenset({"aten.mm.default", "aten._scaled_mm.default", "aten._scaled_mm_v2.default"}),
        "casts_and_norms": frozenset({"aten.linalg_vector_norm.default", "aten.mul.Tensor", "aten.abs.default",
                                      "aten.amax.default", "aten._to_copy.default"}),
        "all": None,
        "none": frozenset(),
    }

    @pytest.mark.parametrize("policy", sorted(POLICIES))
    # delayed with emulated products (aten.mm); row-wise with torch's row-wise kernel (aten._scaled_mm_v2)
    @pytest.mark.parametrize(("recipe", "backend"), [("delayed", "emulation"), ("rowwise", "scaled_mm")])
    def test_bitwise_eager_without_checkpointing(self, recipe, backend, policy):
        """Losses, gradients, parameters and state_dict() after every step; no graph break."""
        region = Region("sac", Policy(self.POLICIES[policy]))
        program = Program(recipe, backend, (("mlp", region), ("mlp", region)), compiler="aot_eager")
        found = differences(run(program), run(program.plain()))
        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert not found, f"differs from eager without checkpointing in: {', '.join(found[:8])}"


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("loss_compiled", [False, True], ids=["loss_outside", "loss_inside"])
@pytest.mark.parametrize(
    ("layer", "recipe"),
    [("linear", "delayed"), ("grouped", "delayed"), ("grouped", "mxfp8")],
    ids=["linear", "grouped", "grouped_mxfp8"],
)
def test_non_contiguous_output_gradient_is_bitwise_eager(layer: str, recipe: str, loss_compiled: bool) -> None:
    """An output gradient laid out column-major (a loss on y.t()), the loss outside the compiled region
    (AOT autograd hands the graph a contiguous gradient) or inside it (the traced backward hands the
    layer whatever layout it makes): eager and compiled layers both sum it row-major, so the bias
    gradient (and the rest) is bitwise eager's. An ss.nn.Linear, and grouped layers with the sizes on the
    device (delayed: grouped casts; MXFP8: each expert inside the two operators)."""
    chosen = {"delayed": ss.DelayedScaling(), "mxfp8": ss.MXFP8Scaling()}[recipe]

    def run(compiled: bool) -> list:
        torch._dynamo.reset()
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(chosen, backend="emulation")
        if layer == "linear":
            module: torch.nn.Module = ss.nn.Linear(64, 48, bias=True, manager=manager, name="l")
            args: tuple = ()
        else:
            module = ss.nn.GroupedLinear(3, 64, 48, bias=True, manager=manager, name="moe")
            args = (torch.tensor([120, 0, 80]),)

        def loss(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return (module(x, *args).t() * weights).sum()

        fn = module
        if compiled:
            fn = torch.compile(module, backend="aot_eager", fullgraph=True)
            if loss_compiled:
                loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
        x = torch.randn(200, 64, requires_grad=True)
        weights = torch.randn(48, 200)
        with manager.forward():
            value = loss(x, weights) if loss_compiled else (fn(x, *args).t() * weights).sum()
        with manager.backward():
            value.backward()
        return [value.detach(), x.grad, *(p.grad for p in module.parameters()), manager.state_dict()]

    assert_same(run(True), run(False), name=f"compiled vs eager, {layer} {recipe}, column-major output gradient")
