"""`ScalingStateManager`: owns every FP8 scale, amax history and phase of a model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from scalestate._engine import grouped_rows
from scalestate._engine.binding import BackendBinding, canonical_device
from scalestate._engine.casting import Caster, ShardCast
from scalestate._engine.control import PhaseControl
from scalestate._engine.loading import validate
from scalestate._engine.state import Slot, State
from scalestate.backends import Backend
from scalestate.backends.base import cast_spec
from scalestate.diagnostics import ScalingStats, build_stats
from scalestate.distributed import DEFAULT_GROUP, GroupSpec, Reduction
from scalestate.errors import ArgumentTypeError, PhaseError, SlotError
from scalestate.handle import ScalingHandle
from scalestate.nonfinite import NonFinitePolicy, NonFinitePolicyName, parse_policy
from scalestate.persist import recipe_to_dict, to_state_dict
from scalestate.phase import Phase
from scalestate.quantized import Quantized
from scalestate.recipe import RECIPES, Recipe, Role

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ScalingStateManager"]


class ScalingStateManager(PhaseControl):
    """Owns the scaling state of FP8 training: scales, amax histories, phases.

    Module libraries :meth:`register` what they cast and cast through the
    returned :class:`ScalingHandle`; the training loop drives the phases and
    calls :meth:`step` once per optimizer step. Scales change only in
    :meth:`step`; recomputation by activation checkpointing records nothing.
    Phases are per thread, like torch's grad mode.

    Args:
        recipe: per tensor, :class:`DelayedScaling` or :class:`CurrentScaling`;
            fine-grained (just in time, per row, tile, block or MX block),
            :class:`RowwiseScaling`, :class:`BlockScaling` or :class:`MXFP8Scaling`.
        backend: a registered backend name (``"emulation"``, ``"scaled_mm"``,
            ...), ``"auto"`` for the best one available on the state's device,
            or a backend object. An unknown name fails at once; availability
            (and the choice of ``"auto"``) is settled for ``device`` if given,
            else at the first cast, on that tensor's device.
        device: where the state lives; by default the device of the first tensor cast.
        debug: check that every recompute of a forward cast observes an amax that
            a recorded forward cast of the same slot observed in the same step,
            any number of times (nested regions, selective checkpointing); raises
            :class:`~scalestate.errors.RecomputeMismatchError` otherwise (see
            the debug-mode section of the checkpointing guide for exactly what is checked); eager code only.
        group: the ranks whose step amaxes are max-reduced at every :meth:`step`
            (one ``all_reduce``), so that they all hold identical scales: a
            ``ProcessGroup``, a 1-D ``DeviceMesh`` or a ``(DeviceMesh, dim)``
            pair. By default the default process group when
            ``torch.distributed`` is initialized at the step, none otherwise;
            ``None`` turns reduction off. See :mod:`scalestate.distributed`.
        on_nonfinite: what :meth:`step` does with a slot whose step amax is NaN
            or infinite: a :class:`~scalestate.NonFinitePolicy` or its string
            value. ``"skip"``: the slot keeps its history and scale for
            that step. ``"raise"``: :meth:`step` raises
            :class:`~scalestate.errors.NonFiniteAmaxError` and changes nothing
            (it reads one flag back to the host every step: a device sync).
            ``"fallback"``: the slot forgets its history and scales just in
            time until a finite step gives it history again. ``"skip"`` and
            ``"fallback"`` count such steps (:meth:`nonfinite_counts`).
        collect_stats: also count, on the device, what every recorded cast does
            to its elements (clipped at the format's max, flushed to zero), for
            :meth:`stats`. It costs extra passes over every cast tensor (see
            the diagnostics guide for measured costs); no host-device sync.
        seed: what :class:`NVFP4Scaling`'s random Hadamard signs and
            stochastic rounding draw from (an int in ``[0, 2**63)``; no draw
            uses torch's generators). Give every rank of a group the same seed
            (the default, 0, is): the signs must be equal on all of them. Saved
            by :meth:`state_dict` and restored by :meth:`load_state_dict`.

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
        group: GroupSpec = DEFAULT_GROUP,
        on_nonfinite: NonFinitePolicy | NonFinitePolicyName = "skip",
        collect_stats: bool = False,
        seed: int = 0,
    ) -> None:
        if not isinstance(recipe, RECIPES):
            names = ", ".join(f"ss.{cls.__name__}(...)" for cls in RECIPES)
            raise ArgumentTypeError(f"recipe must be one of {names}; got {recipe!r}")
        self._on_nonfinite: NonFinitePolicy = parse_policy(on_nonfinite)
        if not isinstance(collect_stats, bool):
            raise ArgumentTypeError(f"collect_stats must be True or False; got {collect_stats!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ArgumentTypeError(f"seed must be an int in [0, 2**63); got {seed!r}")
        self._refused = False
        dev = canonical_device(device) if device is not None else None
        self._recipe: Recipe = recipe
        self._rule = recipe.rule
        self._delayed = recipe.delayed
        self._specs = {role: cast_spec(recipe, role) for role in Role}
        self._state = State(
            dev or torch.device("cpu"), recipe.history_len, debug=bool(debug), stats=collect_stats, seed=seed,
            draws=any(spec.stochastic for spec in self._specs.values()),
        )
        self._binding = BackendBinding(backend, self._state, recipe)
        self._handles: dict[str, ScalingHandle] = {}
        self._caster = Caster(self._state, self._binding, delayed=self._delayed)
        #: Compiled grouped layers' casts with the sizes on the device (`scalestate._engine.grouped_rows`).
        self._device_groups = grouped_rows.DeviceGroups(self._caster)
        self._reduction = Reduction(group)
        self._recipe_dict = recipe_to_dict(recipe)
        if dev is not None:
            self._binding.settle(dev)

    # ----------------------------------------------------------------- info
    @property
    def recipe(self) -> Recipe:
        """The recipe every slot follows."""
        return self._recipe

    @property
    def seed(self) -> int:
        """The seed NVFP4's random draws come from (restored by :meth:`load_state_dict`)."""
        return self._state.random.seed

    def rht_signs(self) -> Tensor:
        """A copy of the 16 signs (float32 ``+-1``) of NVFP4's random Hadamard transform.

        One set, shared by every slot: the two operands of a weight-gradient
        product (``x`` of the INPUT slot and ``dy`` of the GRAD_OUTPUT slot)
        must be transformed alike for the product to be unchanged, and one
        fixed set serves every layer (see docs/recipes.md).
        """
        return self._state.random.signs.clone()

    @property
    def backend(self) -> Backend:
        """The backend instance doing casts, products and updates, checked for the state's device."""
        return self._binding.backend

    @property
    def phase(self) -> Phase:
        """The calling thread's explicit phase (``Phase.IDLE`` when none is set)."""
        return self._state.phases.phase

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
        return self._state.checker is not None

    @property
    def on_nonfinite(self) -> NonFinitePolicy:
        """The non-finite policy, a :class:`~scalestate.NonFinitePolicy` (``FALLBACK``: a step may zero histories)."""
        return self._on_nonfinite

    @property
    def collect_stats(self) -> bool:
        """Whether recorded casts are counted for the fractions of :meth:`stats`."""
        return self._state.stats

    @property
    def group(self) -> ProcessGroup | None:
        """The process group :meth:`step` reduces over now (``None``: no reduction)."""
        return self._reduction.group()

    @property
    def handles(self) -> Mapping[str, ScalingHandle]:
        """Registered names and their handles (read-only)."""
        return MappingProxyType(self._handles)

    @property
    def slots(self) -> tuple[tuple[str, Role], ...]:
        """Every slot as ``(name, role)``, in the row order of :meth:`buffers` (registration order).

        ``state_dict()`` lists the same slots sorted by name and role instead.
        """
        return tuple((s.name, s.role) for s in self._state.slots)

    def buffers(self) -> Mapping[str, Tensor]:
        """Live views of the state's buffers, one row per slot in :attr:`slots` order.

        ``"amax_history"`` ``[N, history_len]``, ``"scale"`` ``[N]``, ``"step_amax"`` ``[N]``,
        all float32 on :attr:`device`. They are the state itself, not copies: they
        change at every step, and their storage never moves after the first
        :meth:`step` (only :meth:`to` moves it), so CUDA graphs and external
        readers may hold them. Read them; writing to them is not supported
        (use :meth:`load_state_dict`).
        """
        st = self._state
        return MappingProxyType({"amax_history": st.history, "scale": st.scales, "step_amax": st.step_amax})

    @property
    def capacity(self) -> int:
        """Slots the state's buffers hold before they must grow (see :meth:`reserve`)."""
        return self._state.capacity

    def __repr__(self) -> str:
        return (
            f"<ScalingStateManager(recipe={type(self._recipe).__name__}, backend={self._binding.label!r}, "
            f"phase={self.phase.name}, slots={len(self._state)}, step={self.iteration})>"
        )

    # --------------------------------------------------------- registration
    def register(self, name: str, roles: Iterable[Role] = tuple(Role), *, reduce: bool = True) -> ScalingHandle:
        """Register what a module casts: one slot per role, under a unique name.

        Amortized O(1): the state's buffers double their capacity when full.

        Args:
            name: unique within the manager, e.g. the module path ``"blocks.0.fc1"``.
            roles: the roles it casts (default: INPUT, WEIGHT, GRAD_OUTPUT).
            reduce: reduce its step amaxes across the manager's group (the
                default). ``False`` makes its slots rank-local: for modules
                that exist on some ranks only, such as expert-parallel experts;
                they take no part in the reduction or the ranks' slot check.

        Raises:
            SlotError: the name is taken or empty, the roles are not distinct
                Roles, or the buffers are full after the first step (see :meth:`reserve`).
        """
        if not isinstance(name, str) or not name:
            raise SlotError(f"slot name must be a non-empty string; got {name!r}")
        if name in self._handles:
            raise SlotError(
                f"a slot named {name!r} is already registered with this manager; "
                "names must be unique (use the module's path, e.g. 'blocks.0.fc1')"
            )
        if not isinstance(reduce, bool):
            raise SlotError(f"reduce must be True or False; got {reduce!r}")
        roles = tuple(roles)
        bad = [r for r in roles if not isinstance(r, Role)]
        if not roles or bad or len(set(roles)) != len(roles):
            raise SlotError(
                f"roles must be distinct ss.Role values, at least one; got {roles!r} "
                f"(allowed: {', '.join('Role.' + r.name for r in Role)})"
            )
        slots = self._state.add(name, {role: self._specs[role] for role in roles}, reduce=reduce)
        handle = self._handles[name] = ScalingHandle(self, name, slots)
        return handle

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots in all, so that later registrations never move the buffers.

        Buffers move only while they grow, and may not move after the first
        :meth:`step` (CUDA graphs and external views hold their addresses): a
        model that registers slots after training started reserves them first.
        """
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise SlotError(f"reserve() takes a number of slots >= 0; got {slots!r}")
        self._state.reserve(slots)

    def nonfinite_counts(self) -> dict[str, dict[Role, int]]:
        """Steps whose amax was NaN or infinite, per slot name and role (zeros included).

        Counted under ``on_nonfinite="skip"`` and ``"fallback"`` (a step refused
        under ``"raise"`` changes nothing, so counts nothing), kept on the
        state's device and read back here only; saved by :meth:`state_dict`.
        """
        st = self._state
        counts = st.nonfinite.tolist()
        out: dict[str, dict[Role, int]] = {name: {} for name in self._handles}
        for slot in st.slots:
            out[slot.name][slot.role] = int(counts[slot.row])
        return out

    def stats(self) -> ScalingStats:
        """Statistics of every slot: scale, amaxes, headroom, non-finite steps, risk flags.

        ``stats()[name][role]`` is a :class:`~scalestate.SlotStats`;
        ``stats().flat()`` is ``{"scalestate/<name>/<role>/<stat>": float}``
        for a logger. With ``collect_stats=True`` it also gives, per slot, the
        fractions of elements clipped at the format's max and of non-zero
        elements flushed to zero, over the casts recorded in the last
        completed :meth:`step` (recompute and evaluation casts never count;
        counts are this rank's own and are not saved in :meth:`state_dict`).
        Definitions: :mod:`scalestate.diagnostics`.

        .. warning:: Reads the state back to the host: a device sync. Call it
           between steps, as often as you log.
        """
        st = self._state
        counts = st.last_counts if st.stats else None
        return build_stats(
            self._recipe, st.iteration, self.slots, st.history, st.scales, st.fp8_max, st.nonfinite, counts,
            st.step_amax, step_overdue=st.watch.overdue,
        )

    # ----------------------------------------------------------------- casts
    def _cast(
        self, slot: Slot, x: Tensor, transpose: bool, shard: ShardCast | None = None, ahead: bool = False
    ) -> Quantized:
        """A handle's cast (see ScalingHandle.quantize and `scalestate._engine.casting`)."""
        return self._caster.cast(slot, x, transpose, shard, ahead)

    def _cast_grouped(
        self, slots: Sequence[Slot], x: Tensor, sizes: Sequence[int], transpose: bool
    ) -> list[Quantized]:
        """Grouped casts (see scalestate.nn.quantize_grouped and `scalestate._engine.casting`)."""
        return self._caster.cast_grouped(slots, x, sizes, transpose)

    def _cast_weights(
        self, slots: Sequence[Slot], weight: Tensor, experts: Sequence[int], views: Sequence[Tensor], transpose: bool
    ) -> list[Quantized]:
        """Per-expert weight casts, the uncached ones grouped (see `scalestate._engine.casting`)."""
        return self._caster.cast_weights(slots, weight, experts, views, transpose)

    def _scale_of(self, slot: Slot) -> Tensor:
        return self._state.scale_of(slot).clone()

    def _history_of(self, slot: Slot) -> Tensor:
        return self._state.history_of(slot).clone()

    def _forget_cast(self, slot: Slot) -> None:
        self._state.casts.forget(slot)

    # --------------------------------------------------------------- device
    def to(self, device: torch.device | str) -> ScalingStateManager:
        """Move the state to ``device``, every value kept (a step's pending amaxes too).

        Not inside a phase block. The backend is checked (or, for ``"auto"``,
        chosen again) for the new device. The buffers move: CUDA graphs
        captured before must be captured again.
        """
        self._state.phases.require_no_block("to()", "move the state between steps")
        self._binding.move(canonical_device(device))
        return self

    def invalidate_casts(self) -> None:
        """Drop cached weight casts.

        Needed only after a write that PyTorch's version counter does not see:
        an edit through ``.data``, or FSDP2 refilling an unsharded weight at an
        all-gather (``ss.nn.Linear`` handles that one itself; see
        :meth:`ScalingHandle.invalidate_casts`). Every other in-place change,
        optimizer steps and ``load_state_dict`` included, is detected by itself.
        """
        self._state.casts.clear()

    # ---------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The state as plain values (see :mod:`scalestate.persist` for every key)."""
        return to_state_dict(self._state, self._recipe)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`; validated before anything changes.

        Allowed between steps, and after a :meth:`step` that raised (what was
        recorded since the last step is then replaced by the loaded state).

        Raises:
            PhaseError: called in the middle of a step (casts recorded since the last step()).
            StateDictError: missing keys, another recipe, other slots, bad shapes or values.
        """
        st = self._state
        st.phases.require_no_block("load_state_dict()", "load between steps: after step() and before the next forward")
        if st.recorded_since_step and not self._refused:
            raise PhaseError(
                "load_state_dict() called in the middle of a step (casts were recorded since the "
                "last step()); load between steps: after step() and before the next forward, "
                "or call discard_step() first to drop what this step recorded"
            )
        loaded = validate(state_dict, st, self._recipe)
        st.load(
            loaded.history, loaded.scales, loaded.step_amax, loaded.iteration, loaded.tensors["nonfinite_counts"],
            loaded.tensors["sr_ordinal"],
        )
        if loaded.seed is not None:
            st.random.set_seed(loaded.seed, loaded.signs)
        self._refused = False
