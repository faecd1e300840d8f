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


PER_TENSOR = [ss.DelayedScaling, ss.CurrentScaling]


class TestAmaxFloor:
    """The per-tensor recipes' amax_floor: 0.0 by default (no floor), carried into the scale rule."""

    @pytest.mark.parametrize("cls", PER_TENSOR, ids=lambda c: c.__name__)
    def test_default_is_no_floor(self, cls):
        """0.0, in the rule too; the repr is the one recipes had before the field existed."""
        r = cls()
        assert r.amax_floor == 0.0 and r.rule.amax_floor == 0.0
        assert "amax_floor" not in repr(r)
        assert repr(ss.DelayedScaling()) == (
            "DelayedScaling(history_len=16, amax_compute='max', margin=0, format=Format.HYBRID, "
            "power_of_2=False)"
        )

    @pytest.mark.parametrize("cls", PER_TENSOR, ids=lambda c: c.__name__)
    def test_set(self, cls):
        """Set, it is in the rule and the repr; ints read as floats; attrs.evolve and equality work."""
        r = cls(amax_floor=1e-12)
        assert r.rule.amax_floor == 1e-12 and repr(r).endswith("power_of_2=False, amax_floor=1e-12)")
        assert cls(amax_floor=1).amax_floor == 1.0 and type(cls(amax_floor=1).amax_floor) is float
        assert attrs.evolve(r, amax_floor=0) == cls() and cls(amax_floor=-0.0) == cls()
        assert r != cls() and hash(attrs.evolve(r)) == hash(r)

    @pytest.mark.parametrize("value", [-1e-12, float("nan"), float("inf"), 1e-40, 1e39, True, "1e-12", None])
    @pytest.mark.parametrize("cls", PER_TENSOR, ids=lambda c: c.__name__)
    def test_bad_values(self, cls, value):
        """Negative, non-finite, subnormal or beyond float32, or not a number: a RecipeError naming field and value."""
        with pytest.raises(RecipeError, match=r"amax_floor must be 0.0 \(no floor\) or a float from 2\*\*-126") as info:
            cls(amax_floor=value)
        assert repr(value) in str(info.value) and isinstance(info.value, ValueError)

    @pytest.mark.parametrize("cls", [ss.RowwiseScaling, ss.BlockScaling, ss.MXFP8Scaling], ids=lambda c: c.__name__)
    def test_fine_grained_recipes_take_none(self, cls):
        """Fine-grained recipes have no such field."""
        with pytest.raises(TypeError, match="amax_floor"):
            cls(amax_floor=1e-12)

    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    @pytest.mark.parametrize("floor", [0.0, 1e-12], ids=["no_floor", "floor"])
    @pytest.mark.parametrize("cls", PER_TENSOR, ids=lambda c: c.__name__)
    def test_casts_and_steps(self, cls, floor, backend):
        """A tensor of amax 1e-13: its just-in-time cast, the step's scale, and (delayed) the next step's cast all
        divide by max(1e-13, floor); the history holds the amax itself."""
        recipe = cls(amax_floor=floor, format=ss.Format.E5M2)
        m = ss.ScalingStateManager(recipe, backend=backend)
        h = m.register("fc")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        x = x / x.abs().max() * 1e-13
        amax = x.abs().max()
        want = torch.div(57344.0, torch.maximum(amax, torch.tensor(floor)))
        assert torch.equal(h.quantize(x, ss.Role.INPUT).scale, want)
        m.step()
        assert torch.equal(h.amax_history(ss.Role.INPUT)[-1], amax)
        assert torch.equal(h.scale(ss.Role.INPUT), want)
        q = h.quantize(x / 8, ss.Role.INPUT)  # delayed: the step's scale; current: its own, floored again
        own = torch.div(57344.0, torch.maximum(amax / 8, torch.tensor(floor)))
        assert torch.equal(q.scale, want if recipe.delayed else own)
        assert torch.equal(q.data, (x / 8 * q.scale).to(torch.float8_e5m2))
