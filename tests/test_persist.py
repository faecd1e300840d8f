"""scalestate.persist: state_dict round trips and strict validation (invariant 12)."""

from __future__ import annotations

import collections
import io
import math
import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import scalestate as ss
from scalestate.errors import PhaseError, StateDictError
from scalestate.persist import TENSOR_KEYS, recipe_from_dict
from scalestate.testing import assert_same

I, G = ss.Role.INPUT, ss.Role.GRAD_OUTPUT
F32_MAX = torch.finfo(torch.float32).max
TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal float32
SUBNORMAL = 1e-40
NAN, INF = math.nan, math.inf
TENSOR_NAMES = tuple(k.name for k in TENSOR_KEYS)
KEYS = ("format_version", "recipe", "iteration", "slots", *TENSOR_NAMES, "seed", "rht_signs")
#: The keys format version 3 added.
V3_ONLY = ("sr_ordinal", "seed", "rht_signs")


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


def assert_same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Two state dicts hold the same values bit for bit (tensors: dtype, shape and every bit, so -0.0
    differs from 0.0 and NaN payloads count)."""
    assert_same(a, b, bits=True, name="state")


def _refused(target: ss.ScalingStateManager, sd: object, match: str | None = None) -> StateDictError:
    """Loading ``sd`` raises StateDictError (matching ``match``) and leaves ``target`` bitwise unchanged."""
    before = target.state_dict()
    with pytest.raises(StateDictError, match=match) as info:
        target.load_state_dict(sd)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert_same_state(target.state_dict(), before)
    return info.value


class TestRoundTrip:
    def test_keys_and_plain_values(self, recipe, backend):
        """Every key documented in scalestate.persist, and weights_only loading works."""
        m, _ = _trained(recipe, backend)
        sd = m.state_dict()
        assert tuple(sd) == KEYS
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        fresh, _ = _trained(recipe, backend, steps=0)
        fresh.load_state_dict(loaded)
        assert_same_state(fresh.state_dict(), sd)
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

    def test_edge_values_load_bitwise(self):
        """Every value at the edge of the rules loads bit for bit: 0 and -0.0, subnormal amaxes,
        the extreme scales, +inf and NaN (with its payload) as step amaxes, the largest iteration."""
        m = ss.ScalingStateManager(ss.DelayedScaling(history_len=2), backend="emulation")
        m.register("a")
        sd = m.state_dict()
        sd["iteration"] = 2**63 - 1
        sd["amax_history"] = torch.tensor([[0.0, -0.0], [SUBNORMAL, F32_MAX], [TINY, 448.0]])
        sd["scale"] = torch.tensor([TINY, F32_MAX, 1.0])
        step_amax = torch.tensor([INF, -0.0, 0.0])
        step_amax.view(torch.int32)[2] = 0x7FC00123  # a NaN with a payload
        sd["step_amax"] = step_amax
        m.load_state_dict(sd)
        assert_same_state(m.state_dict(), sd)

    def test_lenient_containers_load(self):
        """Tuples for lists, other mappings, Parameters, non-contiguous and grad-requiring tensors load."""
        m, _ = _trained()
        sd = m.state_dict()
        history = torch.zeros(4, sd["amax_history"].shape[0]).t()  # non-contiguous
        history.copy_(sd["amax_history"])
        assert not history.is_contiguous()
        odd = dict(sd)
        odd["amax_history"] = history
        odd["scale"] = torch.nn.Parameter(sd["scale"].clone())
        odd["step_amax"] = sd["step_amax"].clone().requires_grad_(True)
        odd["slots"] = tuple(tuple(p) for p in sd["slots"])
        target, _ = _trained(steps=1)
        target.load_state_dict(MappingProxyType(odd))
        assert_same_state(target.state_dict(), sd)


class TestValidation:
    @pytest.mark.parametrize(
        ("mutate", "match"),
        [
            (lambda sd: sd.pop("scale"), r"lacks key\(s\) \['scale'\]"),
            (lambda sd: sd.update(format_version=99), "format_version"),
            (lambda sd: sd["recipe"].update(history_len=8), r"recipe differs in \['history_len'\]"),
            (lambda sd: sd.update(iteration=-1), "iteration"),
            (lambda sd: sd["slots"].pop(), "missing from the state dict"),
            (lambda sd: sd["slots"].append(["new", "input"]), "not registered here"),
            (lambda sd: sd["slots"].__setitem__(0, "fc"), r"slots\[0\]"),
            (lambda sd: sd.update(scale=sd["scale"][:-1]), "shape"),
            (lambda sd: sd.update(scale=sd["scale"].long()), r"scale must be a torch.float32 tensor.*got torch.int64"),
            (lambda sd: sd["scale"].__setitem__(0, float("nan")), "corrupt"),
            (lambda sd: sd["scale"].__setitem__(0, 0.0), "corrupt"),
            (lambda sd: sd["amax_history"].__setitem__((0, 0), -1.0), "corrupt"),
            (lambda sd: sd.update(amax_history=[1, 2]), "amax_history must be a torch.float32 tensor.*got list"),
        ],
    )
    def test_bad_state_raises_before_modifying(self, mutate, match):
        """Each defect raises StateDictError naming it, and nothing is modified."""
        m, _ = _trained()
        sd = m.state_dict()
        mutate(sd)
        target, _ = _trained(steps=1)
        _refused(target, sd, match)

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


class TestStrictKeys:
    @pytest.mark.parametrize("extra", ["nonfinite", "Scale", 7, ("scale",)])
    def test_unknown_key(self, extra):
        """A key state_dict() does not make is refused by name, not ignored."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[extra] = 0
        _refused(m, sd, re.escape(f"unexpected key(s) [{extra!r}]"))

    def test_missing_key_lists_what_is_expected(self):
        """A missing key is named along with the full list of keys."""
        m, _ = _trained()
        sd = m.state_dict()
        del sd["iteration"]
        err = _refused(m, sd, r"lacks key\(s\) \['iteration'\]")
        assert all(k in str(err) for k in KEYS)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int32, torch.int64, torch.bool, torch.complex64]  # fmt: skip


