"""Compiled per-tensor ss.nn.Linear layers reach dynamo's graph as one call each (scalestate.nn.compiled_linear).

Dynamo then traces none of the manager's cast path: its graph holds no cast
operation (no ``abs``, no ``amax``) for those layers, while recipes and
options that must trace the manager's cast path (fine-grained scales,
``collect_stats``) still show their casts. Either way compiled training
equals eager training bit for bit. The graphs here run as dynamo hands them
over (no AOT autograd, no inductor), so the one-call function itself runs
for real at every step, outside any tracing; tests/test_compile.py covers
``aot_eager`` and inductor, where AOT autograd traces it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import scalestate as ss
from helpers import assert_bitwise, train

#: Operations every traced cast makes; none appears where the layer is one call.
_CAST_OPS = {"abs", "amax"}


@pytest.fixture(autouse=True)
def _compile_afresh(fresh_dynamo):
    """Each test compiles from scratch (see conftest's fresh_dynamo)."""


def _cast_ops(graphs: list[torch.fx.GraphModule]) -> int:
    """Nodes of dynamo's graphs (and of their subgraphs) that are one of the cast's operations."""
    found = 0
    for graph in graphs:
        for module in graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                found += sum(getattr(n.target, "__name__", n.target) in _CAST_OPS for n in module.graph.nodes)
    return found


def _compiled(recipe: ss.Recipe, backend: str, manager_kwargs: dict[str, Any]) -> tuple[Any, int]:
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    rec = train(
        recipe, backend, kind="mlp", evaluate=True, manager_kwargs=manager_kwargs,
        compile_kwargs={"backend": capture, "fullgraph": True},
    )
    assert graphs, "nothing was compiled"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert rec.compiles_after_warmup == 0, f"{rec.compiles_after_warmup} graphs compiled after warm-up"
    return rec, _cast_ops(graphs)


@pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
@pytest.mark.parametrize(
    "recipe", [ss.DelayedScaling(history_len=4), ss.CurrentScaling()], ids=["delayed", "current"]
)
def test_per_tensor_layers_are_one_call_and_bitwise_eager(recipe: ss.Recipe, backend: str) -> None:
    compiled, cast_ops = _compiled(recipe, backend, {})
    assert cast_ops == 0, f"dynamo traced {cast_ops} cast operations of per-tensor layers"
    assert_bitwise(compiled, train(recipe, backend, kind="mlp", evaluate=True))


@pytest.mark.parametrize(
    ("recipe", "manager_kwargs"),
    [(ss.DelayedScaling(history_len=4), {"collect_stats": True}), (ss.RowwiseScaling(), {})],
    ids=["collect_stats", "rowwise"],
)
def test_layers_that_trace_the_cast_path_still_do(recipe: ss.Recipe, manager_kwargs: dict[str, Any]) -> None:
    compiled, cast_ops = _compiled(recipe, "emulation", manager_kwargs)
    assert cast_ops > 0, "no cast operation in dynamo's graph: these layers must trace the manager's casts"
    assert_bitwise(compiled, train(recipe, "emulation", kind="mlp", evaluate=True, manager_kwargs=manager_kwargs))
