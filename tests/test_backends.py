"""scalestate.backends: the registry, entry points and the interface check."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch

import scalestate as ss
from scalestate.backends import (
    available_backends,
    get_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.errors import BackendUnavailableError, ScaleStateError, UnknownBackendError


class _Unavailable(EmulationBackend):
    name = "nowhere"

    def available(self, device=None):
        return False, "needs a device that does not exist"


@pytest.fixture
def register():
    """register_backend for this test: every name it registered is unregistered afterwards."""
    names: list[str] = []

    def register(name, factory, *, replace=False):
        register_backend(name, factory, replace=replace)
        names.append(name)

    yield register
    for name in dict.fromkeys(reversed(names)):
        unregister_backend(name)


class TestRegistry:
    def test_builtins(self):
        """emulation and scaled_mm are registered and available on CPU here."""
        report = available_backends("cpu")
        assert report["emulation"][0] and report["scaled_mm"][0]

    def test_unknown_lists_registered_names(self):
        """An unknown name lists every registered name."""
        with pytest.raises(UnknownBackendError) as info:
            get_backend("tpu9000")
        assert "emulation" in str(info.value) and "scaled_mm" in str(info.value)
        with pytest.raises(UnknownBackendError):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="tpu9000")

    def test_register_and_use(self, register):
        """A registered factory is used by a manager, one instance per manager."""
        register("mine", EmulationBackend)
        a = ss.ScalingStateManager(ss.DelayedScaling(), backend="mine")
        b = ss.ScalingStateManager(ss.DelayedScaling(), backend="mine")
        assert isinstance(a.backend, EmulationBackend) and a.backend is not b.backend

    def test_duplicate_needs_replace(self, register):
        """Registering a taken name is refused unless replace=True."""
        with pytest.raises(ScaleStateError, match="replace=True"):
            register_backend("emulation", EmulationBackend)
        register("emulation", ScaledMMBackend, replace=True)
        assert isinstance(get_backend("emulation"), ScaledMMBackend)

    @pytest.mark.parametrize("name", ["", "auto", "has space", 3])
    def test_bad_names(self, name):
        """Malformed names and the reserved 'auto' are refused."""
        with pytest.raises(ScaleStateError):
            register_backend(name, EmulationBackend)

    def test_factory_must_be_callable(self):
        """A non-callable factory is refused at registration."""
        with pytest.raises(ScaleStateError, match="callable"):
            register_backend("x", 42)  # type: ignore[arg-type]

    def test_incomplete_backend(self, register):
        """A backend lacking a method is refused with the method's name."""
        register("half", lambda: object())
        with pytest.raises(ScaleStateError, match="available"):
            get_backend("half")

    def test_old_interface_is_named(self):
        """A backend written for the old quantize() interface is told what replaced it."""

        class Old:
            name = "old"

            def available(self, device=None):
                return True, "yes"

            def quantize(self, x, scale, spec, jit):
                raise AssertionError

        with pytest.raises(ScaleStateError, match=r"became cast\(request: CastRequest\)"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend=Old())  # type: ignore[arg-type]

    def test_unavailable_says_why(self, register):
        """An unavailable backend's error carries its reason."""
        register("nowhere", _Unavailable)
        with pytest.raises(BackendUnavailableError, match="does not exist"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="nowhere", device="cpu")
        assert available_backends()["nowhere"] == (False, "needs a device that does not exist")

    def test_unavailable_found_at_first_cast_without_device(self, register):
        """With no device given, availability is checked for the first tensor's device."""
        register("nowhere", _Unavailable)
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="nowhere")
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with pytest.raises(BackendUnavailableError, match="does not exist"):
            h.quantize(torch.ones(2), ss.Role.INPUT)

    def test_auto_is_settled_on_the_state_device(self):
        """Without a device, 'auto' is chosen at the first cast, for that tensor's device."""
        m = ss.ScalingStateManager(ss.DelayedScaling())
        assert "backend='auto'" in repr(m)
        m.register("fc", roles=(ss.Role.INPUT,)).quantize(torch.ones(2), ss.Role.INPUT)
        assert m.backend.name == "emulation" and "backend='emulation'" in repr(m)

    def test_auto_skips_a_broken_backend(self, caplog, register):
        """A registered backend whose factory fails does not stop 'auto' from trying the next
        (here the built-in cuda backend, replaced by one that cannot load)."""

        def broken():
            raise ImportError("libfp8kernels.so: cannot open shared object file")

        register("cuda", broken, replace=True)
        with caplog.at_level(logging.INFO, logger="scalestate"):
            backend = resolve_backend("auto", torch.device("cuda"))
        assert backend.name in ("scaled_mm", "emulation")

    def test_backend_needs_a_name(self, register):
        """A backend object without a string name is refused, by registry and manager alike."""

        class Nameless(EmulationBackend):
            name = None  # type: ignore[assignment]

        register("nameless", Nameless)
        with pytest.raises(ScaleStateError, match="'name'"):
            get_backend("nameless")
        with pytest.raises(ScaleStateError, match="'name'"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend=Nameless())

    def test_auto_picks_and_logs(self, caplog):
        """'auto' on CPU picks the emulation backend and says so on the scalestate logger."""
        with caplog.at_level(logging.INFO, logger="scalestate"):
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend="auto", device="cpu")
        assert m.backend.name == "emulation"
        assert "chose 'emulation'" in caplog.text

    def test_reprs(self):
        """Both built-in backends say what they are."""
        assert repr(get_backend("emulation")) == "EmulationBackend()"
        assert repr(get_backend("scaled_mm")).startswith("ScaledMMBackend(")

    def test_manager_accepts_instance(self):
        """A backend object can be passed directly."""
        b = ScaledMMBackend()
        assert ss.ScalingStateManager(ss.DelayedScaling(), backend=b).backend is b