class TestStrictDtypes:
    @pytest.mark.parametrize(
        ("key", "dtype"), [(k.name, d) for k in TENSOR_KEYS for d in DTYPES if d != k.dtype], ids=str
    )
    def test_other_dtype_refused(self, key, dtype):
        """No dtype is converted: a float8 scale would load rounded, a float64 one would not be the saved bits."""
        m, _ = _trained()
        sd = m.state_dict()
        expected = sd[key].dtype
        sd[key] = sd[key].to(dtype)
        _refused(m, sd, rf"{key} must be a {expected} tensor.*got {dtype}")

    def test_float8_would_round_scales(self):
        """The case that motivated the rule: a float8 round trip changes the scale, so it is refused."""
        m, _ = _trained()
        sd = m.state_dict()
        rounded = sd["scale"].to(torch.float8_e4m3fn)
        assert not torch.equal(rounded.float(), sd["scale"])
        sd["scale"] = rounded
        _refused(m, sd, "float8_e4m3fn")


class _Sub(torch.Tensor):
    """A tensor subclass, as DTensor or a fake tensor would be."""


class TestTensorKinds:
    @pytest.mark.parametrize("key", TENSOR_NAMES)
    def test_meta(self, key):
        """A meta tensor has no values: refused by name rather than failing deep inside."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[key] = sd[key].to("meta")
        _refused(m, sd, rf"{key} is on the meta device")

    @pytest.mark.parametrize("key", TENSOR_NAMES)
    def test_sparse_coo(self, key):
        """A sparse tensor is refused with its layout named."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[key] = sd[key].to_sparse()
        _refused(m, sd, rf"{key} must be a dense \(torch.strided\) tensor; got a torch.sparse_coo one")

    @pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
    def test_sparse_csr_and_mkldnn(self):
        """Other layouts too."""
        m, _ = _trained()
        sd = m.state_dict()
        _refused(m, {**sd, "amax_history": sd["amax_history"].to_sparse_csr()}, "torch.sparse_csr")
        _refused(m, {**sd, "scale": sd["scale"].to_mkldnn()}, "torch._mkldnn")

    @pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
    def test_nested(self):
        """A nested tensor is refused."""
        m, _ = _trained()
        sd = m.state_dict()
        _refused(m, {**sd, "scale": torch.nested.nested_tensor([sd["scale"]])}, "got a nested one")

    @pytest.mark.parametrize("key", TENSOR_NAMES)
    def test_subclass(self, key):
        """Tensor subclasses (DTensor, fake tensors) are refused: only plain tensors and Parameters load."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[key] = sd[key].as_subclass(_Sub)
        _refused(m, sd, rf"{key} must be a plain torch.Tensor; got a _Sub")

    @pytest.mark.parametrize("value", [None, 1.0, [1.0, 2.0], (1.0,)])
    def test_not_a_tensor(self, value):
        """Lists and numbers are not tensors."""
        m, _ = _trained()
        _refused(m, {**m.state_dict(), "scale": value}, r"scale must be a torch.float32 tensor of shape \(6,\)")

    @pytest.mark.parametrize(
        ("key", "reshape"),
        [
            ("amax_history", lambda t: t.t()),
            ("amax_history", lambda t: t[:, :-1]),
            ("amax_history", lambda t: t.flatten()),
            ("scale", lambda t: t.unsqueeze(0)),
            ("scale", lambda t: t.reshape(2, 3)),
            ("step_amax", lambda t: torch.cat([t, t[:1]])),
            ("step_amax", lambda t: t[0]),
        ],
    )
    def test_shape(self, key, reshape):
        """The shape is exactly [N] or [N, history_len]."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[key] = reshape(sd[key])
        _refused(m, sd, rf"{key} has shape .*; this manager expects")


