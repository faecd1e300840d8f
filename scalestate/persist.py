"""The manager's ``state_dict``: plain values only, validated strictly before use.

Keys (format version 2), exactly these:

``format_version`` (int)
    2.
``recipe`` (dict)
    ``kind`` (the recipe's class name, e.g. ``"DelayedScaling"``) and every
    recipe field as a plain value (formats by their string value), except
    ``amax_floor`` while it is ``0.0`` (its default; a state saved before the
    field existed is such a state). A missing ``amax_floor`` reads as ``0.0``.
``iteration`` (int)
    Number of ``step()`` calls so far.
``slots`` (list of ``[name, role]`` string pairs)
    One per row of the tensors below, in that order, sorted by name and
    role (whatever the registration order); ``role`` is a
    :class:`~scalestate.Role` value (``"input"``, ``"weight"``, ``"grad_output"``).
``amax_history`` (float32 tensor ``[N, history_len]``)
    Amax history per slot, newest last.
``scale`` (float32 tensor ``[N]``)
    Current scale per slot.
``step_amax`` (float32 tensor ``[N]``)
    Amax recorded since the last ``step()`` (zeros when saved between steps).
``nonfinite_counts`` (int64 tensor ``[N]``)
    Steps whose amax was NaN or infinite, per slot (see
    :meth:`~scalestate.ScalingStateManager.nonfinite_counts`).

Format version 1 (scalestate 0.1 and 0.2 before the non-finite counters) is
the same without ``nonfinite_counts``; it still loads, with every count 0.

Everything is a dict, list, str, int, bool or tensor, so
``torch.load(path, weights_only=True)`` loads it.

:func:`validate` (what ``load_state_dict`` runs) accepts a dict only if a load
restores it bit for bit and the manager can go on from it; anything else
raises :class:`~scalestate.errors.StateDictError` (a ``ValueError``) naming
the key, what was expected and what it holds, before anything is modified:

* the keys are exactly those of its format version: none missing, none extra;
* ``format_version`` is the int 2 or 1 (not ``True``, ``2.0`` or a tensor);
* ``recipe`` has exactly the manager's recipe fields, each equal *and of the
  same type* (``4.0`` or ``True`` is not the int ``4`` or ``1``);
* ``iteration`` is an int (not a bool) in ``[0, 2**63)``;
* ``slots`` is a list (or tuple) of ``[name, role]`` pairs of strings, every
  role a Role value, no pair twice, and the same pairs as the manager's
  (any order: rows are matched by name and role);
* every tensor is a dense tensor (``torch.Tensor`` or ``torch.nn.Parameter``;
  not a subclass such as ``DTensor``, not sparse, nested or on the ``meta``
  device) of exactly the dtype and shape above: no dtype is converted, as a
  conversion would not restore the saved bits. Any real device, any strides
  and ``requires_grad`` are fine (values are copied);
* values: ``amax_history`` entries are finite and ``>= 0`` (0 marks no
  history yet); ``scale`` entries are finite and at least the smallest normal
  float32 (``2**-126``, the least scale a step makes; a subnormal scale has
  no finite inverse); ``step_amax`` entries are ``>= 0``, ``+inf`` or NaN
  (what casts record; the next ``step()`` applies the non-finite policy to
  them, as it would have without the save); ``nonfinite_counts`` entries
  are ``>= 0``.

Each tensor key is one row of :data:`TENSOR_KEYS` (dtype, shape, value rule
and where the state holds it); a new kind of per-slot tensor is one more row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch
from torch import Tensor

from scalestate._engine.state import State
from scalestate.errors import RecipeError, StateDictError
from scalestate.math import FLOAT32_TINY
from scalestate.recipe import RECIPES, Format, Recipe, Role, described_fields

__all__ = [
    "FORMAT_VERSION",
    "TENSOR_KEYS",
    "LoadedState",
    "TensorKey",
    "is_state_dict",
    "read_format_version",
    "recipe_from_dict",
    "recipe_to_dict",
    "to_state_dict",
    "validate",
]

FORMAT_VERSION = 2
#: Versions this scalestate reads.
_READABLE_VERSIONS = (1, 2)
#: Largest ``iteration`` accepted: it must fit an int64.
_MAX_ITERATION = 2**63 - 1
#: Tensor types taken as they are; any other subclass (DTensor, FakeTensor, ...) is refused.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)
_ROLE_VALUES = tuple(r.value for r in Role)


@attrs.frozen
class TensorKey:
    """One tensor of the state dict: a row per slot, of one dtype, with a rule for its values."""

    #: The state dict key.
    name: str
    #: The only dtype accepted (no conversion: a load is bitwise).
    dtype: torch.dtype
    #: The shape of one slot's row, from the recipe's ``history_len``.
    row_shape: Callable[[int], tuple[int, ...]]
    #: Where the manager's state holds it: ``[N, *row_shape]`` rows in use.
    read: Callable[[State], Tensor]
    #: A mask of the entries that break the rule.
    invalid: Callable[[Tensor], Tensor]
    #: The rule, as an error message states it.
    rule: str
    #: The format version that introduced it (older dicts load it as zeros).
    since: int = 1


def _invalid_amax(t: Tensor) -> Tensor:
    return ~torch.isfinite(t) | (t < 0)


def _invalid_scale(t: Tensor) -> Tensor:
    return ~torch.isfinite(t) | (t < FLOAT32_TINY)


def _invalid_step_amax(t: Tensor) -> Tensor:
    return t < 0  # NaN and +inf are observations the next step() handles


#: Every tensor of the state dict, in the order they are saved and checked.
TENSOR_KEYS: tuple[TensorKey, ...] = (
    TensorKey(
        name="amax_history",
        dtype=torch.float32,
        row_shape=lambda history_len: (history_len,),
        read=lambda state: state.history,
        invalid=_invalid_amax,
        rule="amax history entries must be finite and >= 0",
    ),
    TensorKey(
        name="scale",
        dtype=torch.float32,
        row_shape=lambda history_len: (),
        read=lambda state: state.scales,
        invalid=_invalid_scale,
        rule=f"scales must be finite and >= {FLOAT32_TINY!r} (the smallest normal float32)",
    ),
    TensorKey(
        name="step_amax",
        dtype=torch.float32,
        row_shape=lambda history_len: (),
        read=lambda state: state.step_amax,
        invalid=_invalid_step_amax,
        rule="step amaxes must be >= 0, +inf or NaN",
    ),
    TensorKey(
        name="nonfinite_counts",
        dtype=torch.int64,
        row_shape=lambda history_len: (),
        read=lambda state: state.nonfinite,
        invalid=lambda t: t < 0,
        rule="non-finite counts must be >= 0",
        since=2,
    ),
)


def _keys(version: int) -> tuple[str, ...]:
    """The keys of a state dict of format ``version``."""
    return ("format_version", "recipe", "iteration", "slots", *(k.name for k in TENSOR_KEYS if k.since <= version))


_KEYS = _keys(FORMAT_VERSION)
#: The keys by which a state dict of any format version is recognized (see :func:`is_state_dict`).
_RECOGNIZED_BY = ("format_version", "recipe", "slots")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain values: its kind and every field, but a field added since recipes were
    first saved (``amax_floor``) while it holds its default, so that such states are unchanged."""
    out: dict[str, Any] = {"kind": type(recipe).__name__}
    for name, value in described_fields(recipe).items():
        out[name] = getattr(value, "value", value)
    return out


