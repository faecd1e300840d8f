"""`ScalingHandle`: what a module holds to cast through its manager."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from scalestate.errors import SlotError
from scalestate.quantized import Quantized
from scalestate.recipe import Role

if TYPE_CHECKING:
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

    __slots__ = ("_manager", "_name", "_slots")

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

    def _slot(self, role: Role) -> Slot:
        try:
            return self._slots[role]
        except (KeyError, TypeError):
            have = ", ".join(r.name for r in self._slots)
            raise SlotError(
                f"slot {self._name!r} has roles ({have}); {role!r} was not registered. "
                f"Add it to manager.register({self._name!r}, roles=...)"
            ) from None

    def quantize(self, x: Tensor, role: Role, *, transpose: bool = False) -> Quantized:
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
        """
        return self._manager._cast(self._slot(role), x, transpose)

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
