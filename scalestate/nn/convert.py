"""`convert`: swap a model's layers for FP8 ones, keeping everything else the model holds.

Which layer types it swaps, and how, comes from the registry of conversions
in :mod:`scalestate.nn.registry` (re-exported here and from ``scalestate.nn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scalestate.errors import ConversionError, ConversionTypeError, SlotError
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import free_name
from scalestate.nn.registry import (
    ConversionFn,
    ConversionRequest,
    build,
    conversion_for,
    load_integrations,
    register_conversion,
    registered_conversions,
    unregister_conversion,
)

__all__ = [
    "ConversionFn",
    "ConversionRequest",
    "convert",
    "register_conversion",
    "registered_conversions",
    "unregister_conversion",
]


# The one process-wide registry, as for backends (scalestate.backends.register_backend):
# which module types exist is a property of the program, not of a manager.
def convert(
    model: torch.nn.Module,
    manager: ScalingStateManager,
    filter_fn: Callable[[str, torch.nn.Module], bool] | None = None,
    *,
    fp8_all_gather: bool = False,
    prefix: str = "",
) -> torch.nn.Module:
    """Replace every layer of a registered type in ``model`` by its FP8 version.

    By default ``torch.nn.Linear`` becomes :class:`scalestate.nn.Linear`, and,
    when transformers is in use, its ``Conv1D`` (GPT-2) becomes
    :class:`scalestate.integrations.transformers.Conv1D`; other types are
    added with :func:`register_conversion`. The new layers take over the
    *same* parameter objects, so weights are kept, ``state_dict`` keys and
    shapes are unchanged, and an optimizer built before the conversion still
    updates them. Each slot is named after the module's path
    (``"blocks.0.fc1"``), after ``prefix`` if one is given; a layer shared by
    several paths becomes one FP8 layer, named after its first path.
    Subclasses of a registered type are left alone (their forward may do more
    than a product) unless registered with ``subclasses=True``, as are layers
    already converted. If a slot name is already taken in ``manager``,
    nothing is converted and a ``SlotError`` names it.

    Nothing the model holds is dropped: a converted layer that has child
    modules, or parameters and buffers besides those its conversion takes
    over (for ``torch.nn.Linear``: ``weight`` and ``bias``), keeps them on its
    FP8 version under the same names (so ``state_dict`` keys stay), and those
    children are converted like any other module. A layer whose FP8 version
    already uses such a name is refused with a ``ConversionError``.

    Args:
        model: converted in place, and returned. If ``model`` itself is of a
            registered type (and passes ``filter_fn`` with path ``""``), its
            FP8 version is returned, holding ``model``'s children; its slot is
            named ``prefix``, or without one ``"linear"`` for a
            ``torch.nn.Linear`` and else the class name in lower case (made
            unique in ``manager``).
        manager: owns the new layers' scaling state.
        filter_fn: ``filter_fn(path, module) -> bool``; only layers for which it
            returns True are converted. ``path`` is the module's path in
            ``model`` (``""`` for ``model`` itself), without ``prefix``.
        fp8_all_gather: under FSDP2, all-gather the new layers' weights in FP8
            (see :class:`scalestate.nn.Linear` and :mod:`scalestate.nn.fsdp`).
            Their weights then become new parameter objects that share the
            old ones' values: build the optimizer after the conversion (and
            after ``fully_shard``, as FSDP2 requires anyway).
        prefix: prepended to every slot name, as ``torch.nn.Module.named_modules``
            does (``prefix="encoder"`` names the layer at ``"0"`` ``"encoder.0"``),
            so that several models, or parts converted separately, share one
            manager. A dotted path such as ``"model.encoder"``, or ``""`` (default).

    Raises:
        ConversionTypeError: a bad argument, or a conversion that returned something
            other than a ``torch.nn.Module``.
        SlotError: a slot name is taken, or (with ``fp8_all_gather``) layers
            share a weight; nothing is converted.
        ConversionError: ``prefix`` is not a dotted path (nothing changes),
            or a converted layer holds a child, parameter or buffer under a
            name that its FP8 version already uses: ``model`` is not changed,
            but the slots of the FP8 layers built are (as after a conversion
            function that raises), so convert into a fresh manager.

    Models built on the ``meta`` device convert like any other; materialize
    them afterwards (``model.to_empty(device=...)``, then initialize).

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> net = ss.nn.convert(net, m, filter_fn=lambda path, mod: path != "1")
        >>> [type(layer).__name__ for layer in net]
        ['Linear', 'Linear']
        >>> other = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), m, prefix="head")
        >>> list(m.handles)
        ['0', 'head.0']
    """
    if not isinstance(model, torch.nn.Module):
        raise ConversionTypeError(f"convert: model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(manager, ScalingStateManager):
        raise ConversionTypeError(f"convert: manager must be a ScalingStateManager; got {type(manager).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise ConversionTypeError(
            f"convert: filter_fn must be None or callable as filter_fn(path, module); got {filter_fn!r}"
        )
    if not isinstance(fp8_all_gather, bool):
        raise ConversionTypeError(f"fp8_all_gather must be True or False; got {fp8_all_gather!r}")
    check_prefix(prefix)
    load_integrations()
    layers = find_layers(model, lambda module: conversion_for(module) is not None)
    chosen = {
        key: (module, paths) for key, (module, paths) in layers.items()
        if filter_fn is None or filter_fn(paths[0], module)
    }
    names = slot_names(manager, chosen, prefix, _root_name)
    if fp8_all_gather:
        _refuse_tied_weights({paths[0]: module for module, paths in chosen.values()})
    # Build every replacement before placing any: a conversion that fails leaves the model as it was.
    built = {}
    for key, (module, _) in chosen.items():
        fn = conversion_for(module)
        assert fn is not None  # find_layers matched only modules that have one
        built[key] = build(fn, module, ConversionRequest(manager, names[key], fp8_all_gather))
    return swap_layers(model, chosen, built)


def find_layers(
    model: torch.nn.Module, match: Callable[[torch.nn.Module], bool]
) -> dict[int, tuple[torch.nn.Module, list[str]]]:
    """Every module of ``model`` (itself included, path ``""``) for which ``match`` holds, keyed by
    ``id``, with every path that reaches it, first path first: a layer reachable by several paths
    (shared) is converted once, under its first path, and placed at all of them. The modules
    inside a matched one are walked too."""
    found: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in found:
            found[id(module)][1].append(path)
        elif match(module):
            found[id(module)] = (module, [path])
    return found


def check_prefix(prefix: object) -> None:
    """Raise unless ``prefix`` is ``""`` or a dotted path of non-empty names (``"model.encoder"``)."""
    if not isinstance(prefix, str):
        raise ConversionTypeError(
            f"prefix must be a string such as 'encoder' (prepended to every slot name); got {type(prefix).__name__}"
        )
    if prefix and not all(prefix.split(".")):
        raise ConversionError(
            f"prefix {prefix!r} is not a dotted module path: it has an empty name (a leading, trailing or "
            "doubled '.'); pass e.g. 'encoder' or 'model.encoder', which names the layer at '0' 'encoder.0'"
        )


def slot_names(
    manager: ScalingStateManager,
    chosen: dict[int, tuple[torch.nn.Module, list[str]]],
    prefix: str,
    root_name: Callable[[torch.nn.Module], str],
) -> dict[int, str]:
    """The slot name of each chosen layer: ``prefix`` joined to its first path with a ``"."``; for
    the model itself (path ``""``), ``prefix``, or without one ``root_name(model)`` made unique in
    ``manager``. Raises ``SlotError`` if any is taken, before any layer changes."""
    names = {}
    for key, (module, paths) in chosen.items():
        if paths[0]:
            names[key] = f"{prefix}.{paths[0]}" if prefix else paths[0]
        else:
            names[key] = prefix or free_name(manager, root_name(module))
    refuse_taken_names(manager, list(names.values()))
    return names


def refuse_taken_names(manager: ScalingStateManager, names: list[str]) -> None:
    """Raise ``SlotError`` if any of ``names`` is a slot of ``manager``: checked before any layer
    changes, since a half-converted model helps no one."""
    taken = [name for name in names if name in manager.handles]
    if taken:
        raise SlotError(
            f"cannot convert: slot name(s) {taken} are already registered with this manager; "
            "convert each model once per manager, and give each further model (or part converted on "
            "its own) a name prefix of its own: convert(model, manager, prefix='encoder')"
        )


def swap_layers(
    model: torch.nn.Module,
    chosen: dict[int, tuple[torch.nn.Module, list[str]]],
    built: dict[int, torch.nn.Module],
) -> torch.nn.Module:
    """Put each ``built[key]`` in place of ``chosen[key]`` at every one of its paths in ``model``, and
    return ``model`` (or the new root, if ``model`` itself was chosen).

    Each new layer first takes over what the old one holds and it does not (see
    :func:`keep_members`): the children, converted or not, stay where the model had them. All
    checks run before ``model`` changes. Paths are placed parents first, so that a layer inside a
    converted one lands in the new one.
    """
    for key, (module, paths) in chosen.items():
        refuse_clashes(module, built[key], paths[0])
    for key, (module, _) in chosen.items():
        keep_members(module, built[key])
    root = model
    placements = []
    for key, (_, paths) in chosen.items():
        for path in paths:
            if path:
                placements.append((path.count("."), path, built[key]))
            else:
                root = built[key]
    for _, path, new in sorted(placements, key=lambda placement: placement[0]):
        parent, _, child = path.rpartition(".")
        setattr(root.get_submodule(parent), child, new)
    return root


def _tables(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What ``module`` itself holds, by kind: child modules, parameters and buffers (``None`` entries included)."""
    return {"child module": module._modules, "parameter": module._parameters, "buffer": module._buffers}