class TestStrictValues:
    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("scale", SUBNORMAL),
            ("scale", TINY / 2),
            ("scale", 1e-45),
            ("scale", 0.0),
            ("scale", -0.0),
            ("scale", -1.0),
            ("scale", NAN),
            ("scale", INF),
            ("scale", -INF),
            ("amax_history", NAN),
            ("amax_history", INF),
            ("amax_history", -INF),
            ("amax_history", -1.0),
            ("amax_history", -SUBNORMAL),
            ("step_amax", -1.0),
            ("step_amax", -INF),
            ("step_amax", -1e-45),
        ],
    )
    def test_bad_value(self, key, value):
        """A value outside the rule is refused, naming the entry, its slot and the rule."""
        m, _ = _trained()
        sd = m.state_dict()
        sd[key][3] = value
        err = _refused(m, sd, rf"{key}\[3(, 0)?\] \(slot 'out' role 'grad_output'\) is ")
        assert "corrupt" in str(err)

    def test_subnormal_scale_motivation(self):
        """A subnormal scale has an infinite inverse: the outputs would be NaN. Refused, not loaded."""
        assert torch.tensor(SUBNORMAL).reciprocal().isinf()
        m, _ = _trained()
        sd = m.state_dict()
        sd["scale"][0] = SUBNORMAL
        _refused(m, sd, r"scales must be finite and >= 1.1754943508222875e-38")

    def test_count_of_bad_entries(self):
        """The message counts every bad entry, not only the first."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["amax_history"][1:3] = NAN
        _refused(m, sd, r"and 8 entries in all break the rule")


class TestStrictScalars:
    @pytest.mark.parametrize("value", [True, 3.0, "3", None, [3], torch.tensor(3), torch.tensor(3, device="meta")])
    def test_format_version_not_an_int(self, value):
        """format_version is the int 3: not a bool (True == 1 in Python), a float or a tensor."""
        m, _ = _trained()
        _refused(m, {**m.state_dict(), "format_version": value}, "format_version must be the int 3")

    def test_format_version_1_loads_with_zero_counts(self):
        """A dict of format version 1 (before the non-finite counters) loads; its counts start at 0."""
        m, _ = _trained()
        sd = m.state_dict()
        old = {k: v for k, v in sd.items() if k not in (*V3_ONLY, "nonfinite_counts")} | {"format_version": 1}
        m.load_state_dict(old)
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(m.state_dict()[key], sd[key])
        assert all(n == 0 for roles in m.nonfinite_counts().values() for n in roles.values())
        _refused(m, {**old, "nonfinite_counts": sd["nonfinite_counts"]}, "unexpected key")
        _refused(m, {**sd, "format_version": 4}, "newer scalestate")

    def test_format_version_2_loads_keeping_the_seed(self):
        """A dict of format version 2 (before NVFP4's randomness) loads: the manager keeps its own seed
        and signs, and every ordinal starts at 0; version 2 with the version-3 keys is refused."""
        m, _ = _trained(ss.NVFP4Scaling())
        sd = m.state_dict()
        fresh, _ = _trained(ss.NVFP4Scaling())
        fresh_seed, fresh_signs = fresh.seed, fresh.rht_signs()
        old = {k: v for k, v in sd.items() if k not in V3_ONLY} | {"format_version": 2}
        fresh.load_state_dict(old)
        assert fresh.seed == fresh_seed and torch.equal(fresh.rht_signs(), fresh_signs)
        assert torch.equal(fresh.state_dict()["sr_ordinal"], torch.zeros(2 * 3, dtype=torch.int64))
        for key in ("amax_history", "scale", "step_amax", "nonfinite_counts"):
            assert torch.equal(fresh.state_dict()[key], sd[key])
        _refused(fresh, {**sd, "format_version": 2}, "unexpected key")

    def test_counts_round_trip(self):
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with m.forward():
            h.quantize(torch.tensor([float("nan")]), ss.Role.INPUT)
        m.step()
        sd = m.state_dict()
        assert sd["nonfinite_counts"].tolist() == [1] and sd["nonfinite_counts"].dtype == torch.int64
        fresh = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        fresh.register("fc", roles=(ss.Role.INPUT,))
        fresh.load_state_dict(sd)
        assert fresh.nonfinite_counts() == {"fc": {ss.Role.INPUT: 1}}

    @pytest.mark.parametrize(
        "value",
        [-1, 2**63, 2**70, True, False, 3.0, "3", None, torch.tensor(3), torch.tensor(3, device="meta")],
    )
    def test_iteration(self, value):
        """iteration is an int in [0, 2**63)."""
        m, _ = _trained()
        _refused(m, {**m.state_dict(), "iteration": value}, r"iteration must be an int in \[0, 2\*\*63\)")


class TestStrictRecipe:
    @pytest.mark.parametrize(
        ("mutate", "fields"),
        [
            (lambda r: r.update(history_len=4.0), "'history_len'"),
            (lambda r: r.update(margin=False), "'margin'"),
            (lambda r: r.update(power_of_2=0), "'power_of_2'"),
            (lambda r: r.update(format=ss.Format.HYBRID), "'format'"),
            (lambda r: r.update(kind="CurrentScaling"), "'kind'"),
            (lambda r: r.update(extra=1), "'extra'"),
            (lambda r: r.pop("amax_compute"), "'amax_compute'"),
            (lambda r: r.update({3: "x"}), "3"),
            (lambda r: r.update(history_len=torch.tensor(4, device="meta")), "'history_len'"),
        ],
    )
    def test_field_differs(self, mutate, fields):
        """Fields equal in value but not in type, extra or missing fields all count as a different recipe."""
        m, _ = _trained()
        sd = m.state_dict()
        mutate(sd["recipe"])
        _refused(m, sd, rf"recipe differs in \[{fields}\]")

    @pytest.mark.parametrize("value", [None, "DelayedScaling", [("kind", "DelayedScaling")]])
    def test_not_a_dict(self, value):
        """recipe is a dict."""
        m, _ = _trained()
        _refused(m, {**m.state_dict(), "recipe": value}, "recipe must be a dict")


class TestStrictSlots:
    def test_unknown_role_is_told_apart(self):
        """A role saved by its enum name is not the role value: the message shows both apart."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["slots"][3] = ["out", "INPUT"]
        err = _refused(m, sd, r"slots\[3\] = \['out', 'INPUT'\] has role 'INPUT', which is no Role value")
        assert "['input', 'weight', 'grad_output']" in str(err)
        assert "Role.INPUT is saved as 'input'" in str(err)

    @pytest.mark.parametrize("role", ["bias", "", "Input", "input "])
    def test_unknown_roles(self, role):
        """Any string that is not a Role value is refused."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["slots"][0][1] = role
        _refused(m, sd, rf"slots\[0\] = .* has role {role!r}")

    def test_duplicate(self):
        """A pair saved twice is named with both positions."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["slots"][4] = sd["slots"][1]
        _refused(m, sd, r"slots\[4\]: slot 'fc' role 'input' appears twice in the state dict \(also slots\[1\]\)")

    @pytest.mark.parametrize(
        "slots",
        ["fc:input", {"fc": "input"}, None, torch.zeros(2)],
    )
    def test_not_a_list(self, slots):
        """slots is a list of pairs."""
        m, _ = _trained()
        _refused(m, {**m.state_dict(), "slots": slots}, "slots must be a list of")

    @pytest.mark.parametrize("pair", [["fc"], ["fc", "input", "x"], ["fc", 1], [b"fc", "input"], "fc", None])
    def test_malformed_pair(self, pair):
        """Each entry is a [name, role] pair of strings."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["slots"][2] = pair
        _refused(m, sd, r"slots\[2\] must be a \[name, role\] pair of strings")

    def test_mismatch_names_roles(self):
        """Slots registered here but not saved, and saved but not registered, are listed by name:ROLE."""
        m, _ = _trained()
        sd = m.state_dict()
        sd["slots"][0] = ["fc2", "input"]
        _refused(m, sd, r"missing from the state dict \[fc:GRAD_OUTPUT\]; not registered here \[fc2:INPUT\]")


# ----------------------------------------------------------------------------- fuzz
#: Valid values per tensor key (float32 values exactly; a new TENSOR_KEYS row needs an entry here).
_AMAX = st.floats(min_value=0.0, max_value=F32_MAX, width=32) | st.sampled_from([0.0, -0.0, 1e-45, TINY, F32_MAX])
VALID_VALUES = {
    "amax_history": _AMAX,
    "scale": st.floats(min_value=TINY, max_value=F32_MAX, width=32) | st.sampled_from([TINY, 1.0, F32_MAX]),
    "step_amax": _AMAX | st.sampled_from([INF, NAN]),
    "nonfinite_counts": st.integers(0, 2**63 - 1),
    "sr_ordinal": st.integers(0, 2**63 - 1),
}
#: Values each tensor key refuses.
BAD_VALUES = {
    "amax_history": [NAN, INF, -INF, -1.0, -1e-45, -F32_MAX],
    "scale": [NAN, INF, -INF, 0.0, -0.0, -1.0, SUBNORMAL, 1e-45, TINY / 2],
    "step_amax": [-INF, -1.0, -1e-45],
    "nonfinite_counts": [-1, -(2**63)],
    "sr_ordinal": [-1, -(2**63)],
}
_NAN_BITS = [0x7FC00123, -0x400000, 0x7F800001]  # NaNs with a payload, a sign, a signalling bit

RECIPES = st.one_of(
    st.builds(
        ss.DelayedScaling,
        history_len=st.integers(1, 4),
        amax_compute=st.sampled_from(["max", "most_recent"]),
        margin=st.integers(0, 3),
        format=st.sampled_from(list(ss.Format)),
        power_of_2=st.booleans(),
    ),
    st.builds(ss.CurrentScaling, format=st.sampled_from(list(ss.Format)), power_of_2=st.booleans()),
    st.builds(
        ss.NVFP4Scaling,
        global_scale=st.sampled_from(["current", "delayed"]),
        history_len=st.integers(1, 4),
        margin=st.integers(0, 3),
        weight_2d=st.booleans(),
        rht=st.booleans(),
        stochastic_rounding=st.booleans(),
    ),
)
LAYOUTS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b.c", "fc", "x.0"]), st.lists(st.sampled_from(list(ss.Role)), min_size=1, unique=True)
    ),
    max_size=3,
    unique_by=lambda t: t[0],
)


class _ReadOnly(Mapping[str, Any]):
    """A mapping that is not a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _valid_values(draw: st.DrawFn, template: Mapping[str, Any]) -> dict[str, Any]:
    """A valid state dict shaped like ``template``, with random values on every key."""
    missing = set(TENSOR_NAMES) - set(VALID_VALUES)
    assert not missing, f"add value strategies for the new tensor key(s) {missing} to VALID_VALUES and BAD_VALUES"
    sd = dict(template)
    sd["recipe"] = dict(template["recipe"])
    sd["slots"] = [list(p) for p in template["slots"]]
    sd["iteration"] = draw(st.integers(0, 2**63 - 1) | st.sampled_from([0, 1, 2**63 - 1]))
    for key in TENSOR_KEYS:
        t = template[key.name]
        values = draw(st.lists(VALID_VALUES[key.name], min_size=t.numel(), max_size=t.numel()))
        new = torch.tensor(values, dtype=key.dtype).reshape(t.shape)
        if key.name == "step_amax" and new.numel() and draw(st.booleans()):
            new.view(torch.int32)[draw(st.integers(0, new.numel() - 1))] = draw(st.sampled_from(_NAN_BITS))
        sd[key.name] = new
    return sd


def _benign(draw: st.DrawFn, sd: dict[str, Any]) -> dict[str, Any]:
    """Changes that keep ``sd`` valid and its values bit for bit."""
    n = len(sd["slots"])
    perm = draw(st.permutations(range(n)))
    index = torch.tensor(perm, dtype=torch.long)
    sd["slots"] = [sd["slots"][i] for i in perm]
    for name in TENSOR_NAMES:
        sd[name] = sd[name][index]
    for name in TENSOR_NAMES:
        how = draw(st.sampled_from(["as is", "strided", "parameter", "grad", "inference"]))
        event(f"benign tensor: {how}")
        t = sd[name]
        if how == "strided":
            wide = torch.zeros(*t.shape, 3, dtype=t.dtype)
            wide[..., 1] = t
            sd[name] = wide[..., 1]
        elif how == "parameter":
            sd[name] = torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point() and draw(st.booleans()))
        elif how == "grad" and t.is_floating_point():
            sd[name] = t.clone().requires_grad_(True)
        elif how == "inference":
            with torch.inference_mode():
                sd[name] = t.clone()
    if draw(st.booleans()):
        sd["slots"] = draw(st.sampled_from([tuple, list]))(tuple(p) for p in sd["slots"])
    if draw(st.booleans()):
        sd["recipe"] = dict(reversed(list(sd["recipe"].items())))
    if draw(st.booleans()):
        sd = dict(reversed(list(sd.items())))
    if draw(st.booleans()):
        event("benign: torch.save / torch.load(weights_only=True)")
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
    return sd


