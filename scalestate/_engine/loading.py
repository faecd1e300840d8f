"""Loading a saved state: every check a state dict must pass before the manager changes anything.

:func:`validate` reads a state dict written by
:func:`scalestate.persist.to_state_dict` (any readable format version) against
the manager's recipe and slots, and returns the tensors to load in the
manager's row order, or raises :class:`~scalestate.errors.StateDictError`
saying what differs. The format itself is :mod:`scalestate.persist`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch
from torch import Tensor

from scalestate._engine.state import State
from scalestate.errors import StateDictError
from scalestate.persist import (
    FORMAT_VERSION,
    MAX_ITERATION,
    PLAIN_TENSOR_TYPES,
    RANDOM_SINCE,
    ROLE_VALUES,
    TENSOR_KEYS,
    TensorKey,
    check_version,
    keys_of,
    recipe_to_dict,
    type_name,
)
from scalestate.recipe import Recipe, Role

__all__ = ["LoadedState", "validate"]


@attrs.frozen(eq=False)
class LoadedState:
    """A validated state dict, reordered to the manager's rows, on its device (fresh copies)."""

    iteration: int
    #: One tensor per :data:`TENSOR_KEYS` name.
    tensors: Mapping[str, Tensor]
    #: The saved seed (``None``: a format without one; the manager keeps its own).
    seed: int | None = None
    #: The saved RHT signs, on the state's device (``None`` with ``seed``).
    signs: Tensor | None = None

    @property
    def history(self) -> Tensor:
        """``amax_history``, ``[N, history_len]``."""
        return self.tensors["amax_history"]

    @property
    def scales(self) -> Tensor:
        """``scale``, ``[N]``."""
        return self.tensors["scale"]

    @property
    def step_amax(self) -> Tensor:
        """``step_amax``, ``[N]``."""
        return self.tensors["step_amax"]


def validate(sd: object, state: State, recipe: Recipe) -> LoadedState:
    """Check ``sd`` against the manager; raise :class:`StateDictError` on any defect.

    Nothing is modified here: the result is applied only if every check
    passed. The rules are in this module's docstring.
    """
    if not isinstance(sd, Mapping):
        raise StateDictError(f"expected a dict from ScalingStateManager.state_dict(); got {type(sd).__name__}")
    version = check_version(sd["format_version"]) if "format_version" in sd else FORMAT_VERSION
    values = _readkeys_of(sd, version)
    _check_recipe(values["recipe"], recipe_to_dict(recipe))
    iteration = _check_iteration(values["iteration"])
    saved = _slot_pairs(values["slots"])
    order = _row_order(saved, state)
    index = torch.tensor(order, dtype=torch.long)
    n = len(state)
    tensors = {}
    for key in TENSOR_KEYS:
        shape = (n, *key.row_shape(state.history_len))
        if key.since > version:  # an older format: the value starts afresh
            tensors[key.name] = torch.zeros(shape, dtype=key.dtype, device=state.device)
            continue
        value = _tensor(key, values[key.name], shape, saved)
        tensors[key.name] = value[index.to(value.device)].to(state.device)
    if version < RANDOM_SINCE:
        return LoadedState(iteration=iteration, tensors=MappingProxyType(tensors))
    seed, signs = _check_random(values["seed"], values["rht_signs"])
    return LoadedState(iteration, MappingProxyType(tensors), seed, signs.to(state.device))


