"""`convert`: swap a model's ``torch.nn.Linear`` layers for FP8 ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalestate.errors import SlotError
from scalestate.manager import ScalingStateManager
from scalestate.nn.fsdp import wrap_weight
from scalestate.nn.linear import Linear, _free_name

__all__ = ["convert"]


def convert(
    model: torch.nn.Module,
    manager: ScalingStateManager,
    filter_fn: Callable[[str, torch.nn.Module], bool] | None = None,
    *,
    fp8_all_gather: bool = False,
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
        fp8_all_gather: under FSDP2, all-gather the new layers' weights in FP8
            (see :class:`scalestate.nn.Linear` and :mod:`scalestate.nn.fsdp`).
            Their weights then become new parameter objects that share the
            old ones' values: build the optimizer after the conversion (and
            after ``fully_shard``, as FSDP2 requires anyway).

    Models built on the ``meta`` device convert like any other; materialize
    them afterwards (``model.to_empty(device=...)``, then initialize).

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
    if not isinstance(fp8_all_gather, bool):
        raise TypeError(f"fp8_all_gather must be True or False; got {fp8_all_gather!r}")
    if type(model) is torch.nn.Linear:
        if filter_fn is None or filter_fn("", model):
            return _swap(model, manager, _free_name(manager, "linear"), fp8_all_gather)
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
    if fp8_all_gather:
        _refuse_tied_weights({found[0]: layers[key] for key, found in chosen.items()})
    for key, found in chosen.items():
        new = _swap(layers[key], manager, found[0], fp8_all_gather)
        for path in found:
            parent_path, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_path), child, new)
    return model


def _refuse_tied_weights(layers: dict[str, torch.nn.Linear]) -> None:
    """FP8 all-gather casts each weight through its own layer's slot: a weight tied
    between layers would have two slots and two casts; refuse before converting anything."""
    owners: dict[int, list[str]] = {}
    for path, layer in layers.items():
        owners.setdefault(id(layer.weight), []).append(path)
    tied = [paths for paths in owners.values() if len(paths) > 1]
    if tied:
        raise SlotError(
            f"cannot convert with fp8_all_gather=True: layers {tied[0]} share one weight, and an FP8 "
            "all-gather casts each weight with its own layer's scale. Leave all but one of them out "
            "with filter_fn, or convert with fp8_all_gather=False"
        )


def _swap(module: torch.nn.Linear, manager: ScalingStateManager, name: str, fp8_all_gather: bool) -> Linear:
    new = Linear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        manager=manager,
        name=name,
        device="meta",
        fp8_all_gather=fp8_all_gather,
    )
    new.weight = wrap_weight(module.weight, new.handle) if fp8_all_gather else module.weight
    new.bias = module.bias
    new.train(module.training)
    return new