# Each breaker breaks one key that is not broken yet (``broken``) and returns the name
# the error must mention, or None where it does not apply.
def _retype_scalar(draw: st.DrawFn, sd: dict[str, Any], broken: list[str]) -> str | None:
    keys = [k for k in ("format_version", "iteration") if k not in broken]
    if not keys:
        return None
    key = draw(st.sampled_from(keys))
    bad = {
        "format_version": [0, 4, -1, True, False, 3.0, "3", None, [3], torch.tensor(3), torch.tensor(3, device="meta")],
        "iteration": [-1, -(2**63), 2**63, 2**64, True, False, 1.5, "3", None, torch.tensor(3)],
    }[key]
    sd[key] = draw(st.sampled_from(bad))
    return key


def _drop_or_add_key(draw: st.DrawFn, sd: dict[str, Any], broken: list[str]) -> str | None:
    intact = [k for k in KEYS if k not in broken]
    if intact and draw(st.booleans()):
        key = draw(st.sampled_from(intact))
        del sd[key]
        return key
    key = draw(
        st.sampled_from([k for k in ("nonfinite", "Scale", "extra", "scale ") if k not in KEYS]) | st.integers(-3, 3)
    )
    sd[key] = draw(st.sampled_from([0, None, torch.zeros(2)]))
    return repr(key)


