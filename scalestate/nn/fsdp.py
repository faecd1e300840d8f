"""FP8 all-gather under FSDP2: the sharded weight is cast to FP8 *before* FSDP gathers it.

Design requirement: under ``torch.distributed.fsdp.fully_shard`` each rank
holds a shard of every weight and all-gathers the full weight before each
forward (and again before backward). Gathering the weight already cast to
FP8 halves the all-gather bytes against bf16, with no extra collective and
with the manager's semantics unchanged:

* **One scale for the whole weight.** Every rank casts its shard with the
  WEIGHT slot's delayed scale, which :meth:`ScalingStateManager.step` makes
  identical on every rank of the reduction group (invariant 10).
* **The shard amaxes ride in the step's one all-reduce.** The cast of a shard
  records the shard's amax into the WEIGHT slot's accumulator; the step's
  all-reduce MAX over the group turns it into the whole weight's amax, the
  value an unsharded cast would have recorded.
* **Just in time, before the first step.** A slot with no history yet is
  scaled from the tensor it casts; a shard alone would give each rank its own
  scale. While the WEIGHT slot has no history (delayed scaling before its
  first ``step()``; every step under :class:`~scalestate.CurrentScaling`),
  the shards' amaxes are all-reduced (MAX) over FSDP's shard group, one small
  all-reduce per weight, once per weight version, and the shard is cast as if
  it held that amax: the scale is exactly the one a cast of the whole weight
  derives. From the first step on, no collective is added.
* **Cached and classified like any weight cast.** The cast goes through
  :meth:`ScalingHandle.quantize`, so it is made once per (weight version,
  scale epoch): FSDP's re-gather before backward reuses it, bit for bit,
  records nothing (it runs inside autograd's backward, like a recompute),
  and an evaluation pass records nothing. FSDP runs the cast under
  ``no_grad``; the layer's own forward then uses the cached cast once more,
  in the caller's grad mode and phase, which is what decides whether the
  amax counts for the step (invariant 5: a cache hit records exactly what a
  fresh cast would have).
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

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from scalestate.errors import ArgumentValueError, CastError
from scalestate.handle import ScalingHandle
from scalestate.nn.fsdp_gathered import GatheredFP8Weight
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["FP8AllGatherWeight", "GatheredFP8Weight", "plain_state_dict", "quantize_weight", "wrap_weight"]

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
    :attr:`handle`. Its ``state_dict`` entries are the plain tensors it wraps.

    .. warning:: Under delayed scaling, until the WEIGHT slot has history,
       each new shard cast reads the slot's newest history entry on the host:
       a device sync on GPUs, in the first step only (and after a
       ``load_state_dict``). Under ``on_nonfinite="fallback"``, where a step
       may zero the history, it is read once per step.
    """

    _tensor: Tensor
    #: The tensor whose version counts every write to the weight: ``_tensor`` itself, or, for
    #: a view of another wrapper, that wrapper's root (a write through any view bumps it).
    _root: Tensor
    _handle: ScalingHandle
    #: (key, source) of the last shard cast source (see _source).
    _source_memo: tuple[tuple[Any, ...], Tensor] | None
    #: manager.iteration at which the WEIGHT slot was last known to have history.
    _history_known_at: int | None
    #: (manager.iteration, source, cast) of the last shard cast (to see the cast cache miss).
    _last_cast: tuple[int, Tensor, Quantized] | None

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
        self._history_known_at = None
        self._last_cast = None

    @property
    def handle(self) -> ScalingHandle:
        """The handle whose WEIGHT slot scales the FP8 all-gather."""
        return self._handle

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
        source = self._source(mesh, dtype, padded_rows)
        q = self._handle.quantize(source, Role.WEIGHT)
        iteration = self._handle.manager.iteration
        last = self._last_cast
        if last is not None and last[0] == iteration and last[1] is source and last[2] is not q:
            # The cast cache missed with no step in between: the scale epoch changed
            # (load_state_dict, discard_step, invalidate_casts, to()), and a load may have
            # replaced the histories. Read the slot's history again; if that changes whether
            # the slot is scaled just in time, the source (and the cast) must change too.
            self._history_known_at = None
            renewed = self._source(mesh, dtype, padded_rows)
            if renewed is not source:
                source = renewed
                q = self._handle.quantize(source, Role.WEIGHT)
        self._last_cast = (iteration, source, q)
        data = q.data[:-1].view(padded_rows, *outer_size[1:])
        # Gathered as bytes: every process-group backend takes uint8 (not all take float8).
        return (data.view(torch.uint8),), (q.data.dtype, q.scale, q.scale_inv, source)

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
            out._refresh(scale, scale_inv, source)
            return None
        data = gathered.view(fp8_dtype)
        return GatheredFP8Weight(data, scale, scale_inv, source, self._handle, param_dtype), (gathered,)

    # --------------------------------------------------------------- helpers
    def _source(self, mesh: Any, dtype: torch.dtype, padded_rows: int) -> Tensor:
        """The flat tensor the shard is cast from: the shard in ``dtype``, zero-padded, plus one element.

        The extra last element is 0, or, while the slot is scaled just in time,
        the amax of the whole weight (all-reduced over the shard group), so that
        the cast derives the scale a cast of the whole weight would. Kept while the
        shard is unchanged, so that the manager's cast cache recognises it.
        """
        local = self._tensor
        jit = self._scaled_just_in_time()
        key = (self._root._version, local._version, local.data_ptr(), dtype, padded_rows, jit)
        memo = self._source_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        cols = math.prod(local.shape[1:])
        source = torch.zeros(padded_rows * cols + 1, dtype=dtype, device=local.device)
        source[: local.numel()].copy_(local.reshape(-1))
        if jit:
            amax = torch.linalg.vector_norm(source[:-1].float(), float("inf"))
            # NaN as +inf, so that every rank reduces to the same non-finite value
            # (which leaves every rank's scale at its previous value, as the step does).
            amax = torch.nan_to_num(amax, nan=float("inf"))
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            source[-1] = amax
        self._source_memo = (key, source)
        return source

    def _scaled_just_in_time(self) -> bool:
        """Whether the WEIGHT slot's next cast scales from the tensor (no history yet).

        The same answer on every rank: histories are reduced. Reads the slot's
        newest history entry on the host (a device sync on GPUs) until it is
        non-zero, then trusts it while the slot cannot have lost its history:
        within an iteration, and across one step unless the manager's policy
        is ``on_nonfinite="fallback"`` (whose non-finite steps zero histories).
        It reads again after any other change of ``manager.iteration`` (a
        ``load_state_dict``) and after a load at the same iteration
        (:meth:`fsdp_pre_all_gather` sees the cast cache miss).
        """
        manager = self._handle.manager
        if not manager.recipe.delayed:
            return True
        iteration = manager.iteration
        known = self._history_known_at
        if known is not None and (
            iteration == known or (iteration == known + 1 and manager.on_nonfinite != "fallback")
        ):
            self._history_known_at = iteration
            return False
        if float(self._handle.amax_history(Role.WEIGHT)[-1]) > 0:
            self._history_known_at = iteration
            return False
        self._history_known_at = None
        return True


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


def quantize_weight(handle: ScalingHandle, weight: Tensor, *, transpose: bool = False) -> Quantized:
    """The FP8 weight of a product: the FP8 all-gather's output if FSDP made one, else a cast.

    In every case the WEIGHT slot is accounted for exactly as by
    ``handle.quantize(weight, Role.WEIGHT)``.
    """
    if isinstance(weight, GatheredFP8Weight):
        return weight.quantized(transpose=transpose)
    if isinstance(weight, FP8AllGatherWeight):  # not sharded: cast the values it wraps
        weight = weight._tensor
    return handle.quantize(weight, Role.WEIGHT, transpose=transpose)


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
