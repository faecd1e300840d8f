"""FP8 all-gather under FSDP2: the sharded weight is cast to FP8 *before* FSDP gathers it.

Design requirement: under ``torch.distributed.fsdp.fully_shard`` each rank
holds a shard of every weight and all-gathers the full weight before each
forward (and again before backward). Gathering the weight already cast to
FP8 halves the all-gather bytes against bf16, with no extra collective and
with the manager's semantics unchanged:

* **One scale for the whole weight.** Every rank casts its shard through the
  handle as a shard of the whole weight (``handle.quantize(shard, Role.WEIGHT,
  amax=..., shard_group=...)``); the manager alone decides its scale: the
  WEIGHT slot's, which :meth:`ScalingStateManager.step` makes identical on
  every rank of the reduction group (invariant 10), or, while the slot has no
  history (delayed scaling before its first ``step()``, after a load or a
  ``"fallback"`` step that took it away; every step under
  :class:`~scalestate.CurrentScaling`), one derived just in time from the
  whole weight's amax, the scale a cast of the whole weight derives.
* **No collective added once the slot has history.** The whole weight's amax
  is handed over as a function: the manager calls it only for a just-in-time
  scale, and it then all-reduces (MAX, NaN kept) the shards' amaxes over FSDP's
  shard group, one small all-reduce per weight version. Otherwise each cast
  records its shard's own amax, and the step's one all-reduce MAX over the
  group turns it into the whole weight's, the value an unsharded cast would
  have recorded.
* **Cached and classified like any weight cast, counted once per use.** The
  cast before the all-gather is made ahead of its use
  (``ahead_of_use=True``): it records and counts nothing, and the manager's
  cast cache keeps it, once per (weight version, scale epoch): FSDP's
  re-gather before backward reuses it, bit for bit. The layer's own forward
  then casts the same shard once more (a cache hit), in the caller's grad mode
  and phase, which is what decides whether the amax counts for the step
  (invariant 5: a cache hit records exactly what a fresh cast would have); an
  evaluation pass and a recompute record nothing. Under
  ``collect_stats=True`` the shards' cast statistics are summed over the
  shard group (one all-reduce of four integers per weight version), so
  :meth:`ScalingStateManager.stats` counts the whole weight once per use, as
  an unsharded run does; FSDP's padding is added as FP8 zero bytes after the
  cast and counts nothing.
* **Same numbers as the bf16 all-gather.** Under a ``MixedPrecisionPolicy``
  the shard is first rounded to ``param_dtype``, exactly the values the layer
  would have cast after a high-precision all-gather; so training with and
  without ``fp8_all_gather`` is bitwise the same, and only the bytes on the
  wire change.

Two tensor subclasses implement FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, see torch's
``_fsdp_param.py``): :class:`FP8AllGatherWeight`, the high-precision weight
parameter (it behaves as a plain tensor everywhere else, and FSDP shards it
as one), and :class:`GatheredFP8Weight`, the unsharded parameter FSDP
builds from the FP8 all-gather output, which :func:`scalestate.nn.linear`
multiplies directly. Both are made by ``ss.nn.Linear(..., fp8_all_gather=True)``
and ``ss.nn.convert(..., fp8_all_gather=True)``; eager mode only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from scalestate.errors import ArgumentValueError, CastError
from scalestate.handle import ScalingHandle
from scalestate.nn.fsdp_gathered import GatheredFP8Weight, ShardSource

__all__ = ["FP8AllGatherWeight", "GatheredFP8Weight", "plain_state_dict", "wrap_weight"]

_aten = torch.ops.aten

#: Ops after which the result is still the (sharded) FP8-all-gather weight: the
#: ones FSDP uses to shard, pad and move it, and ``to_empty``'s ``empty_like``.
#: Every view op and ``copy_`` keep it too, over the same root (see ``__torch_dispatch__``).
_KEEP_SUBCLASS = frozenset(
    {
        _aten.empty_like.default,
        _aten.new_zeros.default,
        _aten.new_empty.default,
        _aten._to_copy.default,
        _aten._pin_memory.default,
        _aten.clone.default,
    }
)


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8, cast with its slot's scale.

    Outside FSDP it is the plain tensor it wraps: every operation runs on the
    wrapped values (and in-place ones change them), so optimizers,
    ``load_state_dict``, ``to_empty`` and initializers work unchanged. Under
    ``fully_shard`` FSDP keeps a shard of it per rank and calls
    :meth:`fsdp_pre_all_gather` / :meth:`fsdp_post_all_gather` around each
    all-gather (see the module docstring for the scaling rules).

    Made by ``ss.nn.Linear(..., fp8_all_gather=True)``; read-only attributes:
    :attr:`handle`, :attr:`wrapped`. Its ``state_dict`` entries are the plain
    tensors it wraps.

    .. warning:: Under delayed scaling, until the WEIGHT slot has history,
       the manager decides whether a new shard cast is scaled just in time by
       reading the slot's newest history entry on the host: a device sync on
       GPUs, in the first step only (and after a ``load_state_dict``). Under
       ``on_nonfinite="fallback"``, where a step may zero the history, it is
       read once per step.
    """

    _tensor: Tensor
    #: The tensor whose version counts every write to the weight: ``_tensor`` itself, or, for
    #: a view of another wrapper, that wrapper's root (a write through any view bumps it).
    _root: Tensor
    _handle: ScalingHandle
    #: (key, source) of the last shard cast source (see _source).
    _source_memo: tuple[tuple[Any, ...], ShardSource] | None

    def __new__(cls, tensor: Tensor, handle: ScalingHandle, root: Tensor | None = None) -> FP8AllGatherWeight:
        out: FP8AllGatherWeight = torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )
        return out

    def __init__(self, tensor: Tensor, handle: ScalingHandle, root: Tensor | None = None) -> None:
        self._tensor = tensor
        self._root = tensor if root is None else root
        self._handle = handle
        self._source_memo = None

    @property
    def handle(self) -> ScalingHandle:
        """The handle whose WEIGHT slot scales the FP8 all-gather."""
        return self._handle

    @property
    def wrapped(self) -> Tensor:
        """The plain tensor it wraps (its values, shared)."""
        return self._tensor

    def __repr__(self) -> str:  # type: ignore[override]  # torch's stub has extra keyword parameters
        return f"FP8AllGatherWeight(slot={self._handle.name!r}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it as a plain function, set per class
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handles = [a._handle for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FP8AllGatherWeight)]
        base = args[0] if args and isinstance(args[0], FP8AllGatherWeight) else None
        if func is _aten.detach.default:
            return FP8AllGatherWeight(args[0]._tensor, handles[0], args[0]._root)
        plain_args, plain_kwargs = pytree.tree_map_only(
            FP8AllGatherWeight, lambda t: t._tensor, (tuple(args), kwargs or {})
        )
        out = func(*plain_args, **plain_kwargs)
        _count_writes(func, args, kwargs or {})
        if func.is_view or func is _aten.copy_.default:
            # A view (w[0], w.t(), w[:, :k], w.view(-1), ...) is a wrapper over the same root: the
            # op on the wrapped tensor ran below autograd, where its result shares no version
            # counter with it, so a write through the view must come back here to bump the root's.
            root = base._root if base is not None else None
            return pytree.tree_map_only(Tensor, lambda t: FP8AllGatherWeight(t, handles[0], root), out)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(Tensor, lambda t: FP8AllGatherWeight(t, handles[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], ScalingHandle]:
        return ["_tensor"], self._handle

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], handle: ScalingHandle, outer_size: Any, outer_stride: Any
    ) -> FP8AllGatherWeight:
        return FP8AllGatherWeight(inner["_tensor"], handle)

    # ------------------------------------------------------------ FSDP2 hooks
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: torch.nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[Tensor, ...], tuple[Any, ...]]:
        """This rank's all-gather input: its shard cast to FP8 (as bytes), and the cast's scales.

        Called by FSDP2 (under ``no_grad``) before each all-gather of the weight.
        """
        local = self._tensor
        world = mesh.size()
        _require_reduction(self._handle, mesh)
        if local.dim() != len(outer_size) or tuple(local.shape[1:]) != tuple(outer_size[1:]):
            raise CastError(
                f"slot {self._handle.name!r}: FP8 all-gather supports FSDP's default sharding on dim 0; "
                f"got a shard of shape {tuple(local.shape)} of a weight of shape {tuple(outer_size)}. "
                "Drop shard_placement_fn for this module, or use fp8_all_gather=False"
            )
        padded_rows = -(-outer_size[0] // world)  # FSDP pads every shard to the first one's rows
        dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else local.dtype
        source = self._source(mesh, dtype)
        q = source.quantize(self._handle, ahead_of_use=True)
        # Gathered as bytes: every process-group backend takes uint8 (not all take float8).
        return (source.gather_input(q, padded_rows),), (q.data.dtype, q.scale, q.scale_inv, source)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: tuple[Any, ...],
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[GatheredFP8Weight, tuple[Tensor, ...]] | None:
        """The unsharded weight, from the gathered FP8 bytes (in place into ``out`` after the first gather)."""
        (gathered,) = all_gather_outputs
        fp8_dtype, scale, scale_inv, source = metadata
        if out is not None:
            if not isinstance(out, GatheredFP8Weight):
                raise CastError(
                    f"slot {self._handle.name!r}: FSDP handed back an unsharded weight of type "
                    f"{type(out).__name__}; expected the GatheredFP8Weight made by the first all-gather"
                )
            out.refresh(scale, scale_inv, source)
            return None
        data = gathered.view(fp8_dtype)
        return GatheredFP8Weight(data, scale, scale_inv, source, self._handle, param_dtype), (gathered,)

    # --------------------------------------------------------------- helpers
    def _source(self, mesh: Any, dtype: torch.dtype) -> ShardSource:
        """What the shard is cast from: its values in ``dtype`` (a copy), and FSDP's shard group.

        Kept while the shard is unchanged, so that the manager's cast cache
        recognises it (and its whole-weight amax is reduced once).
        """
        local = self._tensor
        key = (self._root._version, local._version, local.data_ptr(), dtype)
        memo = self._source_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        source = ShardSource(local.detach().to(dtype, copy=True), mesh.get_group())
        self._source_memo = (key, source)
        return source


def _require_reduction(handle: ScalingHandle, mesh: Any) -> None:
    """Raise unless the manager's step reduces over every rank of FSDP's shard group.

    Shards cast with different scales cannot be gathered into one FP8 tensor;
    only the step's reduction makes the ranks' scales identical.
    """
    manager = handle.manager
    shard_ranks = dist.get_process_group_ranks(mesh.get_group())
    group = manager.group
    reduced = set(dist.get_process_group_ranks(group)) if group is not None else set()
    missing = sorted(set(shard_ranks) - reduced)
    if missing:
        raise ArgumentValueError(
            f"slot {handle.name!r}: fp8_all_gather gathers shards from ranks {shard_ranks}, which must all "
            f"cast with one scale, but the manager's step reduces over "
            f"{'no group (group=None)' if group is None else sorted(reduced)}: ranks {missing} are left out. "
            "Give the manager a group that includes FSDP's shard group (the default, the world group, "
            "does), or use fp8_all_gather=False"
        )


def _count_writes(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Bump the version counter of every wrapped tensor ``func`` wrote to.

    An op on a wrapper runs on the wrapped tensor below autograd, where torch
    bumps no version counter; the weight-cast cache (and the shard cast
    source) relies on the wrapped tensor's version to see optimizer steps.
    A write through a view bumps its root's counter as well.
    """
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, FP8AllGatherWeight):
                for written in (t._tensor, t._root) if t._root is not t._tensor else (t._tensor,):
                    if not written.is_inference():
                        torch.autograd.graph.increment_version(written)


def wrap_weight(weight: Tensor, handle: ScalingHandle) -> torch.nn.Parameter:
    """A new parameter holding ``weight``'s values (shared, not copied) that FSDP2 all-gathers in FP8."""
    requires_grad = weight.requires_grad
    if isinstance(weight, FP8AllGatherWeight):
        if isinstance(weight, torch.nn.Parameter) and weight.handle is handle:
            return weight
        weight = weight._tensor
    return torch.nn.Parameter(FP8AllGatherWeight(weight.detach(), handle), requires_grad=requires_grad)




def plain_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A ``state_dict`` post-hook: FP8-all-gather weights are saved as the plain tensors they wrap.

    Checkpoints then hold ordinary tensors (``torch.save`` / ``torch.load(weights_only=True)``
    and distributed checkpoints read them), sharing storage with the weight so that
    an in-place load into the state dict loads the model. Under FSDP2 the sharded
    DTensor keeps its placements, over the plain local shard.
    """
    for key, value in state_dict.items():
        if not key.startswith(prefix) or "." in key[len(prefix) :]:
            continue  # a submodule's entry
        if isinstance(value, FP8AllGatherWeight):
            state_dict[key] = value._tensor
            continue
        local = getattr(value, "_local_tensor", None)
        if isinstance(local, FP8AllGatherWeight):
            from torch.distributed.tensor import DTensor

            mesh, placements = value.device_mesh, value.placements
            state_dict[key] = DTensor.from_local(
                local._tensor, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
            )