def _break_recipe(draw: st.DrawFn, sd: dict[str, Any], broken: list[str]) -> str | None:
    if "recipe" in broken:
        return None
    recipe = dict(sd["recipe"])
    how = draw(st.sampled_from(["not a dict", "drop", "add", "retype", "other value"]))
    field = draw(st.sampled_from(sorted(recipe)))
    if how == "not a dict":
        sd["recipe"] = draw(st.sampled_from([None, "DelayedScaling", list(recipe.items())]))
        return "recipe"
    if how == "drop":
        del recipe[field]
    elif how == "add":
        recipe[draw(st.sampled_from(["extra", "History_len", "granularity"]))] = 1
    elif how == "retype":
        value = recipe[field]
        recipe[field] = (
            int(value) if isinstance(value, bool) else float(value) if isinstance(value, int) else value.encode()
        )
    else:
        value = recipe[field]
        recipe[field] = (not value) if isinstance(value, bool) else value + 1 if isinstance(value, int) else value + "x"
    sd["recipe"] = recipe
    return "recipe"


def _break_slots(draw: st.DrawFn, sd: dict[str, Any], broken: list[str]) -> str | None:
    if "slots" in broken:
        return None
    slots = [list(p) for p in sd["slots"]]
    n = len(slots)
    how = draw(st.sampled_from(["not a list", "malformed", "role", "duplicate", "rename", "append", "drop"]))
    if how == "not a list":
        sd["slots"] = draw(st.sampled_from(["fc:input", None, {"fc": "input"}, torch.zeros(2)]))
        return "slots"
    if how == "append":
        slots.append(["never.registered", draw(st.sampled_from([r.value for r in ss.Role]))])
    elif n == 0:
        return None
    elif how == "malformed":
        slots[draw(st.integers(0, n - 1))] = draw(st.sampled_from([["a"], ["a", "input", "x"], ["a", 1], "a", None]))
    elif how == "role":
        slots[draw(st.integers(0, n - 1))][1] = draw(st.sampled_from(["INPUT", "Weight", "bias", "", "input "]))
    elif how == "duplicate":
        if n < 2:
            return None
        i, j = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        slots[j] = list(slots[i])
    elif how == "rename":
        slots[draw(st.integers(0, n - 1))][0] += "_"
    else:
        slots.pop(draw(st.integers(0, n - 1)))
    sd["slots"] = slots
    return "slots"


