"""Shared fixtures: every recipe x every CPU backend."""

from __future__ import annotations

import os

import pytest
import torch

# Without a CUDA GPU, the cuda backend's Triton kernels run under Triton's interpreter on CPU
# tensors (tests/test_cuda_backend.py). Triton reads the variable when the kernels' module is
# first imported, so it is set here, before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import scalestate as ss
from helpers import RECIPES, backend_for
from scalestate.backends import Backend

CPU_BACKENDS = ("emulation", "scaled_mm")
#: Per-tensor recipes run on every CPU backend everywhere. The slowest parity files (those that
#: set ``FINE_RECIPES_ON_ONE_BACKEND = True``) run each fine-grained recipe on one backend only,
#: which would otherwise more than double them: row-wise on scaled_mm (torch's own row-wise
#: kernel), block, MX and NVFP4 on emulation (scaled_mm falls back to those very emulated products).
#: The other pairs run in every other file that takes the fixtures.
FINE_RECIPE_BACKEND = {"rowwise": "scaled_mm", "block": "emulation", "mxfp8": "emulation", "nvfp4": "emulation"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the fine-grained recipe x backend pairs that FINE_RECIPE_BACKEND leaves out."""
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        recipe, backend = params.get("recipe"), params.get("backend")
        one_backend = getattr(getattr(item, "module", None), "FINE_RECIPES_ON_ONE_BACKEND", False)
        if one_backend and recipe in FINE_RECIPE_BACKEND and backend != FINE_RECIPE_BACKEND[recipe]:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=sorted(RECIPES))
def recipe(request: pytest.FixtureRequest) -> ss.Recipe:
    return RECIPES[request.param]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str | Backend:
    """A backend name, or for scaled_mm with a recipe its CPU kernel cannot run, an object.

    The test id stays the name (``[block-scaled_mm]``); see :func:`helpers.backend_for`.
    """
    name = str(request.param)
    if "recipe" not in request.fixturenames:
        return name
    return backend_for(request.getfixturevalue("recipe"), name)


@pytest.fixture
def fresh_dynamo():
    """The test compiles from scratch with dynamo's counters cleared, and a failed one leaves
    recompilation allowed."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


@pytest.fixture
def manager(recipe: ss.Recipe, backend: str | Backend) -> ss.ScalingStateManager:
    return ss.ScalingStateManager(recipe, backend=backend)


@pytest.fixture
def delayed() -> ss.ScalingStateManager:
    return ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
