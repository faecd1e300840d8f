"""Selective activation checkpointing as a property: every drawn program equals its plain twin, bitwise.

Hypothesis draws whole training programs (see ``sac_programs``): the recipe
and CPU backend; one to three blocks of FP8 layers among the ops users put
around them; how each block and the whole model are checkpointed (plain,
reentrant, selective through torch, ``ss.checkpoint`` or
``checkpoint_wrapper``, nested in any combination torch allows); for every
selective region a policy saving every op, none, or a random subset of the
ops a forward dispatches (the casts' own ``abs``, ``amax``, ``mul``,
``clamp``, ``view``, ``_to_copy``, norms and products among them), each
chosen op on every call or every k-th; the phase style, microbatches and
debug mode; and events between passes: evaluation passes of the model or
of a copy sharing the manager (before a forward, between a forward and its
backward, after a step, on this thread or another), dropped casts
(``invalidate_casts()`` of the manager or of one layer) and weight edits
(in place, or through ``.data`` followed by ``manager.invalidate_casts()``).

Every program must give exactly what the same program gives without
checkpointing and without its evaluations and dropped casts: losses of every
microbatch, input and parameter gradients and parameters of every step, and
``manager.state_dict()`` after every step, compared with ``torch.equal``.
Derandomized (the same programs in every run): 200 examples in about 25 s on
2 cores; a failure prints the program and where the runs differ.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from sac_programs import (
    BACKENDS,
    BLOCK_KINDS,
    RECIPES,
    SAC_WRAPS,
    WRAPS,
    Event,
    Policy,
    Program,
    Region,
    differences,
    forward_ops,
    run,
)
from scalestate.backends.scaled_mm.capability import cpu_runs_functional

EXAMPLES = 200

#: The scaled_mm backend's product on CPU: torch.nn.functional.scaled_mm where torch has its CPU kernel
#: (tensor-wise and row-wise), else torch._scaled_mm.
SCALED_MM_OPS = ("aten._scaled_mm_v2.default",) if cpu_runs_functional() else ("aten._scaled_mm.default",)

#: Ops of the casts and products, drawn more often than the rest.
CAST_OPS = (
    "aten.abs.default", "aten.amax.default", "aten.aminmax.default", "aten.mul.Tensor", "aten.div.Tensor",
    "aten.clamp.default", "aten.view.default", "aten._to_copy.default", "aten.linalg_vector_norm.default",
    "aten.mm.default", *SCALED_MM_OPS, "aten.reciprocal.default", "aten.t.default",
)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    kind = draw(st.sampled_from(["all", "none", "subset", "subset", "cast_ops"]))
    if kind == "all":
        ops = None
    elif kind == "none":
        ops = frozenset()
    else:
        pool = CAST_OPS if kind == "cast_ops" else forward_ops()
        ops = frozenset(draw(st.sets(st.sampled_from(pool), min_size=1, max_size=12)))
    return Policy(ops, every=draw(st.sampled_from([1, 1, 1, 2, 3])), prefer=draw(st.booleans()))


@st.composite
def regions(draw: st.DrawFn, *, reentrant: bool = True) -> Region:
    # "none" twice: about a third of the regions are not checkpointed, so that nesting varies too.
    wrap = draw(st.sampled_from([w for w in ("none", *WRAPS) if reentrant or w != "reentrant"]))
    return Region(wrap, draw(policies()) if wrap in SAC_WRAPS else None)


@st.composite
def events(draw: st.DrawFn, steps: int, microbatches: int) -> tuple[Event, ...]:
    out = []
    for _ in range(draw(st.integers(0, 5))):
        what = draw(st.sampled_from(["eval", "eval", "invalidate", "edit"]))
        # Edits change the program: never between a forward and its backward, where the
        # recompute would see another weight than the forward (in torch's own checkpointing too).
        wheres = ["before", "step"] if what == "edit" else ["before", "between", "between", "after", "step"]
        where = draw(st.sampled_from(wheres))
        at = (draw(st.integers(0, steps - 1)), -1 if where == "step" else draw(st.integers(0, microbatches - 1)), where)
        if what == "eval":
            event = Event(at, what, draw(st.sampled_from(["model", "copy"])), thread=draw(st.booleans()))
        elif what == "invalidate":
            event = Event(at, what, draw(st.sampled_from(["manager", 0, 1, 2, 3])))
        else:
            event = Event(at, what, draw(st.integers(0, 5)), how=draw(st.sampled_from(["inplace", "data"])))
        out.append(event)
    return tuple(out)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    outer = draw(regions())
    inner_reentrant = outer.wrap != "reentrant"  # torch warns (no input needs grad) for reentrant in reentrant
    blocks = tuple(
        (draw(st.sampled_from(BLOCK_KINDS)), draw(regions(reentrant=inner_reentrant)))
        for _ in range(draw(st.integers(1, 3)))
    )
    steps, microbatches = 3, draw(st.integers(1, 3))
    return Program(
        # Delayed scaling, the one with history, three times as often as each other recipe.
        recipe=draw(st.sampled_from(["delayed", "delayed", *sorted(RECIPES)])),
        backend=draw(st.sampled_from(BACKENDS)),
        blocks=blocks,
        outer=outer,
        phases=draw(st.sampled_from(["blocks", "none"])),
        microbatches=microbatches,
        steps=steps,
        debug=draw(st.booleans()),
        events=draw(events(steps, microbatches)),
        seed=draw(st.integers(0, 3)),
    )


_NORM = Policy(frozenset({"aten.linalg_vector_norm.default"}))
_ALL = Policy()


class TestEveryProgram:
    # torch's warning for an evaluation (under no_grad) of a reentrant region: nothing needs a gradient there
    @pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(programs())
    # The field reports, always run first: a norm the cast also uses saved; everything saved with an
    # evaluation of a copy sharing the manager between forward and backward; fine-grained views saved.
    @example(Program("delayed", "emulation", (("mlp", Region("sac", _NORM)), ("mlp", Region("sac", _NORM)))))
    @example(
        Program(
            "delayed", "emulation", (("tied", Region("sac", _ALL)),),
            events=(Event((1, 0, "between"), "eval", "copy"), Event((2, 1, "between"), "eval", "model", thread=True)),
        )
    )
    @example(Program("block", "emulation", (("mlp", Region("sac", Policy(frozenset({"aten.view.default"})))),)))
    @example(Program("rowwise", "scaled_mm", (("attn", Region("wrapper_sac", _ALL)),), outer=Region("sac", _ALL)))
    def test_equals_the_program_without_checkpointing(self, program):
        """Losses, gradients, parameters and state_dict() of every step: bitwise the plain program's."""
        note(f"program: {program!r}")
        plain = run(program.plain())
        got = run(program)
        found = differences(got, plain)
        assert not found, f"{program!r}\ndiffers from the program without checkpointing in: {', '.join(found[:8])}"


class TestDrawnOps:
    def test_the_casts_own_ops_can_be_named(self):
        """The ops policies are drawn from include what the casts and products dispatch."""
        ops = set(forward_ops())
        needed = {
            "aten.abs.default", "aten.amax.default", "aten.mul.Tensor", "aten.clamp.default", "aten.view.default",
            "aten._to_copy.default", "aten.linalg_vector_norm.default", "aten.mm.default", *SCALED_MM_OPS,
        }
        assert needed <= ops, sorted(needed - ops)

    @pytest.mark.parametrize("name", CAST_OPS)
    def test_cast_ops_are_real_op_names(self, name):
        """Every name the policies favour is one a forward dispatches (a typo would never match)."""
        assert name in forward_ops()
