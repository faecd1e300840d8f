"""The products themselves: one function per kind of torch kernel call.

Each takes operands that :mod:`scalestate.backends.scaled_mm.backend` chose
a kernel for, lays them out (:mod:`~scalestate.backends.scaled_mm.layout`)
and returns the ``(M, N)`` product in ``out_dtype``, a bias added in float32
before the one rounding wherever the kernel does not fuse it (the emulation's
order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from scalestate.backends.scaled_mm.capability import has_functional_scaled_mm
from scalestate.backends.scaled_mm.kinds import Pair
from scalestate.backends.scaled_mm.layout import block_args, nvfp4_args, padded, rowwise_args, tensorwise_operands
from scalestate.quantized import Quantized

__all__ = ["blockwise", "cpu_scaled_mm", "finish", "rowwise", "tensorwise"]


def tensorwise(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None, *, cpu_functional: bool
) -> Tensor:
    """The per-tensor product: on CPU where ``cpu_functional``, ``torch.nn.functional.scaled_mm`` with
    ``ScalingType.TensorWise`` in float32 and the bias added afterwards (the emulation's product of
    row-major operands, bit for bit, in any layout, and hundreds of times faster than
    ``torch._scaled_mm``'s CPU kernel on CPUs without native FP8 arithmetic); elsewhere
    ``torch._scaled_mm``."""
    if not a.data.is_cuda and cpu_functional:  # any layout: no copies
        return finish(cpu_scaled_mm(a.data, b.data, a.scale_inv, b.scale_inv, rowwise=False), out_dtype, bias)
    n = b.data.shape[1]
    fuse_bias = bias is not None and bias.dtype == out_dtype
    a_data, b_data = tensorwise_operands(a, b, pad=a.data.is_cuda)
    if a.data.is_cuda:
        fuse_bias = fuse_bias and out_dtype != torch.float32 and b_data.shape[1] == n
    late_bias = None if fuse_bias else bias
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=a.scale_inv,
        scale_b=b.scale_inv,
        bias=bias if fuse_bias else None,
        # a bias added afterwards is added in float32, then rounded once
        out_dtype=out_dtype if late_bias is None else torch.float32,
    )
    if out.shape[1] != n:  # cut off the padded columns
        out = out[:, :n]
    if late_bias is not None:
        out = (out + late_bias.float()).to(out_dtype)
    return out


def rowwise(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None, *, cpu_functional: bool
) -> Tensor:
    """A product of row-wise scaled operands: the row-wise kernel where it takes the output dtype
    (on CPU where ``cpu_functional``), else the per-tensor kernel on the data and the scales applied
    to its float32 result."""
    m, n = a.data.shape[0], b.data.shape[1]
    sa = a.scale_inv.float().reshape(-1).view(m, 1)  # fresh strides (size-1 dims keep odd ones)
    sb = b.scale_inv.float().reshape(-1).view(1, n)
    cuda = a.data.is_cuda
    if not cuda and cpu_functional:
        return finish(cpu_scaled_mm(a.data, b.data, sa, sb, rowwise=True), out_dtype, bias)
    fuse = bias is None or bias.dtype == torch.bfloat16
    if cuda and out_dtype == torch.bfloat16 and fuse and has_functional_scaled_mm():
        args, kwargs = rowwise_args(a, b, bias)
        out = F.scaled_mm(*args, **kwargs)
        return out[:, :n] if out.shape[1] != n else out
    one = torch.ones((), dtype=torch.float32, device=a.data.device)
    to = 16 if cuda else 1  # cuBLASLt's multiples of 16
    a_data, b_data = padded(a.data, b.data, k_to=to, n_to=to)
    out = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32)
    if out.shape[1] != n:
        out = out[:, :n]
    return finish(out * sa * sb, out_dtype, bias)


def blockwise(pair: Pair, a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """A product of ``1 x 128`` / ``128 x 128`` or MX operands through ``torch.nn.functional.scaled_mm``
    on CUDA (its operands and scales laid out by :func:`~scalestate.backends.scaled_mm.layout.block_args`)."""
    m, n = a.data.shape[0], b.data.shape[1]
    args, kwargs = block_args(pair, a, b)
    kwargs["output_dtype"] = out_dtype if bias is None else torch.float32
    out = F.scaled_mm(*args, **kwargs)
    if out.shape != (m, n):
        out = out[:m, :n]
    return out if bias is None else finish(out, out_dtype, bias)


def nvfp4(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """A product of NVFP4 operands through ``torch.nn.functional.scaled_mm`` (sm100+; laid out by
    :func:`~scalestate.backends.scaled_mm.layout.nvfp4_args`)."""
    m, n = a.shape[0], b.shape[1]
    args, kwargs = nvfp4_args(a, b)
    kwargs["output_dtype"] = out_dtype if bias is None else torch.float32
    out = F.scaled_mm(*args, **kwargs)
    if out.shape != (m, n):
        out = out[:m, :n]
    return out if bias is None else finish(out, out_dtype, bias)


def cpu_scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, *, rowwise: bool) -> Tensor:
    """``torch.nn.functional.scaled_mm`` on CPU, tensor-wise or row-wise, in float32.

    Eager code calls it directly (selective checkpointing sees
    ``aten._scaled_mm_v2``). Compiled code calls it through the opaque
    ``scalestate::cpu_scaled_mm``: Inductor lowers ``aten._scaled_mm_v2`` to
    ``torch._scaled_mm``, whose CPU kernel is another (and, without native FP8
    arithmetic, hundreds of times slower) summation, so compiled products
    would not keep eager's bits.
    """
    if torch.compiler.is_compiling():
        out: Tensor = torch.ops.scalestate.cpu_scaled_mm(a, b, scale_a, scale_b, rowwise)
        return out
    return _functional(a, b, scale_a, scale_b, rowwise)


def _functional(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, rowwise: bool) -> Tensor:
    st = F.ScalingType.RowWise if rowwise else F.ScalingType.TensorWise
    return F.scaled_mm(a, b, scale_a, st, scale_b, st, output_dtype=torch.float32)


_cpu_scaled_mm_op = torch.library.custom_op("scalestate::cpu_scaled_mm", _functional, mutates_args=())


@_cpu_scaled_mm_op.register_fake
def _(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, rowwise: bool) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def finish(out: Tensor, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """A float32 product plus ``bias`` (added in float32), rounded once to ``out_dtype``: the emulation's order."""
    if bias is not None:
        out = out + bias.float()
    return out if out_dtype == torch.float32 else out.to(out_dtype)
