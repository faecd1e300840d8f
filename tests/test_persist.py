"""scalestate.persist: state_dict round trips and validation."""

from __future__ import annotations

import io

import pytest
import torch

import scalestate as ss
from scalestate.errors import PhaseError, StateDictError

I, G = ss.Role.INPUT, ss.Role.GRAD_OUTPUT


def _trained(recipe=None, backend="emulation", steps=3):
    m = ss.ScalingStateManager(recipe or ss.DelayedScaling(history_len=4), backend=backend)
    torch.manual_seed(0)
    layer = ss.nn.Linear(8, 8, manager=m, name="fc")
    other = ss.nn.Linear(8, 8, manager=m, name="out")
    for step in range(steps):
        with m.forward():
            loss = other(layer(torch.randn(4, 8) * (step + 1))).square().sum()
        with m.backward():
            loss.backward()
        m.step()
    return m, (layer, other)


class TestRoundTrip:
    def test_keys_and_plain_values(self, recipe, backend):
        """Every key documented in scalestate.persist, and weights_only loading works."""
        m, _ = _trained(recipe, backend)
        sd = m.state_dict()
        assert set(sd) == {"format_version", "recipe", "iteration", "slots", "amax_history", "scale", "step_amax"}
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        fresh, _ = _trained(recipe, backend, steps=0)
        fresh.load_state_dict(loaded)
        again = fresh.state_dict()
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(again[key], sd[key])
        assert fresh.iteration == 3

    def test_state_dict_is_a_copy(self):
        """A saved dict does not change when training goes on."""
        m, _ = _trained()
        sd = m.state_dict()
        hist = sd["amax_history"].clone()
        m.handles["fc"].quantize(torch.full((2,), 1e4), I)
        m.step()
        assert torch.equal(sd["amax_history"], hist)

    def test_row_order_independent(self):
        """Slots registered in another order load by name and role."""
        m, _ = _trained()
        sd = m.state_dict()
        other = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        ss.nn.Linear(8, 8, manager=other, name="out")
        ss.nn.Linear(8, 8, manager=other, name="fc")
        other.load_state_dict(sd)
        assert torch.equal(other.handles["fc"].amax_history(I), m.handles["fc"].amax_history(I))


class TestValidation:
    def _check_untouched(self, m, before):
        after = m.state_dict()
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(after[key], before[key])
        assert after["iteration"] == before["iteration"]

    @pytest.mark.parametrize(
        ("mutate", "match"),
        [
            (lambda sd: sd.pop("scale"), "lacks key"),
            (lambda sd: sd.update(format_version=99), "format_version"),
            (lambda sd: sd["recipe"].update(history_len=8), r"recipe differs in \['history_len'\]"),
            (lambda sd: sd.update(iteration=-1), "iteration"),
            (lambda sd: sd["slots"].pop(), "missing from the state dict"),
            (lambda sd: sd["slots"].append(["new", "input"]), "not registered here"),
            (lambda sd: sd["slots"].__setitem__(0, "fc"), r"slots\[0\]"),
            (lambda sd: sd.update(scale=sd["scale"][:-1]), "shape"),
            (lambda sd: sd.update(scale=sd["scale"].long()), "floating-point"),
            (lambda sd: sd["scale"].__setitem__(0, float("nan")), "corrupt"),
            (lambda sd: sd["scale"].__setitem__(0, 0.0), "corrupt"),
            (lambda sd: sd["amax_history"].__setitem__((0, 0), -1.0), "corrupt"),
            (lambda sd: sd.update(amax_history=[1, 2]), "must be a tensor"),
        ],
    )
    def test_bad_state_raises_before_modifying(self, mutate, match):
        """Each defect raises StateDictError naming it, and nothing is modified."""
        m, _ = _trained()
        sd = m.state_dict()
        mutate(sd)
        target, _ = _trained(steps=1)
        before = target.state_dict()
        with pytest.raises(StateDictError, match=match):
            target.load_state_dict(sd)
        self._check_untouched(target, before)

    def test_not_a_dict(self):
        """A non-mapping is refused."""
        m, _ = _trained(steps=0)
        with pytest.raises(StateDictError, match="expected a dict"):
            m.load_state_dict([1, 2])  # type: ignore[arg-type]

    def test_not_mid_step(self):
        """Loading after casts were recorded in the step would lose them: refused."""
        m, (layer, _) = _trained()
        sd = m.state_dict()
        with m.forward():
            layer(torch.randn(2, 8))
        with pytest.raises(PhaseError, match="middle of a step"):
            m.load_state_dict(sd)

    def test_not_inside_a_block(self):
        """Loading inside a phase block names the block."""
        m, _ = _trained()
        sd = m.state_dict()
        with m.forward(), pytest.raises(PhaseError, match=r"inside `with manager\.forward\(\)`"):
            m.load_state_dict(sd)