def _check_random(seed: object, signs: object) -> tuple[int, Tensor]:
    """The saved seed and RHT signs, checked: an int in ``[0, 2**63)``, and 16 float32 signs of +-1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_ITERATION:
        raise StateDictError(f"seed must be an int in [0, 2**63); got {seed!r} ({type_name(seed)})")
    if type(signs) not in PLAIN_TENSOR_TYPES or not isinstance(signs, Tensor):
        raise StateDictError(f"rht_signs must be a float32 tensor of 16 signs; got {type_name(signs)}")
    if signs.dtype != torch.float32 or tuple(signs.shape) != (16,) or signs.layout != torch.strided or signs.is_meta:
        raise StateDictError(
            f"rht_signs must be a dense float32 tensor of shape (16,); got {signs.dtype}, shape {tuple(signs.shape)}"
        )
    values = signs.detach().cpu()
    if not bool(((values == 1.0) | (values == -1.0)).all()):
        raise StateDictError(f"rht_signs must hold only +1 and -1; got {values.tolist()}")
    return int(seed), signs.detach().clone()


def _readkeys_of(sd: Mapping[Any, Any], version: int) -> dict[str, Any]:
    """Every key's value, read once; exactly the keys of the dict's format ``version``."""
    keys = keys_of(version)
    present = list(sd)
    named = {k for k in present if isinstance(k, str)}
    missing = [k for k in keys if k not in named]
    if missing:
        raise StateDictError(
            f"state dict lacks key(s) {missing}; it was not made by ScalingStateManager.state_dict() "
            f"(which makes exactly {list(keys)} in format version {version})"
        )
    extra = sorted((k for k in present if not (isinstance(k, str) and k in keys)), key=repr)
    if extra:
        raise StateDictError(
            f"state dict has unexpected key(s) {extra}; ScalingStateManager.state_dict() makes exactly "
            f"{list(keys)}. Pass the manager only its own part of a checkpoint"
        )
    return {k: sd[k] for k in keys}


def _check_recipe(got: object, expected: dict[str, Any]) -> None:
    if not isinstance(got, Mapping):
        raise StateDictError(
            f"recipe must be a dict of the recipe's fields; got {got!r} ({type_name(got)}); "
            f"this manager has {expected}"
        )
    saved = {k: got[k] for k in got}
    diff = sorted(
        (k for k in {*expected, *saved} if k not in expected or k not in saved or not _same(saved[k], expected[k])),
        key=repr,
    )
    if diff:
        raise StateDictError(
            f"recipe differs in {diff}: saved {saved}, this manager has {expected} "
            "(field values must match in type too). Build the manager with the saved recipe to resume"
        )


def _same(got: object, expected: object) -> bool:
    """Equal and of the same type: ``True`` is not ``1``, ``4.0`` is not ``4``."""
    return type(got) is type(expected) and bool(got == expected)


def _check_iteration(iteration: object) -> int:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or not 0 <= iteration <= MAX_ITERATION:
        raise StateDictError(f"iteration must be an int in [0, 2**63); got {iteration!r} ({type_name(iteration)})")
    return int(iteration)  # a plain int, even from an int subclass


def _slot_pairs(saved: object) -> list[tuple[str, str]]:
    """The saved ``[name, role]`` pairs, each checked: strings, a known role, none twice."""
    if not isinstance(saved, (list, tuple)):
        raise StateDictError(f"slots must be a list of [name, role] pairs; got {type_name(saved)}")
    pairs: list[tuple[str, str]] = []
    first: dict[tuple[str, str], int] = {}
    for i, pair in enumerate(saved):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise StateDictError(f"slots[{i}] must be a [name, role] pair of strings; got {pair!r}")
        name, role = str(pair[0]), str(pair[1])
        if role not in ROLE_VALUES:
            hint = next((f" (Role.{r.name} is saved as {r.value!r})" for r in Role if r.name == role.upper()), "")
            raise StateDictError(
                f"slots[{i}] = {[name, role]!r} has role {role!r}, which is no Role value; "
                f"expected one of {list(ROLE_VALUES)}{hint}"
            )
        key = (name, role)
        if key in first:
            raise StateDictError(
                f"slots[{i}]: slot {name!r} role {role!r} appears twice in the state dict (also slots[{first[key]}])"
            )
        first[key] = i
        pairs.append(key)
    return pairs


def _row_order(saved: Sequence[tuple[str, str]], state: State) -> list[int]:
    """For each of the manager's rows, the row of the saved tensors that holds it."""
    position = {pair: i for i, pair in enumerate(saved)}
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


def _fmt(pairs: list[tuple[str, str]], limit: int = 6) -> str:
    """``[name:ROLE, ...]``; every role here is a valid Role value (checked by :func:`_slot_pairs`)."""
    shown = ", ".join(f"{n}:{Role(r).name}" for n, r in pairs[:limit])
    more = f" and {len(pairs) - limit} more" if len(pairs) > limit else ""
    return f"[{shown}{more}]"


def _tensor(key: TensorKey, value: object, shape: tuple[int, ...], saved: Sequence[tuple[str, str]]) -> Tensor:
    """``value`` detached, after checking its type, layout, device, dtype, shape and values."""
    name = key.name
    if not isinstance(value, Tensor):
        raise StateDictError(f"{name} must be a {key.dtype} tensor of shape {shape}; got {type_name(value)}")
    if type(value) not in PLAIN_TENSOR_TYPES:
        raise StateDictError(
            f"{name} must be a plain torch.Tensor; got a {type_name(value)} (a tensor subclass). "
            "Save plain tensors (for a DTensor: .full_tensor())"
        )
    if value.is_nested or value.layout is not torch.strided:
        kind = "nested" if value.is_nested else str(value.layout)
        raise StateDictError(f"{name} must be a dense (torch.strided) tensor; got a {kind} one. Use .to_dense()")
    if value.device.type == "meta":
        raise StateDictError(f"{name} is on the meta device: it has no values to load")
    if value.dtype != key.dtype:
        raise StateDictError(
            f"{name} must be a {key.dtype} tensor, as state_dict() saves it; got {value.dtype} "
            "(not converted: a conversion would not restore the saved values bit for bit)"
        )
    if tuple(value.shape) != shape:
        raise StateDictError(f"{name} has shape {tuple(value.shape)}; this manager expects {shape}")
    value = value.detach()
    bad = key.invalid(value).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        slot = f" (slot {saved[at[0]][0]!r} role {saved[at[0]][1]!r})" if at and at[0] < len(saved) else ""
        where = ", ".join(map(str, at))
        raise StateDictError(
            f"{name}[{where}]{slot} is {value[at].item()!r}, and {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
            f"in all break the rule: {key.rule}; the state is corrupt"
        )
    return value
