"""``scaled_mm``: FP8 matrix products through torch's scaled-matmul kernels.

Casts and the step update are the emulation backend's (pure torch, already
exact); only the matrix product changes.

Per-tensor products go through ``torch._scaled_mm``, except on CPU in torch
2.13+, where ``torch.nn.functional.scaled_mm`` with ``ScalingType.TensorWise``
takes them (it dequantizes both operands into row-major float32 and multiplies
them: the emulation's product of row-major operands, bit for bit, and the
casts need no transposed copies), where ``torch._scaled_mm``'s CPU kernel is
hundreds of times slower on CPUs without native FP8 arithmetic (512 ms
against 1.1 ms for one 256³ product, measured on an AVX-512 Xeon) and sums
in another order. On CUDA ``torch._scaled_mm`` needs an
sm89+ GPU (Ada, Hopper, Blackwell), a row-major first operand, a column-major
second one, inner and output dimensions divisible by 16, and at most one E5M2
operand. The layouts are made here when needed, and odd dimensions are padded
with zeros (which adds nothing to any product) and cut off again, so any shape
works; only two E5M2 operands cannot (they raise, or fall back, below). On
CPU, torch 2.13 runs both entry points without those limits.

Fine-grained products (operands with a ``tile``) go through
``torch.nn.functional.scaled_mm`` where torch has it, with these mappings
(``a`` is ``(M, K)`` scaled along ``K``; ``b`` is ``(K, N)`` scaled along ``K``):

* row-wise (``a``'s scales ``(M, 1)``, ``b``'s ``(1, N)``): ``ScalingType.RowWise``.
  On CPU in torch 2.13 the kernel runs it; the product is asked for in float32
  and the bias added afterwards, as the emulation does (bit for bit the
  emulation's product in every case measured on CPU). On CUDA the
  row-wise kernel is used for bfloat16 outputs (what torch's own op tests
  exercise on sm89+); for other output dtypes, and in a torch without
  ``torch.nn.functional.scaled_mm``, the per-tensor kernel multiplies the FP8
  data with unit scales into float32 and the row and column scales are applied
  to that result (they factor out of every sum).
* ``1 x 128`` tiles and ``128 x 128`` blocks: ``BlockWise1x128`` /
  ``BlockWise128x128`` (the pairs 1x128 x 1x128, 1x128 x 128x128, 128x128 x 1x128).
  CUDA sm90 only, built with CUDA 12.9+ (cuBLASLt block scaling). Scales are
  handed over in the layouts torch's meta checks ask for: ``1 x 128`` scales
  outer-dimension-major (``(M, K/128)`` with strides ``(1, M)``; ``b``'s as
  ``(N, K/128)`` with strides ``(1, N)``), ``128 x 128`` scales as
  ``(L4, N/128)`` with strides ``(1, L4)``, ``L4`` the number of ``K`` blocks
  rounded up to a multiple of 4. ``K`` is zero-padded to a multiple of 128,
  and a dimension cut into ``128 x 128`` blocks too, so partial tiles and
  blocks at the edges run like whole ones.
* MXFP8 (``1 x 32`` blocks, E8M0 scales): ``BlockWise1x32`` with the scales
  swizzled into cuBLAS's 32x4x4 layout (``SwizzleType.SWIZZLE_32_4_4``), on
  sm100+ GPUs. ``K`` is zero-padded to a multiple of 32.

A ``1 x c`` tile with ``c >= K`` is one scale per row and runs as row-wise.
A fine-grained product with a bias is taken in float32 and the bias added
before the one rounding to the output dtype (the emulation's order), except
in the CUDA row-wise kernel, which adds a bfloat16 bias itself.

A product no kernel here can run (block-wise or MX on CPU or on the wrong GPU,
tiles of another size than torch's, mixed granularities, two E5M2 operands
on CUDA) raises
:class:`~scalestate.errors.BackendUnavailableError` naming the granularity,
the device and what would run it, or, with ``ScaledMMBackend(fallback="emulation")``,
is computed by the emulation backend for that call. :meth:`ScaledMMBackend.supports`
answers per recipe and device without running anything.
"""

from __future__ import annotations

from scalestate.backends.scaled_mm.backend import ScaledMMBackend

__all__ = ["ScaledMMBackend"]
