"""`GatheredFP8Weight`: the unsharded weight FSDP2 builds from an FP8 all-gather; `ShardSource`: what it was cast from.

The other half of :mod:`scalestate.nn.fsdp` (which makes both, in
``FP8AllGatherWeight.fsdp_pre_all_gather`` and ``fsdp_post_all_gather``): FP8
data and the scale the shards were cast with, that :func:`scalestate.nn.linear`
multiplies directly, and that every other operation sees dequantized; and the
shard it was cast from, through which each use of the gathered weight is
accounted for in the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from scalestate.distributed import nan_as_flags, nan_from_flags
from scalestate.handle import ScalingHandle
from scalestate.quantized import Quantized
from scalestate.recipe import Role
from scalestate.sac import hidden_from_sac

__all__ = ["GatheredFP8Weight", "ShardSource"]

_aten = torch.ops.aten


class ShardSource:
    """One rank's weight shard as an FP8 all-gather casts it: in the parameter dtype, with its shard group.

    Every cast of it goes through the handle as a shard of the whole weight
    (``quantize(..., amax=..., shard_group=...)``): the manager scales it as
    the whole weight and counts the whole weight's elements. The whole
    weight's amax is all-reduced (MAX, NaN kept) over the shard group only if
    the manager asks for it (a cast scaled just in time), once per source.
    """

    def __init__(self, tensor: Tensor, group: Any) -> None:
        #: The shard's values in the dtype the layer casts (a copy: the cast cache keys on it).
        self.tensor = tensor
        self._group = group
        self._whole: Tensor | None = None
        #: One function object for every cast of this source (the cache matches it by identity).
        self._amax = self._whole_amax
        #: (FP8 data, the padded bytes made from it) of the last all-gather input.
        self._padded: tuple[Tensor, Tensor] | None = None

    def quantize(self, handle: ScalingHandle, *, ahead_of_use: bool) -> Quantized:
        """Cast the shard for the WEIGHT slot: ahead of its use (before the all-gather), or for a use."""
        return handle.quantize(
            self.tensor, Role.WEIGHT, amax=self._amax, shard_group=self._group, ahead_of_use=ahead_of_use
        )

    def gather_input(self, q: Quantized, rows: int) -> Tensor:
        """The shard's FP8 codes as bytes, zero-padded to ``rows`` rows (FSDP pads every shard to the first's).

        A zero byte is +0 in both FP8 formats, as FSDP's zero padding of a
        high-precision shard would have been cast. Made once per cast.
        """
        if self._padded is not None and self._padded[0] is q.data:
            return self._padded[1]
        shape = (rows, *self.tensor.shape[1:])
        padded = torch.zeros(shape, dtype=torch.uint8, device=q.data.device)
        padded[: q.data.shape[0]].copy_(q.data.view(torch.uint8))
        self._padded = (q.data, padded)
        return padded

    def _whole_amax(self) -> Tensor:
        """The amax of the whole weight: this shard's, all-reduced (MAX) over the shard group, NaN kept."""
        if self._whole is None:
            t = self.tensor.float()
            local = t.abs().amax() if t.numel() else t.new_zeros(())
            packed = nan_as_flags(local.reshape(1))
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self._group)
            self._whole = nan_from_flags(packed, 1).reshape(())
        return self._whole


class GatheredFP8Weight(torch.Tensor):
    """The unsharded weight FSDP2 builds from an FP8 all-gather: FP8 data and the scale it was cast with.

    It reports the parameter's dtype and shape (autograd gives it gradients of
    that dtype); :func:`scalestate.nn.linear` multiplies its FP8 data directly.
    Any other operation sees its dequantized values. FSDP frees and refills its
    data in place at every reshard and all-gather.
    """

    _data: Tensor
    _scale: Tensor
    _scale_inv: Tensor
    _source: ShardSource
    _handle: ScalingHandle
    _transposed: Tensor | None

    def __new__(
        cls,
        data: Tensor,
        scale: Tensor,
        scale_inv: Tensor,
        source: ShardSource,
        handle: ScalingHandle,
        dtype: torch.dtype,
    ) -> GatheredFP8Weight:
        out: GatheredFP8Weight = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), dtype=dtype, device=data.device, requires_grad=False
        )
        return out

    def __init__(
        self,
        data: Tensor,
        scale: Tensor,
        scale_inv: Tensor,
        source: ShardSource,
        handle: ScalingHandle,
        dtype: torch.dtype,
    ) -> None:
        self._data = data
        self._handle = handle
        self.refresh(scale, scale_inv, source)

    def refresh(self, scale: Tensor, scale_inv: Tensor, source: ShardSource) -> None:
        """A new all-gather refilled the data in place: take its scales and cast source."""
        self._scale = scale
        self._scale_inv = scale_inv
        self._source = source
        self._transposed = None

    def quantized(self, *, transpose: bool = False) -> Quantized:
        """The gathered weight as a :class:`Quantized`, accounted for in the current phase.

        Casts the shard source once more through the handle: a hit in the
        manager's cast cache (the all-gather's cast was made ahead of this
        use), which records the amax and counts the whole weight's elements if
        (and only if) this use is a training forward.
        """
        self._source.quantize(self._handle, ahead_of_use=False)
        transposed = None
        if transpose:
            if self._transposed is None:
                with hidden_from_sac():  # made once per gather: a recompute may find it made
                    self._transposed = self._data.t().contiguous()
            transposed = self._transposed
        return Quantized(self._data, scale=self._scale, scale_inv=self._scale_inv, transposed=transposed)

    def _like(self, data: Tensor) -> GatheredFP8Weight:
        return GatheredFP8Weight(data, self._scale, self._scale_inv, self._source, self._handle, self.dtype)

    def _dequantized(self) -> Tensor:
        return (self._data.float() * self._scale_inv).to(self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]  # torch's stub has extra keyword parameters
        return f"GatheredFP8Weight(slot={self._handle.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it as a plain function, set per class
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, GatheredFP8Weight):
            if func in (_aten.detach.default, _aten.alias.default):
                return first._like(first._data)
            if func is _aten.as_strided.default:
                return first._like(first._data.as_strided(*args[1:], **kwargs))
            if func is _aten.view.default:
                return first._like(first._data.view(*args[1:], **kwargs))
        # Anything else sees the values the FP8 data stands for.
        plain_args, plain_kwargs = pytree.tree_map_only(
            GatheredFP8Weight, lambda t: t._dequantized(), (tuple(args), kwargs)
        )
        return func(*plain_args, **plain_kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[ShardSource, ScalingHandle, torch.dtype]]:
        return ["_data", "_scale", "_scale_inv"], (self._source, self._handle, self.dtype)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor],
        ctx: tuple[ShardSource, ScalingHandle, torch.dtype],
        outer_size: Any,
        outer_stride: Any,
    ) -> GatheredFP8Weight:
        source, handle, dtype = ctx
        return GatheredFP8Weight(inner["_data"], inner["_scale"], inner["_scale_inv"], source, handle, dtype)