def _break_tensor(draw: st.DrawFn, sd: dict[str, Any], broken: list[str]) -> str | None:
    keys = [k for k in TENSOR_NAMES if k not in broken]
    if not keys:
        return None
    key = draw(st.sampled_from(keys))
    t = sd[key].detach()
    how = draw(st.sampled_from(["dtype", "shape", "not a tensor", "meta", "sparse", "subclass", "value", "value"]))
    event(f"breaking tensor: {how}")
    if how == "dtype":
        dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
                  torch.int32, torch.int64, torch.bool, torch.complex64]  # fmt: skip
        sd[key] = t.to(draw(st.sampled_from([d for d in dtypes if d != t.dtype])))
    elif how == "shape":
        shapes = [t.unsqueeze(0), t.unsqueeze(-1), torch.cat([t, torch.zeros(1, *t.shape[1:], dtype=t.dtype)])]
        if t.shape[0]:
            shapes.append(t[:-1])
        if t.dim() == 2:
            shapes.append(t[:, :-1])
        sd[key] = draw(st.sampled_from(shapes))
    elif how == "not a tensor":
        sd[key] = draw(st.sampled_from([t.tolist(), None, 1.0, tuple(t.flatten().tolist())]))
    elif how == "meta":
        sd[key] = t.to("meta")
    elif how == "sparse":
        sd[key] = t.to_sparse()
    elif how == "subclass":
        sd[key] = t.clone().as_subclass(_Sub)
    else:
        if not t.numel():
            return None
        bad = t.clone()
        bad.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(BAD_VALUES[key]))
        sd[key] = bad
    return key


