"""Tensor parallelism: FP8 products of DTensor-sharded layers, one scale per logical tensor.

Design requirement: when ``torch.distributed.tensor.parallel.parallelize_module``
shards a :class:`scalestate.nn.Linear` (``ColwiseParallel``, ``RowwiseParallel``,
or sharded activations with a replicated weight, as ``SequenceParallel``
leaves them), every rank that holds a shard of one logical tensor (an input, a
weight, an output gradient) casts its shard with the *same* scale, the one
the unsharded tensor would have been cast with, and the amax it records is
that of the whole tensor. Training then follows the unsharded model: the
scaling state is bitwise the same, and only the order of the row-parallel
sum (torch's own all-reduce) differs.

How: :func:`scalestate.nn.linear` hands DTensor operands to :func:`linear`
here. It checks their placements on every mesh dimension, takes the local
shards (``DTensor.to_local``, with the gradient placements autograd must
give back), runs the FP8 products on them, and returns a DTensor with the
placements torch's own ``F.linear`` would give (``Shard(-1)`` column-parallel,
``Partial()`` row-parallel, ``Shard(d)`` for sharded activations). A cast of a
shard first max-reduces its amax over the mesh dimensions that shard it (one
all-reduce MAX of two floats, through DTensor's ``Partial("max")``) and hands
it to the manager with the shard (``handle.quantize(shard, role, amax=...,
shard_group=...)``); the manager then decides the cast's scale from that amax
exactly as for the whole tensor: the slot's scale once it has history
(delayed scaling), else just in time from the global amax. It records the
global amax, so TP ranks' scales agree whatever group the manager reduces
over, and under ``collect_stats=True`` it sums the shards' cast statistics
over the same mesh dimensions, so that :meth:`~scalestate.ScalingStateManager.stats`
counts the whole tensor's elements, as for the unsharded layer. Replicated
tensors are cast by the manager directly (nothing to reduce).

Supported placements, per mesh dimension (input, weight):

========================  ===================  ==================  =========================
input                     weight               output              e.g.
========================  ===================  ==================  =========================
``Replicate()``           ``Shard(0)``         ``Shard(-1)``       ``ColwiseParallel``
``Shard(-1)``             ``Shard(1)``         ``Partial()``       ``RowwiseParallel``
``Shard(d)``, d not last  ``Replicate()``      ``Shard(d)``        ``SequenceParallel`` inputs
``Replicate()``           ``Replicate()``      ``Replicate()``
========================  ===================  ==================  =========================

The bias is sharded like the output's last dimension, else replicated; a
row-parallel (partial-sum) output gets it from the first rank of the partial
dimension only, so that the reduced sum holds it once, exactly.
``Partial`` operands are refused: the amax of a partial sum says nothing of
the sum's, so it cannot be cast before it is reduced.

Costs: a sharded cast reads its shard once more (for the amax) and issues one
two-float all-reduce per sharding mesh dimension (under ``collect_stats=True``,
a recorded one also an all-reduce of four integers per dimension); every
DTensor weight, sharded or replicated, is cast at every call. The manager's weight-cast cache
keys on the tensor and its version counter, and a DTensor has no stable
tensor whose version follows in-place updates: ``to_local()`` returns a new
view at each call, and torch (2.13) bumps neither the DTensor's version nor
its local tensor's when a ``foreach`` or ``fused`` optimizer steps it, so a
cached cast could go stale unseen.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.distributed import nan_as_flags, nan_from_flags
from scalestate.errors import CastError
from scalestate.handle import ScalingHandle
from scalestate.nn.function import FP8LinearFunction, keep_saved_input
from scalestate.quantized import Quantized
from scalestate.recipe import Role
from scalestate.sac import hidden_from_sac

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["is_distributed", "linear"]

_DTENSOR_MODULE = "torch.distributed.tensor"

_SUPPORTED = (
    "supported (input, weight) placements per mesh dimension: (Replicate, Shard(0)) column-parallel "
    "(ColwiseParallel), (Shard(-1), Shard(1)) row-parallel (RowwiseParallel), (Shard(d), Replicate) "
    "for d not the last dimension (sharded activations, replicated weight), and (Replicate, Replicate)"
)


def is_distributed(*tensors: Tensor | None) -> bool:
    """True if any of ``tensors`` is a DTensor (cheap: no DTensor can exist before its module is imported)."""
    module = sys.modules.get(_DTENSOR_MODULE)
    if module is None:
        return False
    dtensor: type = module.DTensor
    return any(isinstance(t, dtensor) for t in tensors)


@attrs.frozen
class _Layout:
    """What the placements of (input, weight, bias) imply, per mesh dimension."""

    #: Placements of the output.
    out: tuple[Placement, ...]
    #: Placements of the gradients of the local input, weight and bias (for ``to_local``).
    x_grad: tuple[Placement, ...]
    w_grad: tuple[Placement, ...]
    b_grad: tuple[Placement, ...]
    #: Mesh dimensions over which the input, the weight and the output gradient are sharded.
    x_dims: tuple[int, ...]
    w_dims: tuple[int, ...]
    g_dims: tuple[int, ...]
    #: Mesh dimensions over which the output is a partial sum (the bias is added on their first rank only).
    partial_dims: tuple[int, ...]


def _layout(x: DTensor, weight: DTensor, bias: DTensor | None, name: str) -> _Layout:
    """Check the placements of every mesh dimension; the output's and the gradients' follow."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    last = x.dim() - 1
    mesh = weight.device_mesh
    out: list[Placement] = []
    x_grad: list[Placement] = []
    w_grad: list[Placement] = []
    b_grad: list[Placement] = []
    x_dims: list[int] = []
    w_dims: list[int] = []
    g_dims: list[int] = []
    for i, (px, pw) in enumerate(zip(x.placements, weight.placements, strict=True)):
        where = f"slot {name!r}: mesh dimension {_dim_name(mesh, i)}"
        for what, p in (("input", px), ("weight", pw)):
            if isinstance(p, Partial):
                raise CastError(
                    f"{where}: the {what} is a partial sum ({p!r}); its shards' amaxes say nothing "
                    "of the sum's, so it cannot be cast to FP8 before it is reduced. Redistribute "
                    f"it to Replicate() or Shard(...) first (e.g. input_layouts in the parallel style); {_SUPPORTED}"
                )
        xs = px.dim if isinstance(px, Shard) else None
        if isinstance(px, Replicate) and isinstance(pw, Replicate):
            out.append(Replicate())
            x_grad.append(Replicate())
            w_grad.append(Replicate())
            b_grad.append(Replicate())
        elif isinstance(px, Replicate) and pw == Shard(0):  # column-parallel
            out.append(Shard(last))
            x_grad.append(Partial())
            w_grad.append(pw)
            b_grad.append(Shard(0))
            w_dims.append(i)
            g_dims.append(i)
        elif xs == last and pw == Shard(1):  # row-parallel
            out.append(Partial())
            x_grad.append(px)
            w_grad.append(pw)
            b_grad.append(Replicate())
            x_dims.append(i)
            w_dims.append(i)
        elif xs is not None and xs != last and isinstance(pw, Replicate):  # sharded activations
            out.append(px)
            x_grad.append(px)
            w_grad.append(Partial())
            b_grad.append(Partial())
            x_dims.append(i)
            g_dims.append(i)
        else:
            raise CastError(
                f"{where}: unsupported placements: input {px!r}, weight {pw!r} (input of {x.dim()} "
                f"dimensions); {_SUPPORTED}. Redistribute the input or shard the layer with one of these styles"
            )
    if bias is not None:
        want = tuple(Shard(0) if p == Shard(last) else Replicate() for p in out)
        if tuple(bias.placements) != want:
            raise CastError(
                f"slot {name!r}: the bias has placements {tuple(bias.placements)!r}; with this input and "
                f"weight it must be {want!r} (sharded like the output's last dimension, else replicated)"
            )
    partial_dims = tuple(i for i, p in enumerate(out) if isinstance(p, Partial))
    grads = (tuple(x_grad), tuple(w_grad), tuple(b_grad))
    return _Layout(tuple(out), *grads, tuple(x_dims), tuple(w_dims), tuple(g_dims), partial_dims)


