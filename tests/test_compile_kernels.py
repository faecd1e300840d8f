"""Compiled layers of one shape share their kernels: inductor compiles each distinct kernel source once.

Compiled casts read a slot's scale, accumulator and history through the
slot's own index tensor, which is an input of the graph. If they read them
through a literal row instead (``in_ptr[row * H + H - 1]``), every layer gets
its own kernel source, so a model with more layers compiles more kernels.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import scalestate as ss

#: A C++ kernel defined in inductor's generated CPU code: ``name = async_compile.cpp_pybinding([...], '''source''')``
#: (a source generated twice in one graph is defined once).
_KERNEL = re.compile(r"cpp_pybinding\(\[.*?\], r?'''(.*?)'''", re.S)
#: A call of one in the graph's ``call()``.
_CALL = re.compile(r"^\s+cpp_fused_\w+\(", re.M)


def _model(layers: int, recipe: ss.Recipe) -> tuple[torch.nn.Module, ss.ScalingStateManager, torch.Tensor]:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(recipe, backend="emulation")
    model = torch.nn.Sequential(*(ss.nn.Linear(32, 32, manager=manager, name=f"l{i}") for i in range(layers)))
    return model, manager, torch.randn(8, 32, requires_grad=True)


def _kernel_sources(layers: int, recipe: ss.Recipe) -> tuple[set[str], int, torch.Tensor]:
    """The distinct kernel sources inductor generates for a fresh stack of ``layers`` identical
    ss.nn.Linear, the number of kernel calls, and the amaxes the compiled pass recorded."""
    torch._dynamo.reset()
    model, manager, x = _model(layers, recipe)
    compiled = torch.compile(model)
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    assert len(codes) == 2, "expected one forward and one backward graph"
    sources = {source for code in codes for source in _KERNEL.findall(code)}
    return sources, sum(len(_CALL.findall(code)) for code in codes), manager.buffers()["step_amax"]


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.CurrentScaling()], ids=["delayed", "current"])
def test_identical_layers_share_kernels(recipe: ss.Recipe) -> None:
    """The number of distinct kernel sources does not grow with the number of identical layers."""
    two, two_calls, _ = _kernel_sources(2, recipe)
    six, six_calls, recorded = _kernel_sources(6, recipe)
    assert six_calls > two_calls, "more layers make more kernel calls"
    assert len(six) == len(two), (
        f"{len(two)} distinct kernels for 2 layers, {len(six)} for 6: a layer's kernels depend on its slots"
    )
    # the shared kernels record each layer's amaxes into its own rows, as eager does
    model, manager, x = _model(6, recipe)
    model(x).sum().backward()
    assert torch.equal(recorded, manager.buffers()["step_amax"])
