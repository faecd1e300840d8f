"""`GatheredFP8Weight`: the unsharded weight FSDP2 builds from an FP8 all-gather.

The other half of :mod:`scalestate.nn.fsdp` (which makes it, in
``FP8AllGatherWeight.fsdp_post_all_gather``): FP8 data and the scale the
shards were cast with, that :func:`scalestate.nn.linear` multiplies
directly, and that every other operation sees dequantized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from scalestate.handle import ScalingHandle
from scalestate.quantized import Quantized
from scalestate.recipe import Role
from scalestate.sac import hidden_from_sac

__all__ = ["GatheredFP8Weight"]

_aten = torch.ops.aten


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
    _source: Tensor
    _handle: ScalingHandle
    _transposed: Tensor | None

    def __new__(
        cls,
        data: Tensor,
        scale: Tensor,
        scale_inv: Tensor,
        source: Tensor,
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
        source: Tensor,
        handle: ScalingHandle,
        dtype: torch.dtype,
    ) -> None:
        self._data = data
        self._handle = handle
        self._refresh(scale, scale_inv, source)

    def _refresh(self, scale: Tensor, scale_inv: Tensor, source: Tensor) -> None:
        """A new all-gather refilled the data in place: take its scales and cast source."""
        self._scale = scale
        self._scale_inv = scale_inv
        self._source = source
        self._transposed = None

    def quantized(self, *, transpose: bool = False) -> Quantized:
        """The gathered weight as a :class:`Quantized`, accounted for in the current phase.

        Casts the shard source once more through the handle: a hit in the
        manager's cast cache, which records the shard's amax if (and only if)
        this use is a training forward.
        """
        self._handle.quantize(self._source, Role.WEIGHT)
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

    def __tensor_flatten__(self) -> tuple[list[str], tuple[ScalingHandle, torch.dtype]]:
        return ["_data", "_scale", "_scale_inv", "_source"], (self._handle, self.dtype)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], ctx: tuple[ScalingHandle, torch.dtype], outer_size: Any, outer_stride: Any
    ) -> GatheredFP8Weight:
        handle, dtype = ctx
        return GatheredFP8Weight(inner["_data"], inner["_scale"], inner["_scale_inv"], inner["_source"], handle, dtype)
