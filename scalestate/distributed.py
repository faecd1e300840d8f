"""Cross-rank reduction of the step amaxes: one collective per step, never a hang on a mismatch.

A manager reduces over one *group* of ranks: the ranks that hold replicas
of the same slots (data parallel, FSDP, the ranks of one tensor-parallel
tensor). At every :meth:`~scalestate.ScalingStateManager.step`, before the
scales are derived, the step amaxes of every reduced slot are max-reduced
across the group by exactly one ``all_reduce(MAX)`` over one flat float32
tensor (with a NaN flag per slot: a MAX reduction may drop a NaN, which the
non-finite policy must see on every rank); every rank then derives bitwise
identical histories and scales from identical inputs.

Rows are paired by slot name and role, not by registration order: ranks may
register in different orders (lazy modules do). The first step after the
set of slots changed (and the first step on a group) exchanges the slot
lists once (``all_gather_object``) and raises
:class:`~scalestate.errors.SlotMismatchError` on every rank if they differ,
naming the slots and the ranks that have them, so that a mismatch is an
error everywhere instead of a hang or silently mixed rows. Slots registered
with ``reduce=False`` (experts that differ per rank) take no part.

The all-reduce also carries two flags: "my slots changed since the last
agreement" and "my ``step()`` refused this step" (a local ``PhaseError``), so
that every rank issues the same collectives whatever happened on one. On
the CPU every rank reads them (free): a rank that registered slots after the
first step makes every rank agree again, raising ``SlotMismatchError``
everywhere if the others did not register them too; a refusal on one rank
becomes a ``ReductionError`` on the others. On a GPU reading them would sync
every step, so a rank reads them only when it set one: registering slots
after the first step must then happen on every rank alike, and one rank's
refusal reaches the others only as the timeout below.

A rank that dies, raises before ``step()`` or never calls it makes the
collective fail on the others within the group's timeout; the failure is
raised as :class:`~scalestate.errors.ReductionError` naming the step and the
group. (With NCCL, a failed collective may instead abort the process through
its watchdog, as NCCL does for any collective; set ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
as your job needs.)
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

from scalestate.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    ReductionError,
    ScaleStateError,
    SlotMismatchError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from scalestate._engine.state import State

__all__ = [
    "DEFAULT_GROUP",
    "GroupSpec",
    "Reduction",
    "describe_group",
    "nan_as_flags",
    "nan_from_flags",
    "resolve_group",
]


def nan_as_flags(values: Tensor) -> Tensor:
    """``[values with NaN as +inf, 1.0 where NaN else 0.0]`` (``2n`` floats, ``values`` 1-d).

    An all-reduce MAX may drop a NaN (gloo keeps one only where the first rank
    holds it); a MAX of this encoding keeps it, and :func:`nan_from_flags`
    restores it, so every rank sees the NaN a max over the whole would give.
    """
    nan = torch.isnan(values)
    return torch.cat([torch.where(nan, float("inf"), values), nan.to(values.dtype)])


def nan_from_flags(packed: Tensor, n: int) -> Tensor:
    """The ``n`` values of a (reduced) :func:`nan_as_flags` encoding, NaN restored where flagged."""
    return torch.where(packed[n : 2 * n] > 0, float("nan"), packed[:n])


class _Default(enum.Enum):
    DEFAULT_GROUP = "default"

    def __repr__(self) -> str:
        return "<the default process group, when torch.distributed is initialized>"


#: ``group=`` default: the default process group when torch.distributed is initialized, else none.
DEFAULT_GROUP = _Default.DEFAULT_GROUP

#: What ``ScalingStateManager(group=...)`` takes.
GroupSpec: TypeAlias = "ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str] | _Default | None"


def resolve_group(spec: Any) -> ProcessGroup | None:
    """The process group ``spec`` names, or ``None`` for no reduction.

    ``spec`` is a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(DeviceMesh,
    dim)`` pair (``dim`` an index or a dimension name), ``None``, or
    :data:`DEFAULT_GROUP` (resolved now: the default group if
    ``torch.distributed`` is initialized, else ``None``).
    """
    if spec is None:
        return None
    if spec is DEFAULT_GROUP:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if not dist.is_available():
        raise ArgumentValueError("group= needs torch.distributed, which this build of torch lacks; pass group=None")
    if isinstance(spec, dist.ProcessGroup):
        return spec
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(spec, DeviceMesh):
        if spec.ndim != 1:
            raise ArgumentValueError(
                f"group= takes a 1-D DeviceMesh; got one with {spec.ndim} dimensions "
                f"{spec.mesh_dim_names or ''}: pass the data-parallel dimension, e.g. mesh['dp'] or (mesh, 'dp')"
            )
        return spec.get_group()
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and isinstance(spec[0], DeviceMesh)
        and isinstance(spec[1], (int, str))
        and not isinstance(spec[1], bool)
    ):
        mesh, dim = spec
        try:
            group: ProcessGroup = mesh.get_group(dim)
            return group
        except (KeyError, ValueError, IndexError, RuntimeError) as e:
            raise ArgumentValueError(
                f"group=(mesh, {dim!r}): the mesh has dimensions {mesh.mesh_dim_names or tuple(range(mesh.ndim))}; {e}"
            ) from None
    raise ArgumentTypeError(
        "group= takes a torch.distributed ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim) pair, "
        f"or None (no reduction); got {type(spec).__name__}"
    )


def describe_group(group: ProcessGroup) -> str:
    """``group 'name' (ranks [...], backend ...)`` for messages."""
    try:
        ranks: Any = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = "?"
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        backend = "?"
    return f"group {group.group_name!r} (ranks {ranks}, backend {backend})"


class Reduction:
    """The step's reduction over one group: the slot agreement and the one all-reduce."""

    def __init__(self, spec: Any) -> None:
        if spec is not DEFAULT_GROUP:
            resolve_group(spec)  # bad arguments fail at construction
        self._spec = spec
        #: (group, number of slots) the slot lists were last agreed for.
        self._agreed: tuple[object, int] | None = None
        #: Reduced slots at the last agreement (the rows of the all-reduce).
        self._count = 0
        #: Rows of the reduced slots in (name, role) order; None: every row, in row order.
        self._rows: Tensor | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Reduction:
        """A deep copy reduces over the very same group (a process group is not copied)."""
        return Reduction(self._spec)

    def __reduce__(self) -> tuple[type[Reduction], tuple[Any]]:
        """Pickled as its group argument; an explicit group cannot leave its process."""
        if self._spec is not DEFAULT_GROUP and self._spec is not None:
            raise ArgumentTypeError(
                f"cannot pickle a manager built with group={self._spec!r}: process groups belong to "
                "the process that made them. Save manager.state_dict() instead (it holds every value), "
                "and build the manager again with its group where it is loaded"
            )
        return Reduction, (self._spec,)

    @property
    def spec(self) -> Any:
        """What the manager was given."""
        return self._spec

    def group(self) -> ProcessGroup | None:
        """The group reduced over now (``None``: no reduction)."""
        return resolve_group(self._spec)

    def reduce(self, state: State, recipe: dict[str, Any], *, refused: bool = False) -> Tensor | None:
        """Every slot's step amax, max-reduced across the group by one collective (rank-local
        slots keep their own): a new ``[N]`` tensor, or ``None`` where there is nothing to
        reduce (no group, one rank) or this rank ``refused`` the step. The state is not changed.

        The collective also carries two flags, max-reduced: "my slots changed since the
        last agreement" and "I refused this step" (its ``step()`` raised before the
        reduction), so that every rank issues the same collectives whatever happened on
        one. Reading them back is free on the CPU; on a GPU it would sync, so there a
        rank reads them only when it set one itself (see the module docstring).

        Raises:
            SlotMismatchError: (every rank) the slot sets differ, at the first step on the
                group, or (CPU) at the first step after any rank registered more slots.
            ReductionError: the collective failed, or (CPU) another rank refused the step.
        """
        group = self.group()
        if group is None or dist.get_world_size(group) == 1:
            return None
        if self._agreed is None or self._agreed[0] is not group:
            self._agree(state, recipe, group)  # the first step on this group, on every rank
        reduced, changed_anywhere = self._all_reduce(state, group, refused)
        if changed_anywhere:  # new slots somewhere: agree on them, then reduce them too
            self._agree(state, recipe, group)
            reduced, _ = self._all_reduce(state, group, refused)
        return reduced

    def _all_reduce(self, state: State, group: ProcessGroup, refused: bool) -> tuple[Tensor | None, bool]:
        """The one all-reduce: ``(reduced step amaxes or None, whether any rank's slots changed)``."""
        assert self._agreed is not None
        agreed_len, count = self._agreed[1], self._count
        step_amax = state.step_amax
        rows = self._rows
        if rows is not None and rows.device != step_amax.device:
            rows = self._rows = rows.to(step_amax.device)
        flat = step_amax[:count] if rows is None else step_amax.index_select(0, rows)
        changed = len(state) != agreed_len
        flags = flat.new_zeros(2)
        if changed:
            flags[0] = 1.0
        if refused:
            flags[1] = 1.0
        # NaN rides as +inf beside a flag, so that the non-finite policy sees it on every rank alike.
        packed = torch.cat([nan_as_flags(flat), flags])
        self._collective(lambda: dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group), state, group)
        changed_anywhere = refused_anywhere = False
        if changed or refused or step_amax.device.type == "cpu":
            changed_anywhere, refused_anywhere = (bool(v > 0) for v in packed[2 * count :].tolist())
        if refused:
            return None, False
        if refused_anywhere:
            raise ReductionError(
                f"step {state.iteration}: another rank of {describe_group(group)} refused this step "
                "(its step() raised before the reduction), so no rank's state changed. Fix the cause "
                "that rank reports, then call step() again on every rank, or discard_step() on every rank"
            )
        reduced = nan_from_flags(packed, count)
        if rows is not None:
            return step_amax.index_copy(0, rows, reduced), changed_anywhere
        return (reduced if count == len(state) else torch.cat([reduced, step_amax[count:]])), changed_anywhere

    def _agree(self, state: State, recipe: dict[str, Any], group: ProcessGroup) -> None:
        reduced = [s for s in state.slots if s.reduce]
        keyed = sorted(reduced, key=lambda s: (s.name, s.role.value))
        mine = {"slots": [[s.name, s.role.value] for s in keyed], "recipe": recipe}
        gathered: list[Any] = [None] * dist.get_world_size(group)
        self._collective(lambda: dist.all_gather_object(gathered, mine, group=group), state, group)
        ranks = dist.get_process_group_ranks(group)
        _check_agreement(gathered, ranks, dist.get_rank(), group)
        in_order = all(s.row == i for i, s in enumerate(keyed))
        self._rows = None if in_order else torch.tensor([s.row for s in keyed], device=state.device)
        self._count = len(keyed)
        self._agreed = (group, len(state))

    @staticmethod
    def _collective(run: Any, state: State, group: ProcessGroup) -> None:
        try:
            run()
        except ScaleStateError:
            raise
        except Exception as e:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...)
            raise ReductionError(
                f"step {state.iteration}: the cross-rank reduction of the step amaxes over "
                f"{describe_group(group)} failed: {str(e).strip()[:500]}. Another rank of the group "
                "died, raised before step(), or did not call step() within the group's timeout "
                "(on a GPU, a rank that registered slots after the first step while the others did "
                "not has the same effect): every rank must call manager.step() once per optimizer step"
            ) from e


