"""scalestate.recipe: formats, roles, recipes and their validation."""

from __future__ import annotations

import attrs
import pytest
import torch

import scalestate as ss
from scalestate.errors import RecipeError
from scalestate.recipe import fp8_max


class TestRoles:
    def test_directions(self):
        """INPUT and WEIGHT are forward casts, GRAD_OUTPUT a backward one."""
        assert ss.Role.INPUT.direction is ss.Direction.FORWARD
        assert ss.Role.WEIGHT.direction is ss.Direction.FORWARD
        assert ss.Role.GRAD_OUTPUT.direction is ss.Direction.BACKWARD


class TestFormats:
    @pytest.mark.parametrize(
        ("fmt", "role", "dtype"),
        [
            (ss.Format.E4M3, ss.Role.GRAD_OUTPUT, torch.float8_e4m3fn),
            (ss.Format.E5M2, ss.Role.INPUT, torch.float8_e5m2),
            (ss.Format.HYBRID, ss.Role.INPUT, torch.float8_e4m3fn),
            (ss.Format.HYBRID, ss.Role.WEIGHT, torch.float8_e4m3fn),
            (ss.Format.HYBRID, ss.Role.GRAD_OUTPUT, torch.float8_e5m2),
        ],
    )
    def test_dtype_per_role(self, fmt, role, dtype):
        """HYBRID is E4M3 forward and E5M2 backward."""
        assert fmt.dtype(role) == dtype

    def test_fp8_max(self):
        """E4M3 448, E5M2 57344, matching torch.finfo."""
        assert fp8_max(torch.float8_e4m3fn) == 448.0 == torch.finfo(torch.float8_e4m3fn).max
        assert fp8_max(torch.float8_e5m2) == 57344.0 == torch.finfo(torch.float8_e5m2).max

    def test_fp8_max_rejects_other_dtypes(self):
        """A non-FP8 dtype is named in the error."""
        with pytest.raises(RecipeError, match="float16"):
            fp8_max(torch.float16)


class TestDelayedScaling:
    def test_defaults(self):
        """history 16, max, margin 0, hybrid, no power of 2."""
        r = ss.DelayedScaling()
        assert (r.history_len, r.amax_compute, r.margin, r.format, r.power_of_2) == (
            16, "max", 0, ss.Format.HYBRID, False,
        )
        assert r.delayed

    def test_frozen(self):
        """Recipes are read-only; variants come from attrs.evolve."""
        r = ss.DelayedScaling()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            r.margin = 2  # type: ignore[misc]
        assert attrs.evolve(r, margin=2).margin == 2

    @pytest.mark.parametrize(
        ("kwargs", "field", "allowed"),
        [
            ({"history_len": 0}, "history_len", ">= 1"),
            ({"history_len": 2.0}, "history_len", ">= 1"),
            ({"history_len": True}, "history_len", ">= 1"),
            ({"amax_compute": "mean"}, "amax_compute", "'max' or 'most_recent'"),
            ({"margin": -1}, "margin", r"\[0, 64\]"),
            ({"margin": 65}, "margin", r"\[0, 64\]"),
            ({"format": "e4m3"}, "format", "Format.E4M3"),
            ({"power_of_2": 1}, "power_of_2", "True or False"),
        ],
    )
    def test_bad_values_name_field_value_and_allowed(self, kwargs, field, allowed):
        """Each error names the field, the value received and what is allowed."""
        with pytest.raises(RecipeError, match=field) as info:
            ss.DelayedScaling(**kwargs)
        assert repr(next(iter(kwargs.values()))) in str(info.value)
        info.match(allowed)

    def test_recipe_error_is_value_error(self):
        """Callers catching ValueError keep working."""
        with pytest.raises(ValueError, match="history_len"):
            ss.DelayedScaling(history_len=0)


class TestCurrentScaling:
    def test_shape(self):
        """Current scaling keeps one entry (last step's amax) and has no margin."""
        r = ss.CurrentScaling(power_of_2=True)
        assert not r.delayed and r.history_len == 1 and r.amax_compute == "most_recent"
        assert r.margin == 0 and r.power_of_2

    def test_validation(self):
        """Same validators as delayed scaling."""
        with pytest.raises(RecipeError, match="format"):
            ss.CurrentScaling(format=None)  # type: ignore[arg-type]
