"""`ScalingStateManager`: owns every FP8 scale, amax history and phase of a model."""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import Backend, CastSpec, get_backend, resolve_backend, validate_backend
from scalestate.errors import (
    BackendUnavailableError,
    PhaseError,
    RecomputeMismatchError,
    ScaleStateError,
    SlotError,
)
from scalestate.handle import ScalingHandle
from scalestate.persist import to_state_dict, validate
from scalestate.phase import (
    CastKind,
    Phase,
    in_autograd_backward,
    in_marked_recompute,
    in_marked_training_forward,
    in_reentrant_checkpoint_forward,
)
from scalestate.quantized import Quantized
from scalestate.recipe import CurrentScaling, DelayedScaling, Direction, Recipe, Role, fp8_max
from scalestate.state import CachedCast, Slot, State

__all__ = ["ScalingStateManager"]

_log = logging.getLogger("scalestate")


class ScalingStateManager:
    """Owns the scaling state of FP8 training: scales, amax histories, phases.

    Module libraries :meth:`register` what they cast and cast through the
    returned :class:`ScalingHandle`; the training loop drives the phases and
    calls :meth:`step` once per optimizer step. Scales change only in
    :meth:`step`; recomputation by activation checkpointing records nothing.

    Args:
        recipe: :class:`DelayedScaling` or :class:`CurrentScaling`.
        backend: a registered backend name (``"emulation"``, ``"scaled_mm"``,
            ...), ``"auto"`` for the best one available on the state's device,
            or a backend object. An unknown name fails at once; availability
            (and the choice of ``"auto"``) is settled for ``device`` if given,
            else at the first cast, on that tensor's device.
        device: where the state lives; by default the device of the first
            tensor cast.
        debug: check that every recompute reproduces the amaxes of its forward
            (raises :class:`~scalestate.errors.RecomputeMismatchError`).

    .. warning:: ``debug=True`` reads amaxes back to the host on every
       recorded forward cast and every recomputed one, a device sync each.
       Leave it off for speed.

    Example:
        >>> import torch, scalestate as ss
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> model = ss.nn.convert(model, manager)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for batch in torch.randn(3, 8, 16):
        ...     for mb in batch.split(4):
        ...         with manager.forward():
        ...             loss = model(mb).square().mean()
        ...         with manager.backward():
        ...             loss.backward()
        ...     opt.step()
        ...     opt.zero_grad()
        ...     manager.step()
        >>> manager
        <ScalingStateManager(recipe=DelayedScaling, backend='emulation', phase=IDLE, slots=6, step=3)>
    """

    def __init__(
        self,
        recipe: Recipe,
        backend: str | Backend = "auto",
        *,
        device: torch.device | str | None = None,
        debug: bool = False,
    ) -> None:
        if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
            raise ScaleStateError(
                f"recipe must be ss.DelayedScaling(...) or ss.CurrentScaling(...); got {recipe!r}"
            )
        dev = _canonical(torch.device(device)) if device is not None else None
        # A name is looked up now (an unknown one fails at once); whether the backend
        # can run, and which one "auto" means, is decided for the state's device:
        # now if `device` was given, else at the first cast.
        self._backend_name = backend if isinstance(backend, str) else validate_backend(backend).name
        self._backend: Backend | None = None
        if not isinstance(backend, str):
            self._backend = backend
        elif backend != "auto":
            self._backend = get_backend(backend)
        self._backend_checked = False
        self._recipe: Recipe = recipe
        self._debug = bool(debug)
        self._state = State(device=dev or torch.device("cpu"), history_len=recipe.history_len)
        self._state.pinned = dev is not None
        if dev is not None:
            self._checked_backend()

    # ----------------------------------------------------------------- info
    @property
    def recipe(self) -> Recipe:
        """The recipe every slot follows."""
        return self._recipe

    @property
    def backend(self) -> Backend:
        """The backend instance doing casts, products and updates, checked for the state's device."""
        return self._checked_backend()

    def _checked_backend(self) -> Backend:
        if self._backend_checked and self._backend is not None:
            return self._backend
        device = self._state.device
        if self._backend is None:
            self._backend = resolve_backend("auto", device)
        else:
            ok, reason = self._backend.available(device)
            if not ok:
                raise BackendUnavailableError(
                    f"backend {self._backend_name!r} cannot run on {device}: {reason}. "
                    "Use backend='auto' or backend='emulation'"
                )
        self._backend_checked = True
        return self._backend

    def _recheck_backend(self) -> None:
        """After the state moved: check the backend again, or choose again for "auto"."""
        self._backend_checked = False
        if self._backend_name == "auto":
            self._backend = None

    @property
    def phase(self) -> Phase:
        """The explicit phase (``Phase.IDLE`` when none is set)."""
        return self._state.phase

    @property
    def iteration(self) -> int:
        """Number of :meth:`step` calls so far (restored by :meth:`load_state_dict`)."""
        return self._state.iteration

    @property
    def device(self) -> torch.device:
        """Where the state tensors live."""
        return self._state.device

    @property
    def debug(self) -> bool:
        """Whether recomputes are checked against their forward."""
        return self._debug

    @property
    def handles(self) -> Mapping[str, ScalingHandle]:
        """Registered names and their handles (read-only)."""
        return MappingProxyType(self._state.handles)

    def __repr__(self) -> str:
        st = self._state
        backend = self._backend.name if self._backend_checked and self._backend else self._backend_name
        return (
            f"<ScalingStateManager(recipe={type(self._recipe).__name__}, "
            f"backend={backend!r}, phase={st.phase.name}, "
            f"slots={len(st.slots)}, step={st.iteration})>"
        )

    # --------------------------------------------------------- registration
    def register(self, name: str, roles: Iterable[Role] = tuple(Role)) -> ScalingHandle:
        """Register what a module casts: one slot per role, under a unique name.

        Args:
            name: unique within the manager, e.g. the module path ``"blocks.0.fc1"``.
            roles: the roles it casts (default: INPUT, WEIGHT, GRAD_OUTPUT).

        Raises:
            SlotError: the name is taken, empty, or the roles are not distinct Roles.
        """
        st = self._state
        if not isinstance(name, str) or not name:
            raise SlotError(f"slot name must be a non-empty string; got {name!r}")
        if name in st.handles:
            raise SlotError(
                f"a slot named {name!r} is already registered with this manager; "
                "names must be unique (use the module's path, e.g. 'blocks.0.fc1')"
            )
        roles = tuple(roles)
        bad = [r for r in roles if not isinstance(r, Role)]
        if not roles or bad or len(set(roles)) != len(roles):
            raise SlotError(
                f"roles must be distinct ss.Role values, at least one; got {roles!r} "
                f"(allowed: {', '.join('Role.' + r.name for r in Role)})"
            )
        slots = [Slot(name, role, self._spec(role)) for role in roles]
        rows = st.add_rows(slots)
        handle = ScalingHandle(self, name, dict(zip(roles, rows, strict=True)))
        st.handles[name] = handle
        return handle

    def _spec(self, role: Role) -> CastSpec:
        dtype = self._recipe.format.dtype(role)
        return CastSpec(
            dtype=dtype,
            fp8_max=fp8_max(dtype),
            margin=self._recipe.margin,
            power_of_2=self._recipe.power_of_2,
        )

    # --------------------------------------------------------------- phases
    def begin_forward(self) -> None:
        """Enter the training forward phase (lasts until another ``begin_*()`` or :meth:`step`)."""
        self._begin(Phase.FORWARD, "begin_forward()")

    def begin_recompute(self) -> None:
        """Enter the recompute phase: forward casts use the step's scales and record nothing.

        For frameworks that recompute outside autograd; torch's checkpoint
        mechanisms are recognised without it.
        """
        self._begin(Phase.RECOMPUTE, "begin_recompute()")

    def begin_backward(self) -> None:
        """Enter the backward phase: gradient casts are recorded; forward casts are recomputes."""
        self._begin(Phase.BACKWARD, "begin_backward()")

    def _begin(self, phase: Phase, call: str) -> None:
        st = self._state
        if st.blocks and phase is not Phase.RECOMPUTE:
            raise PhaseError(
                f"{call} called inside `with manager.{st.blocks[-1][0].value}()`, which sets the "
                "phase itself and restores it on exit; leave the block first, or use either "
                "the blocks or the begin_*() calls, not both"
            )
        st.phase = phase

    @contextlib.contextmanager
    def forward(self) -> Iterator[ScalingStateManager]:
        """A training forward block: ``with manager.forward(): loss = model(x)``."""
        with self._block(Phase.FORWARD):
            yield self

    @contextlib.contextmanager
    def recompute(self) -> Iterator[ScalingStateManager]:
        """A recompute block (allowed inside any other block)."""
        with self._block(Phase.RECOMPUTE):
            yield self

    @contextlib.contextmanager
    def backward(self) -> Iterator[ScalingStateManager]:
        """A backward block: ``with manager.backward(): loss.backward()``."""
        with self._block(Phase.BACKWARD):
            yield self

    @contextlib.contextmanager
    def _block(self, phase: Phase) -> Iterator[None]:
        st = self._state
        if phase is not Phase.RECOMPUTE:
            for open_phase, _ in st.blocks:
                if open_phase is not phase:
                    raise PhaseError(
                        f"`with manager.{phase.value}()` entered inside "
                        f"`with manager.{open_phase.value}()`; close the "
                        f"{open_phase.value} block before starting a {phase.value} block"
                    )
        st.blocks.append((phase, st.phase))
        st.phase = phase
        try:
            yield
        finally:
            _, st.phase = st.blocks.pop()

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        """End the step: roll every history, derive new scales, clear the accumulators.

        Call once per optimizer step, after all microbatches' backward passes.
        One fused backend update for all slots; no host-device sync.

        Raises:
            PhaseError: called inside a phase block, or a slot's backward was
                recorded while none of its forward casts were (they counted as
                evaluation), which would leave its forward scales unfed.
        """
        st = self._state
        if st.blocks:
            raise PhaseError(
                f"step() called inside `with manager.{st.blocks[-1][0].value}()`; call step() "
                "once per optimizer step, after the forward and backward blocks have closed"
            )
        self._check_forward_recorded()
        r = self._recipe
        self.backend.update(
            st.history, st.scales, st.step_amax, st.fp8_max,
            amax_compute=r.amax_compute, margin=r.margin, power_of_2=r.power_of_2,
        )
        st.end_step()

    def _check_forward_recorded(self) -> None:
        st = self._state
        for name in sorted(st.backward_recorded - st.forward_recorded):
            handle = st.handles[name]
            if any(role.direction is Direction.FORWARD for role in handle.roles):
                raise PhaseError(
                    f"slot {name!r} was cast for GRAD_OUTPUT in this step, but none of its forward "
                    "casts was recorded: they ran with grad disabled and no phase set, so they "
                    "counted as evaluation. Run the training forward inside "
                    "`with manager.forward():` (or after begin_forward()), and make forward-role "
                    "casts in the module's forward, not inside autograd.Function.forward"
                )

    # ----------------------------------------------------------------- casts
    def _classify_forward(self, name: str, role: Role) -> CastKind:
        phase = self._state.phase
        if phase is Phase.RECOMPUTE or in_marked_recompute() or in_autograd_backward():
            return CastKind.RECOMPUTE
        if phase is Phase.FORWARD or in_marked_training_forward():
            return CastKind.RECORD
        grad = torch.is_grad_enabled()
        if phase is Phase.BACKWARD:
            if not grad:
                return CastKind.EVALUATION
            raise PhaseError(
                f"{role.name} cast of slot {name!r} in the BACKWARD phase, outside autograd's "
                "backward: call begin_forward() before a new forward pass, begin_recompute() "
                "before recomputing one, or run an evaluation pass under torch.no_grad()"
            )
        if grad or in_reentrant_checkpoint_forward():
            return CastKind.RECORD
        return CastKind.EVALUATION

    def _cast(self, name: str, row: int, role: Role, x: Tensor) -> Quantized:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ScaleStateError(
                f"slot {name!r} {role.name}: expected a floating-point tensor; "
                f"got {x.dtype if isinstance(x, Tensor) else type(x).__name__}"
            )
        st = self._state
        if x.device != st.device:
            self._follow_device(x.device, name)
        st.pinned = True
        forward = role.direction is Direction.FORWARD
        kind = self._classify_forward(name, role) if forward else CastKind.RECORD
        if role is Role.WEIGHT:
            q, amax = self._weight_cast(row, x)
        else:
            q, amax = self.backend.quantize(x.detach(), st.scales[row], st.slots[row].spec, self._jit(row))
        if kind is CastKind.RECORD:
            acc = st.step_amax[row]
            torch.maximum(acc, amax, out=acc)
            (st.forward_recorded if forward else st.backward_recorded).add(name)
            if self._debug and forward:
                st.forward_amaxes.setdefault(row, []).append(float(amax))
        elif kind is CastKind.RECOMPUTE and self._debug:
            self._check_recompute(row, float(amax))
        return q

    def _jit(self, row: int) -> bool | Tensor:
        """Whether the cast scales from its own tensor: always for current scaling,
        and for delayed scaling while the slot has no history (its newest entry is 0).
        Decided on the host where that is free, else on the device (no sync)."""
        st = self._state
        if not self._recipe.delayed or row in st.fresh_rows:
            return True
        if st.history_known:
            return False
        return st.history[row, -1] <= 0

    def _weight_cast(self, row: int, x: Tensor) -> tuple[Quantized, Tensor]:
        st = self._state
        entry = st.weight_casts.get(row)
        if entry is not None and entry.matches(x, st.epoch):
            return entry.quantized, entry.amax
        q, amax = self.backend.quantize(x.detach(), st.scales[row], st.slots[row].spec, self._jit(row))
        # Inference tensors (made in, or cast from, inference mode) track no version
        # and cannot be saved for a later training backward: never cache them.
        if torch.is_inference_mode_enabled() or x.is_inference():
            return q, amax
        st.weight_casts[row] = CachedCast(weakref.ref(x), x.data_ptr(), x._version, st.epoch, q, amax)
        return q, amax

    def _check_recompute(self, row: int, amax: float) -> None:
        pending = self._state.forward_amaxes.get(row, [])
        for i, seen in enumerate(pending):
            if seen == amax or (math.isnan(seen) and math.isnan(amax)):
                del pending[i]
                return
        slot = self._state.slots[row]
        forward = f"amax {pending[0]!r}" if pending else "nothing (no unmatched forward cast in this step)"
        raise RecomputeMismatchError(
            f"recompute of slot {slot.name!r} ({slot.role.name}) at step {self.iteration} observed "
            f"amax {amax!r}, but its forward observed {forward}. The recomputed region is not "
            "deterministic: dropout or other random ops without preserved RNG state, "
            "data-dependent control flow, or an input modified in place between forward and backward"
        )

    def _follow_device(self, device: torch.device, name: str) -> None:
        st = self._state
        if st.pinned:
            raise ScaleStateError(
                f"slot {name!r} cast a tensor on {device}, but this manager's state lives on "
                f"{st.device} and is already in use; use one manager per device, or call "
                f"manager.to({str(device)!r}) between steps"
            )
        st.to(device)
        self._recheck_backend()

    def to(self, device: torch.device | str) -> ScalingStateManager:
        """Move the state to ``device``, every value kept (a step's pending amaxes too).

        Not inside a phase block. The backend is checked (or, for ``"auto"``,
        chosen again) for the new device.
        """
        if self._state.blocks:
            raise PhaseError("to() called inside a phase block; move the state between steps")
        self._state.to(_canonical(torch.device(device)))
        self._state.pinned = True
        self._recheck_backend()
        self._checked_backend()
        return self

    def invalidate_casts(self) -> None:
        """Drop cached weight casts.

        Needed only after editing a weight through ``.data``, which PyTorch's
        version counter does not see; every other in-place change, optimizer
        steps and ``load_state_dict`` included, is detected by itself.
        """
        self._state.weight_casts.clear()

    # ---------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The state as plain values (see :mod:`scalestate.persist` for every key)."""
        return to_state_dict(self._state, self._recipe)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`; validated before anything changes.

        Raises:
            PhaseError: called in the middle of a step (casts recorded since the last step()).
            StateDictError: missing keys, another recipe, other slots, bad shapes or values.
        """
        st = self._state
        if st.blocks:
            raise PhaseError(
                f"load_state_dict() called inside `with manager.{st.blocks[-1][0].value}()`; "
                "load between steps: after step() and before the next forward"
            )
        if st.forward_recorded or st.backward_recorded:
            raise PhaseError(
                "load_state_dict() called in the middle of a step (casts were recorded since the "
                "last step()); load between steps: after step() and before the next forward"
            )
        loaded = validate(state_dict, st, self._recipe)
        st.history.copy_(loaded.history)
        st.scales.copy_(loaded.scales)
        st.step_amax.copy_(loaded.step_amax)
        st.iteration = loaded.iteration
        st.epoch += 1
        st.refresh_history_rows()
        st.weight_casts.clear()
        st.forward_amaxes.clear()


def _canonical(device: torch.device) -> torch.device:
    """The device as tensors report it: ``cuda`` is the current GPU's index, ``cpu:0`` is ``cpu``."""
    index: int | None = device.index  # torch's stubs say int; it is None when not given
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