def _dim_name(mesh: DeviceMesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return f"{i} ({names[i]!r})" if names else str(i)


def _operands(
    x: Tensor, weight: Tensor, bias: Tensor | None, name: str
) -> tuple[DTensor, DTensor, DTensor | None]:
    """``(x, weight, bias)`` as DTensors, checked to be DTensors all on one mesh."""
    from torch.distributed.tensor import DTensor

    named = (("input", x), ("weight", weight), ("bias", bias))
    plain = [what for what, t in named if t is not None and not isinstance(t, DTensor)]
    if plain or not isinstance(x, DTensor) or not isinstance(weight, DTensor):
        raise CastError(
            f"slot {name!r}: the {' and '.join(plain)} is a plain tensor while the other operands are DTensors; "
            "shard the layer with torch.distributed.tensor.parallel.parallelize_module (its styles turn "
            "inputs into DTensors), or pass every operand as a DTensor on one mesh"
        )
    dbias = bias if isinstance(bias, DTensor) else None
    meshes = [t.device_mesh for t in (x, weight, dbias) if t is not None]
    if any(m != meshes[0] for m in meshes):
        raise CastError(
            f"slot {name!r}: the input, weight and bias live on different device meshes "
            f"({', '.join(map(str, meshes))}); put them on one mesh"
        )
    return x, weight, dbias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle) -> Tensor:
    """:func:`scalestate.nn.linear` for DTensor operands: FP8 products on the local shards.

    Returns a DTensor with the placements torch's ``F.linear`` gives for these
    operands (see the module's table). Every cast of a sharded operand uses
    the scale of the whole logical tensor and records its amax.

    Raises:
        CastError: an operand is not a DTensor while another is, they live on
            different meshes, or their placements are not supported (the
            message lists those that are); or the manager's recipe is
            fine-grained (rows, tiles, blocks: per-tensor recipes only).
    """
    from torch.distributed.tensor import DTensor

    recipe = handle.manager.recipe
    if recipe.granularity(Role.INPUT) is not None:
        raise CastError(
            f"slot {handle.name!r}: tensor-parallel FP8 (DTensor operands) supports per-tensor recipes; "
            f"{type(recipe).__name__} scales rows, tiles or blocks, which a sharded operand would split. "
            "Use ss.DelayedScaling or ss.CurrentScaling for tensor-parallel layers, or run this layer "
            "on plain tensors (to_local()) with the fine-grained recipe"
        )
    x, weight, dbias = _operands(x, weight, bias, handle.name)
    if x.shape[-1] != weight.shape[1]:
        raise CastError(
            f"slot {handle.name!r}: input has {x.shape[-1]} features in its last dimension, "
            f"the weight expects {weight.shape[1]}"
        )
    layout = _layout(x, weight, dbias, handle.name)
    mesh = weight.device_mesh
    x_local = x.to_local(grad_placements=layout.x_grad)
    w_local = weight.to_local(grad_placements=layout.w_grad)
    b_local = dbias.to_local(grad_placements=layout.b_grad) if dbias is not None else None
    # A partial-sum output gets the bias from one rank; the bias's gradient (the sum of the
    # replicated output gradient) is computed on every rank alike, with no reduction.
    coordinate: Sequence[int] = mesh.get_coordinate() or ()
    bias_here = all(coordinate[i] == 0 for i in layout.partial_dims)

    device_type = x_local.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    caster = _ShardCaster(handle, mesh)
    transpose = caster.backend.wants_transposed(x_local.device)
    x2 = x_local if x_local.dim() == 2 else x_local.reshape(-1, x_local.shape[-1])
    qx = caster.cast(x2, Role.INPUT, layout.x_dims, transpose)
    qw = caster.cast(w_local, Role.WEIGHT, layout.w_dims, transpose)

    def cast_grad(grad_out: Tensor, transpose: bool) -> Quantized:  # with the whole gradient's scale
        return caster.cast(grad_out, Role.GRAD_OUTPUT, layout.g_dims, transpose)

    keep_saved_input(caster.backend, qx, w_local)
    # torch types Function.apply as untyped; its result here is the forward's Tensor
    out2: Tensor = FP8LinearFunction.apply(  # type: ignore[no-untyped-call]
        x2, w_local, b_local, qx, qw, cast_grad, caster.backend, out_dtype, bias_here
    )
    out_local = out2 if x_local.dim() == 2 else out2.reshape(*x_local.shape[:-1], w_local.shape[0])
    shape = torch.Size((*x.shape[:-1], weight.shape[0]))
    out: Tensor = DTensor.from_local(
        out_local, mesh, layout.out, run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _ShardCaster:
    """Casts local shards of one layer with the scale of their whole logical tensor."""

    def __init__(self, handle: ScalingHandle, mesh: DeviceMesh) -> None:
        self.handle = handle
        self.mesh = mesh
        self.backend: Backend = handle.manager.backend

    def cast(self, x: Tensor, role: Role, dims: Sequence[int], transpose: bool) -> Quantized:
        """Cast the local shard ``x``, sharded over mesh dimensions ``dims``, for ``role``.

        Unsharded: a plain cast. Sharded: the amax of the whole tensor is
        reduced over ``dims`` and handed to the manager with the shard
        (``quantize(..., amax=..., shard_group=...)``), which casts it with the
        scale of the whole tensor, records the whole tensor's amax, and counts
        the whole tensor's elements for its statistics.
        """
        if not dims:
            return self.handle.quantize(x, role, transpose=transpose)
        with hidden_from_sac():  # like every cast's own operations (see scalestate.sac)
            amax = _global_amax(x, self.mesh, dims)
        groups = [self.mesh.get_group(i) for i in dims]
        return self.handle.quantize(x, role, transpose=transpose, amax=amax, shard_group=groups)


def _global_amax(x: Tensor, mesh: DeviceMesh, dims: Sequence[int]) -> Tensor:
    """``[amax(|x|)]`` of the whole tensor whose shards over mesh dimensions ``dims`` the ranks hold.

    One all-reduce (MAX) of two floats per mesh dimension, through DTensor's
    ``Partial("max")``. NaN survives it: an all-reduce MAX may drop a NaN
    (gloo's does, unless it is on the first rank), so NaN travels as +inf
    beside a flag and is restored, as the amax of the whole tensor would be NaN.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    with torch.no_grad():
        empty = torch.zeros((), dtype=torch.float32, device=x.device)
        local = x.detach().abs().amax().float() if x.numel() else empty
        packed = nan_as_flags(local.reshape(1))
        placements = [Partial("max") if i in dims else Replicate() for i in range(mesh.ndim)]
        reduced = DTensor.from_local(packed, mesh, placements, run_check=False).full_tensor()
        return nan_from_flags(reduced, 1)