BREAKERS = {
    "scalar": _retype_scalar,
    "key": _drop_or_add_key,
    "recipe": _break_recipe,
    "slots": _break_slots,
    "tensor": _break_tensor,
}


class TestFuzz:
    @settings(
        max_examples=1000,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(recipe=RECIPES, layout=LAYOUTS, data=st.data())
    def test_loaded_bitwise_or_refused_cleanly(self, recipe, layout, data):
        """Mutated state dicts either load bit for bit or raise StateDictError naming a broken key,
        leaving the manager bitwise unchanged; a loaded state steps to finite, normal scales."""
        target = ss.ScalingStateManager(recipe, backend="emulation")
        for name, roles in data.draw(st.permutations(layout)):
            target.register(name, roles=roles)
        template = target.state_dict()
        target.load_state_dict(_valid_values(data.draw, template))  # a state to keep or replace
        expected = _valid_values(data.draw, template)
        sd = _benign(data.draw, dict(expected))
        broken: list[str] = []
        count = data.draw(st.sampled_from([0, 0, 1, 1, 1, 2]))  # mostly one defect, so none hides another
        for kind in data.draw(
            st.lists(st.sampled_from([*BREAKERS, "tensor", "tensor"]), min_size=count, max_size=count)
        ):
            key = BREAKERS[kind](data.draw, sd, broken)
            if key is not None:
                event(f"breaking: {kind}")
                broken.append(key)
        if data.draw(st.booleans()):
            sd = data.draw(st.sampled_from([collections.OrderedDict, MappingProxyType, _ReadOnly]))(sd)
        if not broken:
            event("outcome: loaded")
            target.load_state_dict(sd)
            assert_same_state(target.state_dict(), expected)
            target.step()
            scales = target.state_dict()["scale"]
            assert bool(torch.isfinite(scales).all()) and bool((scales >= TINY).all())
            return
        event("outcome: refused")
        err = _refused(target, sd)
        assert any(key in str(err) for key in broken), (broken, str(err))


def test_rows_are_saved_sorted_by_name_and_role_whatever_the_registration_order():
    """Two managers that registered the same slots in other orders save identical dicts."""
    dicts = []
    for names in (["b", "a"], ["a", "b"]):
        m = ss.ScalingStateManager(ss.DelayedScaling(history_len=2), backend="emulation")
        for name in names:
            m.register(name, roles=(ss.Role.WEIGHT, ss.Role.INPUT))
        with m.forward():
            for k, name in enumerate("ab"):
                for j, role in enumerate((ss.Role.INPUT, ss.Role.WEIGHT)):
                    m.handles[name].quantize(torch.full((2,), float(10 * k + j + 1)), role)
        m.step()
        dicts.append(m.state_dict())
    assert dicts[0]["slots"] == [["a", "input"], ["a", "weight"], ["b", "input"], ["b", "weight"]]
    assert dicts[0]["slots"] == dicts[1]["slots"]
    for key in ("amax_history", "scale", "step_amax", "nonfinite_counts"):
        assert torch.equal(dicts[0][key], dicts[1][key]), key
    assert dicts[0]["amax_history"][:, -1].tolist() == [1.0, 2.0, 11.0, 12.0]



class TestAmaxFloorPersisted:
    """The recipes' amax_floor: saved only when set, so states of recipes without it are what they always were."""

    @pytest.mark.parametrize(
        ("recipe", "fields"),
        [
            (ss.DelayedScaling(history_len=4),
             ["kind", "history_len", "amax_compute", "margin", "format", "power_of_2"]),
            (ss.CurrentScaling(), ["kind", "format", "power_of_2"]),
        ],
        ids=["delayed", "current"],
    )
    def test_default_is_not_saved(self, recipe, fields):
        """At its default (0.0, no floor) the saved recipe has exactly the fields it had before amax_floor existed."""
        m, _ = _trained(recipe)
        assert list(m.state_dict()["recipe"]) == fields

    @pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4, amax_floor=1e-12),
                                        ss.CurrentScaling(amax_floor=1e-12)], ids=["delayed", "current"])
    def test_set_round_trips(self, recipe):
        """Set, it is saved as a float, loads (weights_only) into a manager of the same recipe bitwise, and
        recipe_from_dict gives the recipe back."""
        m, _ = _trained(recipe)
        sd = m.state_dict()
        assert sd["recipe"]["amax_floor"] == 1e-12 and type(sd["recipe"]["amax_floor"]) is float
        assert recipe_from_dict(sd["recipe"]) == recipe
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        fresh, _ = _trained(recipe, steps=0)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        assert_same_state(fresh.state_dict(), sd)

    def test_other_floor_refused(self):
        """A state saved with a floor does not load into a manager without one, nor the other way round."""
        floored, _ = _trained(ss.DelayedScaling(history_len=4, amax_floor=1e-12))
        plain, _ = _trained(ss.DelayedScaling(history_len=4))
        _refused(plain, floored.state_dict(), r"recipe differs in \['amax_floor'\]")
        _refused(floored, plain.state_dict(), r"recipe differs in \['amax_floor'\]")
        other, _ = _trained(ss.DelayedScaling(history_len=4, amax_floor=1e-10))
        _refused(other, floored.state_dict(), r"recipe differs in \['amax_floor'\]")

    def test_bad_saved_floor(self):
        """A saved recipe whose floor no recipe takes is a StateDictError naming it."""
        m, _ = _trained(ss.CurrentScaling(amax_floor=1e-12))
        saved = {**m.state_dict()["recipe"], "amax_floor": -1.0}
        with pytest.raises(StateDictError, match=r"amax_floor must be 0\.0"):
            recipe_from_dict(saved)
