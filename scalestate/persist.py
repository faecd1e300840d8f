"""The manager's ``state_dict``: plain values only, validated before use.

Keys (format version 1):

``format_version`` (int)
    1.
``recipe`` (dict)
    ``kind`` (``"DelayedScaling"`` or ``"CurrentScaling"``) and every recipe
    field as a plain value (formats by their string value).
``iteration`` (int)
    Number of ``step()`` calls so far.
``slots`` (list of ``[name, role]`` string pairs)
    One per row of the tensors below, in that order.
``amax_history`` (float32 tensor ``[N, history_len]``)
    Amax history per slot, newest last.
``scale`` (float32 tensor ``[N]``)
    Current scale per slot.
``step_amax`` (float32 tensor ``[N]``)
    Amax recorded since the last ``step()`` (zeros when saved between steps).

Everything is a dict, list, str, int, bool or tensor, so
``torch.load(path, weights_only=True)`` loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from scalestate.errors import StateDictError
from scalestate.recipe import Recipe, Role
from scalestate.state import State

__all__ = ["FORMAT_VERSION", "LoadedState", "recipe_to_dict", "to_state_dict", "validate"]

FORMAT_VERSION = 1
_KEYS = ("format_version", "recipe", "iteration", "slots", "amax_history", "scale", "step_amax")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain values: its kind and every field."""
    out: dict[str, Any] = {"kind": type(recipe).__name__}
    for field in attrs.fields(type(recipe)):
        value = getattr(recipe, field.name)
        out[field.name] = getattr(value, "value", value)
    return out


def to_state_dict(state: State, recipe: Recipe) -> dict[str, Any]:
    """A copy of ``state`` as a state dict (tensors are cloned, not aliased)."""
    return {
        "format_version": FORMAT_VERSION,
        "recipe": recipe_to_dict(recipe),
        "iteration": state.iteration,
        "slots": [[s.name, s.role.value] for s in state.slots],
        "amax_history": state.history.detach().clone(),
        "scale": state.scales.detach().clone(),
        "step_amax": state.step_amax.detach().clone(),
    }


@attrs.frozen(eq=False)
class LoadedState:
    """A validated state dict, reordered to the manager's rows."""

    iteration: int
    history: Tensor
    scales: Tensor
    step_amax: Tensor


def validate(sd: object, state: State, recipe: Recipe) -> LoadedState:
    """Check ``sd`` against the manager; raise :class:`StateDictError` on any mismatch.

    Nothing is modified here: the result is applied only if every check passed.
    """
    if not isinstance(sd, Mapping):
        raise StateDictError(f"expected a dict from ScalingStateManager.state_dict(); got {type(sd).__name__}")
    missing = [k for k in _KEYS if k not in sd]
    if missing:
        raise StateDictError(f"state dict lacks key(s) {missing}; it was not made by ScalingStateManager.state_dict()")
    if sd["format_version"] != FORMAT_VERSION:
        raise StateDictError(
            f"state dict has format_version {sd['format_version']!r}; this scalestate reads {FORMAT_VERSION}"
        )
    expected_recipe = recipe_to_dict(recipe)
    if sd["recipe"] != expected_recipe:
        got = sd["recipe"] if isinstance(sd["recipe"], Mapping) else {}
        diff = sorted(k for k in set(expected_recipe) | set(got) if got.get(k) != expected_recipe.get(k))
        raise StateDictError(
            f"recipe differs in {diff}: saved {dict(got)}, this manager has {expected_recipe}. "
            "Build the manager with the saved recipe to resume"
        )
    iteration = sd["iteration"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise StateDictError(f"iteration must be an int >= 0; got {iteration!r}")
    order = _row_order(sd["slots"], state)
    n, h = len(state), state.history_len
    history = _tensor(sd, "amax_history", (n, h))
    scales = _tensor(sd, "scale", (n,))
    step_amax = _tensor(sd, "step_amax", (n,))
    if not bool(torch.isfinite(history).all()) or bool((history < 0).any()):
        raise StateDictError("amax_history holds negative or non-finite values; the state is corrupt")
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise StateDictError("scale holds zero, negative or non-finite values; the state is corrupt")
    if bool(torch.isnan(step_amax).any()) or bool((step_amax < 0).any()):
        raise StateDictError("step_amax holds negative or NaN values; the state is corrupt")
    index = torch.tensor(order, dtype=torch.long)
    return LoadedState(
        iteration=iteration,
        history=history[index].to(state.device),
        scales=scales[index].to(state.device),
        step_amax=step_amax[index].to(state.device),
    )


def _row_order(saved: object, state: State) -> list[int]:
    """For each of the manager's rows, the row of the saved tensors that holds it."""
    if not isinstance(saved, (list, tuple)):
        raise StateDictError(f"slots must be a list of [name, role] pairs; got {type(saved).__name__}")
    position: dict[tuple[str, str], int] = {}
    for i, pair in enumerate(saved):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise StateDictError(f"slots[{i}] must be a [name, role] pair of strings; got {pair!r}")
        key = (pair[0], pair[1])
        if key in position:
            raise StateDictError(f"slot {key[0]!r} role {key[1]!r} appears twice in the state dict")
        position[key] = i
    ours = [(s.name, s.role.value) for s in state.slots]
    missing = sorted(set(ours) - set(position))
    unexpected = sorted(set(position) - set(ours))
    if missing or unexpected:
        raise StateDictError(
            "the state dict's slots do not match this manager's: "
            f"missing from the state dict {_fmt(missing)}; not registered here {_fmt(unexpected)}. "
            "Register the same modules (same names and roles) before loading"
        )
    return [position[k] for k in ours]


def _role_name(value: str) -> str:
    try:
        return Role(value).name
    except ValueError:
        return value


def _fmt(pairs: list[tuple[str, str]], limit: int = 6) -> str:
    shown = ", ".join(f"{n}:{_role_name(r)}" for n, r in pairs[:limit])
    more = f" and {len(pairs) - limit} more" if len(pairs) > limit else ""
    return f"[{shown}{more}]"


def _tensor(sd: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> Tensor:
    value = sd[key]
    if not isinstance(value, Tensor):
        raise StateDictError(f"{key} must be a tensor; got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise StateDictError(f"{key} has shape {tuple(value.shape)}; this manager expects {shape}")
    if not value.is_floating_point():
        raise StateDictError(f"{key} must be a floating-point tensor; got {value.dtype}")
    return value.detach().to(torch.float32)