def _members(module: torch.nn.Module) -> list[tuple[str, str, Any]]:
    """``(kind, name, value)`` of every child module, parameter and buffer ``module`` itself holds
    (each name once, even where one object is held under two names)."""
    return [
        (kind, name, value) for kind, table in _tables(module).items() for name, value in table.items()
        if value is not None
    ]


def refuse_clashes(old: torch.nn.Module, new: torch.nn.Module, path: str) -> None:
    """Raise ``ConversionError`` unless ``new`` (the FP8 version of ``old``) can keep everything
    ``old`` holds: nothing of ``old`` may be lost.

    A parameter or buffer of ``old`` that ``new`` holds as the same kind under the same name is
    the conversion's (``weight`` and ``bias``, taken over or wrapped); a child module under the same
    name must be the very same module, since :func:`swap_layers` converts children itself. Any
    other name of ``old``'s must be free on ``new``, for :func:`keep_members` to put it there.
    """
    tables = _tables(new)
    for kind, name, value in _members(old):
        mine = tables[kind].get(name)
        if mine is not None:
            if kind != "child module" or mine is value:
                continue
            clash = f"a child module {name!r} of its own ({type(mine).__name__}) in its place"
        elif name in tables[kind]:
            clash = f"{name!r} set to None"
        elif hasattr(new, name):
            clash = f"the name {name!r} for something else"
        else:
            continue
        where = f"layer {path!r}" if path else "the model itself"
        raise ConversionError(
            f"cannot convert {where} ({type(old).__name__}): it holds a {kind} {name!r} "
            f"({type(value).__name__}), and its FP8 version ({type(new).__name__}) has {clash}, so "
            f"something would be lost. Rename that {kind} or move it out of the layer, or leave the layer "
            "out with a filter. The model was not changed, but the FP8 layers were built, and their slots "
            "stay registered: convert into a fresh manager"
        )


