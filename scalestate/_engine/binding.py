"""Which backend a manager uses, on which device: settled once, then fixed."""

from __future__ import annotations

import torch

from scalestate._engine.state import State
from scalestate.backends import Backend, check_backend, get_backend, resolve_backend, validate_backend
from scalestate.errors import BackendUnavailableError, CastError, DeviceUnavailableError
from scalestate.recipe import Recipe

__all__ = ["BackendBinding", "canonical_device", "settle_during_trace"]


class BackendBinding:
    """A manager's backend, bound to the device of its state.

    A backend name is looked up at once (an unknown one fails at construction);
    whether the backend can run, and which one ``"auto"`` means, is decided
    for the state's device: at construction when a device was given, else at
    the first cast, whose tensor's device the state then follows. From then
    on the device is fixed until an explicit :meth:`move`.

    Given the manager's ``recipe``, the check also asks whether the backend
    runs it on that device (:func:`scalestate.backends.supports`): a backend
    that does not fails there, with the reason, before anything is cast, and
    ``"auto"`` passes over such backends.
    """

    def __init__(self, backend: str | Backend, state: State, recipe: Recipe | None = None) -> None:
        self._state = state
        self._recipe = recipe
        self._name = backend if isinstance(backend, str) else validate_backend(backend).name
        self._backend: Backend | None = None
        if not isinstance(backend, str):
            self._backend = backend
        elif backend != "auto":
            self._backend = get_backend(backend)
        self._checked = False

    @property
    def ready(self) -> bool:
        """True once the device is fixed and the backend checked for it."""
        return self._checked and self._state.pinned

    @property
    def label(self) -> str:
        """The backend's name once settled, else the name asked for (``"auto"``)."""
        return self._backend.name if self._checked and self._backend is not None else self._name

    @property
    def backend(self) -> Backend:
        """The backend, checked for the state's device."""
        if torch.compiler.is_compiling():
            # Settled by an eager call, so that compiled code never sees the check change state.
            settle_during_trace(self, None)
        elif not self._checked:
            self._check()
        if self._backend is None:  # only reachable if settling failed, which raised
            raise BackendUnavailableError(f"backend {self._name!r} was never resolved")
        return self._backend

    def _check(self) -> None:
        device = self._state.device
        if self._backend is None:
            self._backend = resolve_backend("auto", device, recipe=self._recipe)
        else:
            check_backend(self._backend, self._name, device, self._recipe)
        self._checked = True

    def settle(self, device: torch.device | None) -> None:
        """Fix the state's device (following the first tensor cast) and check the backend for it.

        ``device=None`` checks the backend for the state's current device only.
        While ``torch.compile`` traces, call :func:`settle_during_trace` instead.
        """
        state = self._state
        if device is not None:
            if device != state.device:
                if state.pinned:
                    raise CastError(
                        f"a tensor on {device} was cast, but this manager's state lives on {state.device} "
                        f"and is already in use; use one manager per device, or call "
                        f"manager.to({str(device)!r}) between steps"
                    )
                self.move(device)
                return
            state.pin()
        if not self._checked:
            self._check()

    def move(self, device: torch.device) -> None:
        """Move the state to ``device``, values kept, and check (or for ``"auto"`` choose) the backend again."""
        self._state.to(device)
        self._state.pin()
        self._checked = False
        if self._name == "auto":
            self._backend = None
        self._check()


def settle_during_trace(binding: BackendBinding, device: torch.device | None) -> bool:
    """``binding.settle(device)``, run for real even while ``torch.compile`` traces.

    Settling happens once, before the first cast; when that cast is inside a
    compiled region, the compiler runs this eagerly at trace time (it does not
    trace it, so the compiled code never sees the state it sets change) and
    keeps tracing with the settled state.
    """
    binding.settle(device)
    return True


# What torch.compiler.assume_constant_result(fn) does (a test checks that it still
# does), without importing the compiler, which would double `import scalestate`'s time.
settle_during_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]  # the compiler's own mark


def canonical_device(device: torch.device | str) -> torch.device:
    """The device as tensors report it: ``cuda`` is the current GPU's index, ``cpu:0`` is ``cpu``.

    Raises:
        DeviceUnavailableError: the device does not exist here: a build of torch without
            CUDA asked for ``cuda``, no GPU visible, an index past the last GPU, or another
            accelerator type whose ``torch.<type>.is_available()`` is False.
    """
    device = torch.device(device)
    index: int | None = device.index  # torch's stubs say int; it is None when not given
    if device.type == "cpu":
        return torch.device("cpu")
    _require(device)
    if device.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


#: What a DeviceUnavailableError suggests instead.
_INSTEAD = "use the device 'cpu' instead (a manager built without device= follows the tensors it casts)"


def _require(device: torch.device) -> None:
    """Raise :class:`DeviceUnavailableError` if ``device`` does not exist here."""
    asked = f"device {str(device)!r} asked for, but"
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise DeviceUnavailableError(
            f"{asked} this torch ({torch.__version__}) is a build without CUDA support; install a CUDA "
            f"build of torch (https://pytorch.org/get-started/locally/), or {_INSTEAD}"
        )
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available) or is_available():
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise DeviceUnavailableError(
                f"{asked} torch sees {count} GPU{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1}); "
                f"pass one of those, or {_INSTEAD}"
            )
        return
    why = (
        "torch sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides every GPU)"
        if device.type == "cuda"
        else f"this torch ({torch.__version__}) has no usable {device.type} device"
    )
    raise DeviceUnavailableError(f"{asked} {why}: torch.{device.type}.is_available() is False; {_INSTEAD}")
