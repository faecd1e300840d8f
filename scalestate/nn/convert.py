"""`convert`: swap a model's ``torch.nn.Linear`` layers for FP8 ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalestate.errors import SlotError
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
    slot is named after the module's path (``"blocks.0.fc1"``); a layer shared
    by several paths becomes one FP8 layer, named after its first path.
    Subclasses of ``torch.nn.Linear`` are left alone (their forward may do
    more than a product), as are layers already converted. If a slot name is
    already taken in ``manager``, nothing is converted and a ``SlotError``
    names it.

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
    # Every path to every layer: a layer reachable twice (shared) is converted
    # once, under its first path, and replaced at all of them.
    paths: dict[int, list[str]] = {}
    layers: dict[int, torch.nn.Linear] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if path and type(module) is torch.nn.Linear:
            paths.setdefault(id(module), []).append(path)
            layers[id(module)] = module
    chosen = {key: found for key, found in paths.items() if filter_fn is None or filter_fn(found[0], layers[key])}
    taken = [found[0] for found in chosen.values() if found[0] in manager.handles]
    if taken:  # check before changing anything: a half-converted model helps no one
        raise SlotError(
            f"cannot convert: slot name(s) {taken} are already registered with this manager; "
            "convert each model once per manager, or use a fresh manager"
        )
    for key, found in chosen.items():
        new = _swap(layers[key], manager, found[0])
        for path in found:
            parent_path, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_path), child, new)
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
