"""Pickling, deep copies and ``torch.save`` of managers and converted models, at any time."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import scalestate as ss

I, G = ss.Role.INPUT, ss.Role.GRAD_OUTPUT


def _torch_roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
    "torch.save": _torch_roundtrip,
}


def _model() -> tuple[ss.ScalingStateManager, nn.Module]:
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    model = ss.nn.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), manager)
    return manager, model


def _manager_of(model: nn.Module) -> ss.ScalingStateManager:
    return model[0].handle.manager  # type: ignore[index,no-any-return]


def _train_step(model: nn.Module, step: int, *, forward_only: bool = False) -> None:
    manager = _manager_of(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) * (1 + step)
    with manager.forward():
        loss = model(x).square().mean()
    if forward_only:
        return
    with manager.backward():
        loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad  # type: ignore[operator]
            p.grad = None
    manager.step()


def _assert_same_state(a: ss.ScalingStateManager, b: ss.ScalingStateManager) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), key
        else:
            assert sa[key] == sb[key], key


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (ka, pa), (kb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert ka == kb and torch.equal(pa, pb), ka


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("when", ["between_steps", "mid_step", "after_evaluation"])
def test_a_copied_model_trains_on_exactly_like_the_original(how, when):
    """Copy a converted model (with its manager) at any point; both continue bit for bit alike."""
    _, model = _model()
    for step in range(2):
        _train_step(model, step)
    if when == "mid_step":  # forward casts recorded and pending, weight casts cached
        x = torch.randn(4, 8)
        with _manager_of(model).forward():
            model(x)
    if when == "after_evaluation":
        with torch.no_grad():
            model(torch.randn(4, 8) * 100)
    twin = COPIES[how](model)
    assert _manager_of(twin) is not _manager_of(model)  # the copy has its own manager
    _assert_same_state(_manager_of(model), _manager_of(twin))
    for step in range(2, 5):
        _train_step(model, step)
        _train_step(twin, step)
        _assert_same_state(_manager_of(model), _manager_of(twin))
        _assert_same_params(model, twin)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_manager_keeps_every_value(how):
    manager, model = _model()
    _train_step(model, 0)
    _train_step(model, 1, forward_only=True)  # mid-step: amaxes pending
    twin = COPIES[how](manager)
    _assert_same_state(manager, twin)
    assert twin.iteration == manager.iteration and list(twin.handles) == list(manager.handles)
    assert twin.nonfinite_counts() == manager.nonfinite_counts()
    twin.step()  # the copy can finish the step on its own
    assert twin.iteration == 2


def test_a_copy_made_inside_a_block_has_the_phase_but_not_the_block():
    manager, _ = _model()
    with manager.forward():
        twin = copy.deepcopy(manager)
    assert twin.phase is ss.Phase.FORWARD
    twin.step()  # no block is open in the copy


def test_an_ema_copy_shares_the_live_manager():
    """deepcopy with the manager in the memo: the copy's layers use the live manager and,
    evaluated under no_grad, record nothing."""
    manager, model = _model()
    _train_step(model, 0)
    ema = copy.deepcopy(model, memo={id(manager): manager})
    assert _manager_of(ema) is manager
    before = manager.state_dict()
    with torch.no_grad():
        ema(torch.randn(4, 8) * 1000)
    assert torch.equal(manager.state_dict()["step_amax"], before["step_amax"])
    _train_step(model, 1)  # training the live model is unaffected
    assert manager.iteration == 2
