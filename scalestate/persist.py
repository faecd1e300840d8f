"""The manager's ``state_dict``: plain values only, validated strictly before use.

Keys (format version 3), exactly these:

``format_version`` (int)
    3.
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
``sr_ordinal`` (int64 tensor ``[N]``)
    Stochastically rounded casts of each slot since the last ``step()``
    (zeros when saved between steps): with ``iteration`` and ``seed``, what
    the next draw of each slot is keyed by (NVFP4).
``seed`` (int)
    The manager's seed (:attr:`~scalestate.ScalingStateManager.seed`).
``rht_signs`` (float32 tensor ``[16]``)
    The signs of NVFP4's random Hadamard transform, each ``+1`` or ``-1``.

Format version 2 is the same without ``sr_ordinal``, ``seed`` and
``rht_signs`` (it loads with the ordinals 0 and the manager's own seed and
signs kept); format version 1 (scalestate 0.1 and 0.2 before the non-finite
counters) is version 2 without ``nonfinite_counts``; it still loads, with
every count 0.

Everything is a dict, list, str, int, bool or tensor, so
``torch.load(path, weights_only=True)`` loads it.

``load_state_dict`` (its checks are in the private
``scalestate._engine.loading``) accepts a dict only if a load restores it
bit for bit and the manager can go on from it; anything else
raises :class:`~scalestate.errors.StateDictError` (a ``ValueError``) naming
the key, what was expected and what it holds, before anything is modified:

* the keys are exactly those of its format version: none missing, none extra;
* ``format_version`` is the int 3, 2 or 1 (not ``True``, ``3.0`` or a tensor);
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
  are ``>= 0``, as are ``sr_ordinal`` entries;
* ``seed`` is an int (not a bool) in ``[0, 2**63)``; ``rht_signs`` is a
  float32 ``[16]`` tensor of ``+1`` and ``-1``.

Each tensor key is one row of :data:`TENSOR_KEYS` (dtype, shape, value rule
and where the state holds it); a new kind of per-slot tensor is one more row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from scalestate._engine.state import State
from scalestate._recipe_fields import described_fields
from scalestate.errors import RecipeError, StateDictError
from scalestate.math import FLOAT32_TINY
from scalestate.recipe import RECIPES, Format, Recipe, Role

__all__ = [
    "FORMAT_VERSION",
    "RANDOM_SINCE",
    "TENSOR_KEYS",
    "TensorKey",
    "is_state_dict",
    "read_format_version",
    "recipe_from_dict",
    "recipe_to_dict",
    "to_state_dict",
]

FORMAT_VERSION = 3
#: Versions this scalestate reads.
READABLE_VERSIONS = (1, 2, 3)
#: The version that added ``seed`` and ``rht_signs`` (and ``sr_ordinal``).
RANDOM_SINCE = 3
#: Largest ``iteration`` accepted: it must fit an int64.
MAX_ITERATION = 2**63 - 1
#: Tensor types taken as they are; any other subclass (DTensor, FakeTensor, ...) is refused.
PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)
ROLE_VALUES = tuple(r.value for r in Role)


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
    TensorKey(
        name="sr_ordinal",
        dtype=torch.int64,
        row_shape=lambda history_len: (),
        read=lambda state: state.random.ordinals(len(state)),
        invalid=lambda t: t < 0,
        rule="stochastic-rounding ordinals must be >= 0",
        since=RANDOM_SINCE,
    ),
)


def keys_of(version: int) -> tuple[str, ...]:
    """The keys of a state dict of format ``version``."""
    random = ("seed", "rht_signs") if version >= RANDOM_SINCE else ()
    return (
        "format_version", "recipe", "iteration", "slots", *(k.name for k in TENSOR_KEYS if k.since <= version), *random,
    )


_KEYS = keys_of(FORMAT_VERSION)
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
        raise StateDictError(f"recipe must be a dict of the recipe's fields; got {type_name(saved)}")
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

    Nothing else is checked, the version included: ``load_state_dict`` (or
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
    return check_version(sd["format_version"])


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
    sd["seed"] = state.random.seed
    sd["rht_signs"] = state.random.signs.detach().clone()
    return sd


def type_name(value: object) -> str:
    return type(value).__qualname__


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise StateDictError(
            f"format_version must be the int {FORMAT_VERSION}; got {version!r} ({type_name(version)})"
        )
    if version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS[:-1])) + f" and {READABLE_VERSIONS[-1]}"
        if version > FORMAT_VERSION:
            hint = f": it was saved by a newer scalestate than this one ({_package_version()}); upgrade to load it"
        else:
            hint = ": no scalestate writes it; the state is corrupt"
        raise StateDictError(f"state dict has format_version {version!r}; this scalestate reads {readable}{hint}")
    return int(version)


def _package_version() -> str:
    from scalestate import __version__  # the package imports this module: read it when needed

    return __version__
