"""Shared fixtures: every recipe x every CPU backend."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate import backends as registry

RECIPES = {
    "delayed": ss.DelayedScaling(history_len=4),
    "current": ss.CurrentScaling(),
}
CPU_BACKENDS = ("emulation", "scaled_mm")


@pytest.fixture(params=sorted(RECIPES))
def recipe(request: pytest.FixtureRequest) -> ss.Recipe:
    return RECIPES[request.param]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def manager(recipe: ss.Recipe, backend: str) -> ss.ScalingStateManager:
    return ss.ScalingStateManager(recipe, backend=backend)


@pytest.fixture
def delayed() -> ss.ScalingStateManager:
    return ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")


@pytest.fixture(autouse=True)
def _isolate_registry():
    """Tests may register backends; restore the process-wide table afterwards."""
    saved = dict(registry._registry)
    yield
    registry._registry.clear()
    registry._registry.update(saved)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
