"""The fields recipes share: their checks, and the repr and saved form of the fields that describe a recipe.

Private to :mod:`scalestate.recipe` (which re-exports :func:`described_fields`).
"""

from __future__ import annotations

from typing import Any

import attrs

from scalestate.errors import RecipeError
from scalestate.math import FLOAT32_MAX, FLOAT32_TINY

__all__ = [
    "DescribedRepr",
    "amax_floor_field",
    "as_float",
    "check_amax_compute",
    "check_amax_floor",
    "check_block",
    "check_bool",
    "check_history_len",
    "check_margin",
    "described_fields",
]


def check_bool(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise RecipeError(f"{attribute.name} must be True or False; got {value!r}")


def check_history_len(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{attribute.name} must be an int >= 1; got {value!r}")


def check_margin(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise RecipeError(f"{attribute.name} must be an int in [0, 64]; got {value!r}")


def check_block(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        raise RecipeError(f"{attribute.name} must be an int in [1, 65536]; got {value!r}")


def check_amax_compute(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("max", "most_recent"):
        raise RecipeError(f"{attribute.name} must be 'max' or 'most_recent'; got {value!r}")


def as_float(value: object) -> object:
    """An int amax floor as the float it means (``0`` and ``-0.0`` are ``0.0``); anything else as it
    is, for the validator to judge."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) + 0.0
    return value


def check_amax_floor(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, float) or not (value == 0.0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise RecipeError(
            f"{attribute.name} must be 0.0 (no floor) or a float from 2**-126 to {FLOAT32_MAX:.6g} (a normal "
            f"float32: the scale math runs in float32), e.g. 1e-12 as torchao's dynamic scaling; got {value!r}"
        )


#: ``metadata`` key of a recipe field added after recipes were first saved: such a field is left
#: out of the recipe's repr and of the manager's saved recipe while it holds its default, so that
#: states and reprs made before it existed stay valid and unchanged.
OMITTED_AT_DEFAULT = "scalestate.omitted_at_default"


def described_fields(recipe: object) -> dict[str, Any]:
    """The fields that describe ``recipe`` (an attrs recipe), in order: every field but one added
    since recipes were first saved (``amax_floor``) while it holds its default."""
    cls: Any = type(recipe)
    out: dict[str, Any] = {}
    for field in attrs.fields(cls):
        value = getattr(recipe, field.name)
        if field.metadata.get(OMITTED_AT_DEFAULT) and value == field.default:
            continue
        out[field.name] = value
    return out


def amax_floor_field() -> Any:
    return attrs.field(
        default=0.0, converter=as_float, validator=check_amax_floor, metadata={OMITTED_AT_DEFAULT: True}
    )


class DescribedRepr:
    """A repr of the fields that describe the recipe (see :func:`described_fields`)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in described_fields(self).items())
        return f"{type(self).__name__}({fields})"
