"""``cuda``: fused FP8 casts and the step update in Triton kernels, for NVIDIA GPUs (sm_89+).

Registered as ``"cuda"``; ``backend="auto"`` picks it on a CUDA device of
compute capability 8.9+ when Triton imports. Needs Triton (CUDA builds of
torch bring it; else ``pip install "scalestate[cuda]"``).

What each kernel fuses, and in how many launches (whatever the tensor or slot count):

* **per-tensor cast** with a given scale: one launch and one read of ``x``:
  scale, saturate, round to nearest even into E4M3 or E5M2, write the
  row-major data and, when asked, the transposed copy, max the amax into
  the slot's accumulator when the cast is recorded, write ``scale`` and
  ``scale_inv``. Just in time (current scaling): the amax must be known
  before the first element is cast, so a zeroed scratch amax, one amax
  launch and one cast launch (two reads of ``x``). Delayed scaling, whose
  "no history yet" flag lives on the device: a zeroed scratch amax, the cast
  with the slot's scale (which also finds the amax), and a second cast that
  exits at once where the flag is false: one read of ``x`` once a slot has
  history, no host sync.
* **row-wise, 1 x 128 tiles, MX (1 x 32, E8M0 exponents from the bits)**: one
  launch per orientation; the columnwise orientation reads ``x`` again
  through the transposed view.
* **128 x 128 blocks**: one launch writes both orientations (one scale set).
* **step update**: one launch for all slots: non-finite counting and the
  policy, the history roll, the history's amax, the new scales, the cleared
  accumulators, all in the state's buffers in place.

GEMMs are torch's scaled matmuls (cuBLASLt) through
:class:`~scalestate.backends.scaled_mm.ScaledMMBackend` with
``fallback="emulation"``.

Numerics: each kernel compiles with FP8 rounding written as integer
operations on the float32 bits (the reference, bit-exact against torch's
conversion over every float32 input) or with the hardware conversion
(``cvt.rn.satfinite``, the GPU default); divisions are ``tl.math.div_rn``.
See :mod:`scalestate.backends.cuda.kernels`.

Testing without a GPU: with ``TRITON_INTERPRET=1`` set before this package is
first imported, the kernels run on CPU tensors in Triton's interpreter
(reference rounding, the emulation's products) and
``ScalingStateManager(recipe, backend="cuda")`` trains on CPU through the
very kernels a GPU runs. It is slow (milliseconds per program instance) and
for testing only.

Left to the emulation's code: empty tensors, tiles whose size is not a
power of two, and row-wise casts of rows longer than 65,536 elements.
"""

from __future__ import annotations

from scalestate.backends.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