def recipe_from_dict(saved: object) -> Recipe:
    """The recipe a state dict's ``recipe`` entry describes (the inverse of :func:`recipe_to_dict`).

    Raises:
        StateDictError: not a dict, an unknown ``kind``, or fields the recipe does not take.
    """
    if not isinstance(saved, Mapping):
        raise StateDictError(f"recipe must be a dict of the recipe's fields; got {_type_name(saved)}")
    kinds = {cls.__name__: cls for cls in RECIPES}
    kind = saved.get("kind")
    if kind not in kinds:
        raise StateDictError(f"recipe kind {kind!r} is not a scalestate recipe; expected one of {sorted(kinds)}")
    cls = kinds[kind]
    fields = {f.name for f in attrs.fields(cls)}
    values = {k: v for k, v in saved.items() if k != "kind"}
    unknown = sorted(map(repr, set(values) - fields))
    if unknown:
        raise StateDictError(f"recipe {kind} has no field(s) {', '.join(unknown)}; its fields are {sorted(fields)}")
    try:
        if "format" in values:
            values["format"] = Format(values["format"])
        recipe: Recipe = cls(**values)
    except (ValueError, TypeError, RecipeError) as exc:
        raise StateDictError(f"recipe {dict(saved)} does not make a {kind}: {exc}") from None
    return recipe


def is_state_dict(obj: object) -> bool:
    """Whether ``obj`` looks like a manager's state dict: a dict with the keys ``format_version``,
    ``recipe`` and ``slots``, which every format version has.

    Nothing else is checked, the version included: :func:`validate` (or
    :func:`read_format_version` for the version alone) then says what is wrong
    with a dict that looks like one, so that a state of an unreadable version
    or with a key missing is reported as such rather than as no state at all.
    """
    return isinstance(obj, Mapping) and all(k in obj for k in _RECOGNIZED_BY)


