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


def _grouped(layers: int) -> tuple[torch.nn.ModuleList, ss.ScalingStateManager, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    experts = torch.nn.ModuleList(ss.nn.GroupedLinear(4, 32, 32, manager=manager, name=f"g{i}") for i in range(layers))
    return experts, manager, torch.randn(16, 32, requires_grad=True), torch.tensor([5, 0, 7, 4])


def _run_grouped(experts: torch.nn.ModuleList, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    for layer in experts:
        x = layer(x, sizes)
    return x


def _grouped_kernel_sources(layers: int) -> tuple[set[str], int, torch.Tensor]:
    """As :func:`_kernel_sources`, for a stack of GroupedLinear layers on the device-size path."""
    torch._dynamo.reset()
    experts, manager, x, sizes = _grouped(layers)
    compiled = torch.compile(_run_grouped, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(experts, x, sizes).sum().backward())
    assert len(codes) == 2, "expected one forward and one backward graph"
    sources = {source for code in codes for source in _KERNEL.findall(code)}
    return sources, sum(len(_CALL.findall(code)) for code in codes), manager.buffers()["step_amax"]


def test_identical_grouped_layers_share_kernels() -> None:
    """Grouped layers with the sizes on the device index their slots' rows through the rows' own index
    tensors: a stack one layer deeper compiles no new kernel (a literal list of rows, a constant of
    each layer's graph, gave every layer kernels of its own)."""
    five, five_calls, _ = _grouped_kernel_sources(5)
    six, six_calls, recorded = _grouped_kernel_sources(6)
    assert six_calls > five_calls, "more layers make more kernel calls"
    assert len(six) == len(five), f"{len(five)} distinct kernels for 5 grouped layers, {len(six)} for 6"
    experts, manager, x, sizes = _grouped(6)
    _run_grouped(experts, x, sizes).sum().backward()
    assert torch.equal(recorded, manager.buffers()["step_amax"])