def _check_agreement(gathered: list[Any], ranks: list[int], me: int, group: ProcessGroup) -> None:
    """Raise SlotMismatchError (on every rank alike) unless every rank has the same slots and recipe."""
    recipes = [entry["recipe"] for entry in gathered]
    if any(r != recipes[0] for r in recipes):
        lines = "; ".join(f"rank {rank}: {r}" for rank, r in zip(ranks, recipes, strict=True))
        raise SlotMismatchError(
            f"the ranks of {describe_group(group)} use different recipes ({lines}); every rank that "
            "reduces its scales with the others must build its manager with the same recipe"
        )
    sets = [{tuple(pair) for pair in entry["slots"]} for entry in gathered]
    if all(s == sets[0] for s in sets):
        return
    everywhere = set.intersection(*sets)
    differing = sorted(set.union(*sets) - everywhere)
    parts = []
    for name, role in differing[:20]:
        have = [rank for rank, s in zip(ranks, sets, strict=True) if (name, role) in s]
        lack = [rank for rank in ranks if rank not in have]
        parts.append(f"{name!r} {role.upper()} on ranks {have}, not on {lack}")
    more = f" (and {len(differing) - 20} more)" if len(differing) > 20 else ""
    raise SlotMismatchError(
        f"rank {me}: the ranks of {describe_group(group)} registered different slots, so their "
        f"scales cannot be reduced together: {'; '.join(parts)}{more}. Register the same modules on "
        "every rank before the first step(), or register slots that exist on some ranks only with "
        "manager.register(name, roles, reduce=False) (rank-local, not reduced). Where ranks hold "
        "different parts of the model (pipeline stages), build each part's manager with the group "
        "of the ranks that replicate it (its data-parallel group), or with group=None"
    )