def read_format_version(sd: Mapping[Any, Any]) -> int:
    """The ``format_version`` of a state dict, checked to be one this scalestate reads.

    Raises:
        StateDictError: the key is missing, not an int, or a version this scalestate does
            not read (the message names the version found and those it reads).
    """
    if "format_version" not in sd:
        raise StateDictError(
            f"state dict has no format_version key; ScalingStateManager.state_dict() makes exactly {list(_KEYS)}"
        )
    return _check_version(sd["format_version"])


def to_state_dict(state: State, recipe: Recipe) -> dict[str, Any]:
    """A copy of ``state`` as a state dict (tensors are copies, never views of the state).

    Rows are sorted by (name, role), whatever the registration order: ranks
    that registered in different orders save identical dicts, which
    ``torch.distributed.checkpoint`` needs, as it saves each replicated key
    from one rank only.
    """
    slots = state.slots
    order = sorted(range(len(slots)), key=lambda i: (slots[i].name, slots[i].role.value))
    index = torch.tensor(order, dtype=torch.long, device=state.device)
    sd: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "recipe": recipe_to_dict(recipe),
        "iteration": state.iteration,
        "slots": [[slots[i].name, slots[i].role.value] for i in order],
    }
    for key in TENSOR_KEYS:
        sd[key.name] = key.read(state).detach().index_select(0, index)
    return sd


@attrs.frozen(eq=False)
class LoadedState:
    """A validated state dict, reordered to the manager's rows, on its device (fresh copies)."""

    iteration: int
    #: One tensor per :data:`TENSOR_KEYS` name.
    tensors: Mapping[str, Tensor]

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
    version = _check_version(sd["format_version"]) if "format_version" in sd else FORMAT_VERSION
    values = _read_keys(sd, version)
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
    return LoadedState(iteration=iteration, tensors=MappingProxyType(tensors))


def _read_keys(sd: Mapping[Any, Any], version: int) -> dict[str, Any]:
    """Every key's value, read once; exactly the keys of the dict's format ``version``."""
    keys = _keys(version)
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


def _type_name(value: object) -> str:
    return type(value).__qualname__


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise StateDictError(
            f"format_version must be the int {FORMAT_VERSION}; got {version!r} ({_type_name(version)})"
        )
    if version not in _READABLE_VERSIONS:
        readable = " and ".join(map(str, _READABLE_VERSIONS))
        if version > FORMAT_VERSION:
            hint = f": it was saved by a newer scalestate than this one ({_package_version()}); upgrade to load it"
        else:
            hint = ": no scalestate writes it; the state is corrupt"
        raise StateDictError(f"state dict has format_version {version!r}; this scalestate reads {readable}{hint}")
    return int(version)


def _package_version() -> str:
    from scalestate import __version__  # the package imports this module: read it when needed

    return __version__


def _check_recipe(got: object, expected: dict[str, Any]) -> None:
    if not isinstance(got, Mapping):
        raise StateDictError(
            f"recipe must be a dict of the recipe's fields; got {got!r} ({_type_name(got)}); "
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
    if isinstance(iteration, bool) or not isinstance(iteration, int) or not 0 <= iteration <= _MAX_ITERATION:
        raise StateDictError(f"iteration must be an int in [0, 2**63); got {iteration!r} ({_type_name(iteration)})")
    return int(iteration)  # a plain int, even from an int subclass


def _slot_pairs(saved: object) -> list[tuple[str, str]]:
    """The saved ``[name, role]`` pairs, each checked: strings, a known role, none twice."""
    if not isinstance(saved, (list, tuple)):
        raise StateDictError(f"slots must be a list of [name, role] pairs; got {_type_name(saved)}")
    pairs: list[tuple[str, str]] = []
    first: dict[tuple[str, str], int] = {}
    for i, pair in enumerate(saved):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise StateDictError(f"slots[{i}] must be a [name, role] pair of strings; got {pair!r}")
        name, role = str(pair[0]), str(pair[1])
        if role not in _ROLE_VALUES:
            hint = next((f" (Role.{r.name} is saved as {r.value!r})" for r in Role if r.name == role.upper()), "")
            raise StateDictError(
                f"slots[{i}] = {[name, role]!r} has role {role!r}, which is no Role value; "
                f"expected one of {list(_ROLE_VALUES)}{hint}"
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
        raise StateDictError(f"{name} must be a {key.dtype} tensor of shape {shape}; got {_type_name(value)}")
    if type(value) not in _PLAIN_TENSOR_TYPES:
        raise StateDictError(
            f"{name} must be a plain torch.Tensor; got a {_type_name(value)} (a tensor subclass). "
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