def keep_members(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """``new`` takes over every child module, parameter and buffer of ``old`` that it does not hold
    under the same name (:func:`refuse_clashes` has checked that the name is free): the same
    objects under the same names, a buffer with its persistence."""
    tables = _tables(new)
    for kind, name, value in _members(old):
        if tables[kind].get(name) is not None:
            continue
        if kind == "child module":
            new.add_module(name, value)
        elif kind == "parameter":
            new.register_parameter(name, value)
        else:
            new.register_buffer(name, value, persistent=name not in old._non_persistent_buffers_set)


def _root_name(module: torch.nn.Module) -> str:
    """The slot name of a converted model itself, before it is made unique: ``"linear"`` for a
    ``torch.nn.Linear``, else the class name in lower case."""
    return "linear" if type(module) is torch.nn.Linear else type(module).__name__.lower()


def _refuse_tied_weights(layers: dict[str, torch.nn.Module]) -> None:
    """FP8 all-gather casts each weight through its own layer's slot: a weight tied
    between layers would have two slots and two casts; refuse before converting anything."""
    owners: dict[int, list[str]] = {}
    for path, layer in layers.items():
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(path)
    tied = [paths for paths in owners.values() if len(paths) > 1]
    if tied:
        raise SlotError(
            f"cannot convert with fp8_all_gather=True: layers {tied[0]} share one weight, and an FP8 "
            "all-gather casts each weight with its own layer's scale. Leave all but one of them out "
            "with filter_fn, or convert with fp8_all_gather=False"
        )
