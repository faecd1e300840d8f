"""`ScalingHandle`: what a module holds to cast through its manager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from scalestate._engine.casting import ShardCast
from scalestate.errors import ArgumentTypeError, SlotError
from scalestate.quantized import Quantized
from scalestate.recipe import Role

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from scalestate._engine.state import Slot
    from scalestate.manager import ScalingStateManager

__all__ = ["ScalingHandle"]


class ScalingHandle:
    """The casts of one registered name: one slot per role.

    Made by :meth:`ScalingStateManager.register`; a module keeps it and casts
    through it. The handle holds no state of its own: it keeps an opaque
    reference per slot and asks its manager for everything.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> h = m.register("fc1", roles=(ss.Role.INPUT, ss.Role.WEIGHT))
        >>> q = h.quantize(torch.ones(2, 2), ss.Role.INPUT)
        >>> q.scale  # no step yet: casts are scaled just in time
        tensor(448.)
        >>> h.scale(ss.Role.INPUT)  # the slot's own scale is still the initial one
        tensor(1.)
    """

    __slots__ = ("__weakref__", "_manager", "_name", "_slots")

    def __init__(self, manager: ScalingStateManager, name: str, slots: dict[Role, Slot]) -> None:
        self._manager = manager
        self._name = name
        self._slots = slots

    @property
    def name(self) -> str:
        """The name it was registered under."""
        return self._name

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles it casts, in registration order."""
        return tuple(self._slots)

    @property
    def manager(self) -> ScalingStateManager:
        """The manager that owns its state."""
        return self._manager

    @property
    def reduce(self) -> bool:
        """Whether its step amaxes are reduced across the manager's group (``False``: rank-local)."""
        return next(iter(self._slots.values())).reduce

    def _slot(self, role: Role) -> Slot:
        try:
            return self._slots[role]
        except (KeyError, TypeError):
            have = ", ".join(r.name for r in self._slots)
            raise SlotError(
                f"slot {self._name!r} has roles ({have}); {role!r} was not registered. "
                f"Add it to manager.register({self._name!r}, roles=...)"
            ) from None

    def quantize(
        self,
        x: Tensor,
        role: Role,
        *,
        transpose: bool = False,
        amax: Tensor | Callable[[], Tensor] | None = None,
        shard_group: ProcessGroup | Sequence[ProcessGroup] | None = None,
        ahead_of_use: bool = False,
    ) -> Quantized:
        """Cast ``x`` to FP8 for ``role``; the result carries its own ``scale`` and ``scale_inv``.

        The scale is the slot's current one, or, for a slot with no history yet,
        one derived from ``x`` itself. Whether the amax of ``x`` is recorded
        depends on the phase (see :mod:`scalestate.phase`). ``WEIGHT`` casts are
        cached per (tensor version, scale epoch) and reused until either changes
        (in eager code; a compiled region casts every time, to the same bits).

        No autograd graph is built through the cast: call it from the module's
        forward (for forward roles) and from ``autograd.Function.backward``
        (for ``GRAD_OUTPUT``), and route gradients with an autograd Function.

        Args:
            x: the tensor to cast (any float dtype and shape).
            role: one of the roles this handle was registered with.
            transpose: also make ``Quantized.transposed`` (2-d ``x`` only), in
                the same pass, for products that need the other layout (see
                ``manager.backend.wants_transposed(device)``). Under a
                fine-grained recipe it is ``x.t()`` cast along its own rows
                (scales ``t_scale``), which the products contracting over the
                other axis need.
            amax: ``x`` is this rank's shard of a larger tensor (tensor or
                fully sharded parallelism), and this is the amax of the whole
                tensor: one value (a 0-d float32 tensor on the manager's
                device), already max-reduced over every rank that holds a
                shard, NaN kept (an all-reduce MAX may drop a NaN; see
                :func:`scalestate.distributed.nan_as_flags`). The cast is then
                scaled and recorded as a cast of the whole tensor would be: with
                the slot's scale once it has history, else with one derived just
                in time from ``amax``; a recorded cast records ``amax``. Every
                rank thus casts its shard with the same scale. Or a function
                returning it, which the manager calls only when it scales the
                cast just in time (deciding so reads the slot's newest history
                entry on the host while the slot has none: a device sync on
                GPUs); when it does not call it, a recorded cast records the
                shard's own amax, which the step's all-reduce makes the whole
                tensor's only if the manager's group covers every rank holding
                a shard (so pass a function only then). Per-tensor recipes only.
            shard_group: with ``amax``, the process group whose ranks hold the
                shards of the whole tensor, or a sequence of groups that
                together span them (one per sharded mesh dimension). Under
                ``collect_stats=True`` a recorded shard cast's statistics are
                summed over them (one all-reduce of four integers per group, per
                recorded cast; per cast and scale epoch for cached weight
                casts), so that :meth:`ScalingStateManager.stats` counts the
                whole tensor's elements exactly as an unsharded run does.
                Without it they count this rank's shard only.
            ahead_of_use: the cast is made ahead of its use (as an FP8
                all-gather casts a weight shard before FSDP gathers it): it
                records and counts nothing, whatever the phase. A ``WEIGHT``
                cast is cached with its amax kept aside, so that the use, which
                casts the same tensor again (a cache hit), is classified and
                recorded as usual.

        Raises:
            CastError: ``x`` is not a floating-point tensor, ``transpose`` with
                a tensor that is not 2-d, ``amax`` with a fine-grained recipe,
                or an ``amax`` that is not one floating-point value on the
                manager's device.
            ArgumentTypeError: ``amax`` is neither a tensor nor a function, or
                ``ahead_of_use`` is not a bool.
            ArgumentValueError: ``shard_group`` without ``amax``.
            SlotError: ``role`` was not registered with this handle.
        """
        slot = self._slot(role)
        if not isinstance(ahead_of_use, bool):
            raise ArgumentTypeError(f"slot {self._name!r}: ahead_of_use must be True or False; got {ahead_of_use!r}")
        shard = None
        if amax is not None or shard_group is not None:
            shard = ShardCast.of(f"slot {self._name!r} {role.name}", amax, shard_group)
        return self._manager._cast(slot, x, transpose, shard, ahead_of_use)

    def scale(self, role: Role) -> Tensor:
        """A copy of the slot's current scale (0-d float32).

        Under a fine-grained recipe, casts scale each row, tile or block from
        its own amax; this is the per-tensor scale the last step's amax
        implies, kept for inspection only.
        """
        return self._manager._scale_of(self._slot(role))

    def amax_history(self, role: Role) -> Tensor:
        """A copy of the slot's amax history (``[history_len]`` float32, newest last)."""
        return self._manager._history_of(self._slot(role))

    def invalidate_casts(self) -> None:
        """Drop this handle's cached ``WEIGHT`` cast, so that the next one casts afresh.

        For modules of your own that call :func:`scalestate.nn.linear` under
        FSDP2 (``fully_shard``): FSDP refills the unsharded weight in place at
        every all-gather and preserves its version counter, so a cast cached
        before an in-place edit of the sharded weight (an EMA swap, a model
        ``load_state_dict`` without a manager step) could be reused. Call it when
        FSDP swaps the weight in (``ss.nn.Linear`` does so from its
        ``__setattr__``, which FSDP calls), or in a forward pre-hook.
        """
        self._manager._forget_cast(self._slot(Role.WEIGHT))

    def __repr__(self) -> str:
        roles = ", ".join(r.name for r in self._slots)
        return f"<ScalingHandle({self._name!r}, roles=({roles}))>"
