"""`convert`: swap a model's ``torch.nn.Linear`` layers for FP8 ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalestate.manager import ScalingStateManager
from scalestate.nn.linear import Linear, _free_name

__all__ = ["convert"]


def convert(
    model: torch.nn.Module,
    manager: ScalingStateManager,
    filter_fn: Callable[[str, torch.nn.Module], bool] | None = None,
) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` of ``model`` by a :class:`scalestate.nn.Linear`.

    The new layers take over the *same* parameter objects, so weights are kept
    and an optimizer built before the conversion still updates them. Each
    slot is named after the module's path (``"blocks.0.fc1"``). Subclasses of
    ``torch.nn.Linear`` are left alone (their forward may do more than a
    product), as are layers already converted.

    Args:
        model: converted in place, and returned. If ``model`` itself is a
            ``torch.nn.Linear``, the FP8 layer is returned (slot name ``"linear"``).
        manager: owns the new layers' scaling state.
        filter_fn: ``filter_fn(path, module) -> bool``; only layers for which it
            returns True are converted.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> net = ss.nn.convert(net, m, filter_fn=lambda path, mod: path != "1")
        >>> [type(layer).__name__ for layer in net]
        ['Linear', 'Linear']
        >>> list(m.handles)
        ['0']
    """
    if type(model) is torch.nn.Linear:
        if filter_fn is None or filter_fn("", model):
            return _swap(model, manager, _free_name(manager, "linear"))
        return model
    targets = [
        (path, module)
        for path, module in model.named_modules()
        if path
        and type(module) is torch.nn.Linear
        and (filter_fn is None or filter_fn(path, module))
    ]
    for path, module in targets:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, child, _swap(module, manager, path))
    return model


def _swap(module: torch.nn.Linear, manager: ScalingStateManager, name: str) -> Linear:
    new = Linear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        manager=manager,
        name=name,
        device="meta",
    )
    new.weight = module.weight
    new.bias = module.bias
    new.train(module.training)
    return new