class TestUnregister:
    def test_unregister(self):
        """An unregistered name is unknown again; managers made before keep their backend."""
        register_backend("mine", EmulationBackend)
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="mine")
        unregister_backend("mine")
        with pytest.raises(UnknownBackendError, match="no backend named 'mine'"):
            get_backend("mine")
        assert "mine" not in available_backends() and isinstance(m.backend, EmulationBackend)
        assert ss.backends.unregister_backend is unregister_backend and "unregister_backend" in ss.backends.__all__

    def test_unknown_name_lists_what_can_be_unregistered(self, register):
        """Unregistering an unknown name raises UnknownBackendError naming what can be unregistered."""
        with pytest.raises(UnknownBackendError, match=r"no backend named 'tpu9000' .*: none$"):
            unregister_backend("tpu9000")
        register("mine", EmulationBackend)
        with pytest.raises(UnknownBackendError, match=r"register_backend\(\) or an entry point: mine$"):
            unregister_backend("tpu9000")

    @pytest.mark.parametrize("name", ["emulation", "scaled_mm"])
    def test_builtins_stay(self, name):
        """A built-in name that was never replaced cannot be unregistered; it still works afterwards."""
        with pytest.raises(UnknownBackendError, match=f"'{name}' is a built-in backend, which cannot be removed"):
            unregister_backend(name)
        assert get_backend(name).name == name

    def test_replaced_builtin_is_restored(self):
        """Unregistering a replaced built-in restores the built-in backend, once."""
        register_backend("emulation", ScaledMMBackend, replace=True)
        unregister_backend("emulation")
        assert type(get_backend("emulation")) is EmulationBackend
        with pytest.raises(UnknownBackendError, match="built-in"):
            unregister_backend("emulation")


class TestEntryPoints:
    def test_third_party_registration(self, tmp_path, monkeypatch):
        """A distribution declaring the 'scalestate.backends' entry point is found by name."""
        (tmp_path / "thirdparty_fp8.py").write_text(
            textwrap.dedent(
                """
                from scalestate.backends.emulation import EmulationBackend

                class ThirdParty(EmulationBackend):
                    name = "thirdparty"
                """
            )
        )
        dist = tmp_path / "thirdparty_fp8-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-fp8\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(
            "[scalestate.backends]\nthirdparty = thirdparty_fp8:ThirdParty\nauto = thirdparty_fp8:ThirdParty\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "thirdparty_fp8", raising=False)
        try:
            assert "thirdparty" in available_backends()
            assert "auto" not in available_backends()
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend="thirdparty")
            assert type(m.backend).__name__ == "ThirdParty"
            unregister_backend("thirdparty")
            assert "thirdparty" not in available_backends()  # the entry point is not loaded again
            with pytest.raises(UnknownBackendError):
                get_backend("thirdparty")
            assert m.backend.name == "thirdparty"  # a manager made before keeps its instance
            register_backend("thirdparty", EmulationBackend)  # the name can be registered again
            assert type(get_backend("thirdparty")) is EmulationBackend
        finally:
            if "thirdparty" in available_backends():
                unregister_backend("thirdparty")
