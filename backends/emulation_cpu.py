"""The emulation backend's eager CPU work: FP8 codes through tables, and buffers reused from call to call.

Each function here computes exactly what the plain torch expression it
stands in for computes (a table holds torch's own conversion of every code;
a product written into a buffer is the same product), only faster on CPU:

* :func:`gather` converts FP8 codes to float32 by table lookup: torch's CPU
  conversion of E4M3 is several times slower than a lookup, and a per-tensor
  scale multiplies the table's entries instead of every element. Where
  large operands' bytes pair up, one lookup converts two codes.
* :class:`Scratch` holds float32 and index buffers that a backend writes its
  transient operands into (a cast's scaled copy, a product's dequantized
  operand), one set per thread. A training step then asks the allocator for
  no more large blocks than the float32 layer does (plus the FP8 data): each
  fresh large block costs page faults, and glibc hands the top of its heap
  back to the system once enough of it is free, so that the next step
  faults its pages in again.

Buffers are reused only where nothing but the caller can hold the tensor
written into them (:func:`quiet`): eager code, no dispatch mode on the stack
(selective checkpointing, an operation counter, fake tensors), no tensor that
needs a gradient, and plain tensors on CPU.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch import Tensor

from scalestate.math import abs_max_of_ends
from scalestate.sac import hidden_from_sac

__all__ = [
    "CLAMP_CHECK_MIN_NUMEL",
    "PAIRED_MIN_NUMEL",
    "SCRATCH_MIN_NUMEL",
    "TABLE_MIN_NUMEL",
    "CodeTables",
    "Scratch",
    "as_float32",
    "dequantize_into",
    "gather",
    "host_abs_max",
    "quiet",
    "readable",
    "reusable",
    "saturate",
]

#: Below this many elements, a table lookup costs more than it saves.
TABLE_MIN_NUMEL = 4096
#: From this many elements on, a transient float32 tensor is written into a reused buffer (where
#: :func:`quiet` holds): a fresh block of 1 MiB or more costs page faults (0.99 ms against 0.29 ms for a
#: 262,144-element conversion on a 2-core CPU); smaller ones cost more in operations than they save.
SCRATCH_MIN_NUMEL = 1 << 18
#: From this many codes on, an even count at an even offset is converted two codes at a time, through the
#: table of 65,536 pairs (512 KiB, scaled for each conversion). Measured inside the demo's training, on a
#: 2-core CPU, where the table competes for the cache with the step's tensors: 65,536 codes took 90 us
#: through the table of single codes against 100 us in pairs, 131,072 took 120 against 147, 262,144 took
#: 280 against 255, and 524,288 took 456 against 352-377.
PAIRED_MIN_NUMEL = 1 << 18
#: From this many elements on, a cast whose amax is known checks whether its clamp can change anything
#: (two operations on one value and a read on the host) before it runs it (one pass over the elements).
CLAMP_CHECK_MIN_NUMEL = 1 << 14
#: Whether memory holds the low byte of a 16-bit value first (the layout of the paired table).
_LITTLE_ENDIAN = sys.byteorder == "little"


def readable(*tensors: Tensor) -> bool:
    """Whether ``tensors``' values may be read on the host, for free: eager code with no dispatch mode on
    the stack (fake tensors hold no values), and plain tensors on CPU (reading one on an accelerator
    waits for it)."""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and all(type(t) is Tensor and t.device.type == "cpu" for t in tensors)
    )


def quiet(*tensors: Tensor) -> bool:
    """Whether work on ``tensors`` may write into reused buffers unseen.

    True in eager code (not compiling, not in inference mode) with no
    dispatch mode on the stack, for plain CPU tensors none of which needs a
    gradient: no mode can keep an intermediate result, and autograd saves
    none, so that only the caller ever holds a tensor written into a buffer.
    """
    return (
        readable(*tensors)
        and not torch.is_inference_mode_enabled()
        and not any(t.requires_grad for t in tensors)
    )


def reusable(x: Tensor, *others: Tensor) -> bool:
    """Whether work on ``x`` (with ``others``) writes into reused buffers: ``x`` has at least
    :data:`SCRATCH_MIN_NUMEL` elements and :func:`quiet` holds."""
    return x.numel() >= SCRATCH_MIN_NUMEL and quiet(x, *others)


class CodeTables:
    """Every code of an FP8 dtype as float32, made with torch's own conversion (a lookup gives its bits)."""

    def __init__(self) -> None:
        self._made: dict[tuple[torch.dtype, torch.device, bool], Tensor] = {}

    def __call__(self, dtype: torch.dtype, device: torch.device, paired: bool) -> Tensor:
        """The 256 codes' values, or with ``paired`` the 65,536 pairs', each pair's two float32 values read
        as one float64 (pair ``lo + 256 * hi`` holds ``value(lo)`` then ``value(hi)``, the order memory holds
        two codes in). Made once per dtype and device, out of sight of selective checkpointing (a recompute
        would not make it again)."""
        key = (dtype, device, paired)
        table = self._made.get(key)
        if table is None:
            with hidden_from_sac():
                table = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()
                if paired:
                    pairs = torch.arange(65536, dtype=torch.int32, device=device)
                    table = torch.stack((table[pairs & 255], table[pairs >> 8]), dim=1).view(torch.float64).view(-1)
            self._made[key] = table
        return table


class Scratch:
    """Buffers reused from call to call: one per name, dtype and device, in each thread.

    A buffer grows to the largest request it has served and stays allocated
    while its owner lives. Its contents hold until the next request for the
    same name on the same thread; a caller must be done with them by then.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The first ``numel`` elements of this thread's buffer ``name`` (contiguous, 1-d, uninitialized)."""
        buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = self._local.__dict__.setdefault("buffers", {})
        key = (name, dtype, device)
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffers.pop(key, None)  # freed before the larger one is allocated
            buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer if buffer.numel() == numel else buffer[:numel]

    def nbytes(self) -> int:
        """The bytes of this thread's buffers."""
        buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = self._local.__dict__.get("buffers", {})
        return sum(b.numel() * b.element_size() for b in buffers.values())

    def holders(self) -> dict[str, weakref.ref[Tensor]]:
        """This thread's record of which tensor each buffer's contents were made for (the caller's to keep)."""
        holders: dict[str, weakref.ref[Tensor]] = self._local.__dict__.setdefault("holders", {})
        return holders


def gather(
    tables: CodeTables,
    data: Tensor,
    scale_inv: Tensor | None,
    into: tuple[Scratch, str] | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """FP8 ``data`` as float32 (times a 0-d float32 ``scale_inv`` if given): ``data.float() * scale_inv``.

    The table is scaled first (its products are the elements' products).
    Two codes at a time where their bytes pair up (an even count of at
    least :data:`PAIRED_MIN_NUMEL` from an even offset, in memory order):
    each 16-bit pair indexes the table of pairs, read as float64 so that one
    lookup moves both values. A transposed operand is converted in memory
    order and returned transposed. With ``into`` (a scratch and a buffer
    name; only where :func:`quiet` holds), the values are written into that
    buffer, the indices into the scratch's ``"index"`` buffer and a scaled
    table of pairs into its ``"table"`` buffer: nothing is allocated but a
    scaled table of single codes (256 values).
    """
    codes = data.view(torch.uint8)
    flip = _transposed(codes)
    if flip:
        codes = codes.t()
    flat = codes.reshape(-1)
    paired = (
        _LITTLE_ENDIAN and flat.numel() >= PAIRED_MIN_NUMEL and flat.numel() % 2 == 0
        and flat.storage_offset() % 2 == 0
    )
    table = tables(data.dtype, data.device, paired)
    lookup = table if scale_inv is None else _scaled(table, scale_inv, paired, into)
    keys = flat.view(torch.uint16) if paired else flat
    if into is None:
        values = torch.index_select(lookup, 0, keys.int(), out=None if out is None else out.view(lookup.dtype))
    else:
        scratch, name = into
        index = scratch("index", keys.numel(), torch.int32, data.device).copy_(keys)
        target = scratch(name, flat.numel(), torch.float32, data.device) if out is None else out.view(-1)
        values = torch.index_select(lookup, 0, index, out=target.view(lookup.dtype))
    values = values.view(torch.float32).view(codes.shape)
    return values.t() if flip else values


def _scaled(table: Tensor, scale_inv: Tensor, paired: bool, into: tuple[Scratch, str] | None) -> Tensor:
    """``table``'s float32 values times ``scale_inv``, in the table's dtype (with ``into``, a table of
    pairs is scaled into the scratch's ``"table"`` buffer)."""
    if not paired:
        return table * scale_inv
    values = table.view(torch.float32)
    if into is None:
        scaled = values * scale_inv
    else:
        scaled = torch.mul(values, scale_inv, out=into[0]("table", values.numel(), torch.float32, table.device))
    return scaled.view(table.dtype)


def dequantize_into(
    tables: CodeTables, data: Tensor, scale_inv: Tensor, into: tuple[Scratch, str], out: Tensor | None = None
) -> Tensor:
    """``data.float() * scale_inv`` (FP8 ``data``, a 0-d float32 ``scale_inv``) written into this thread's
    buffer ``into`` (only where :func:`quiet` holds), or into ``out`` (a contiguous float32 tensor of as many
    elements) with the scratch's other buffers: E4M3 through :func:`gather`; E5M2, whose conversion torch
    makes faster than a lookup, converted into the buffer and scaled there."""
    if data.dtype == torch.float8_e4m3fn:
        return gather(tables, data, scale_inv, into, out)
    scratch, name = into
    flip = _transposed(data)
    source = data.t() if flip else data
    target = scratch(name, data.numel(), torch.float32, data.device) if out is None else out
    values = target.view(source.shape)
    values.copy_(source).mul_(scale_inv)
    return values.t() if flip else values


def _transposed(t: Tensor) -> bool:
    """Whether ``t`` is the transpose of a row-major 2-d tensor: converted in its memory order, then
    transposed back."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def as_float32(x: Tensor, scratch: Scratch | None) -> Tensor:
    """``x`` in float32: ``x`` itself, or ``x.float()`` (with ``scratch``, only where :func:`quiet` holds,
    a contiguous ``x`` converted into the scratch's ``"float32"`` buffer)."""
    if x.dtype == torch.float32:
        return x
    if scratch is None or not x.is_contiguous():
        return x.float()
    return scratch("float32", x.numel(), torch.float32, x.device).view(x.shape).copy_(x)


def host_abs_max(xf: Tensor) -> Tensor | float:
    """``xf``'s ``max|x|`` from one ``torch.aminmax``, read on the host (only where :func:`readable`): a
    float, or where either end is NaN the 0-d tensor :func:`scalestate.math.abs_max_of_ends` gives (NaN).
    Two reads on the host cost less than the three operations on 0-d tensors that combine the ends."""
    low, high = torch.aminmax(xf)
    lo, hi = low.item(), high.item()
    if lo != lo or hi != hi:
        return abs_max_of_ends(low, high)
    return max(abs(lo), abs(hi))  # abs of each: max(-0.0, 0.0) would keep the sign of -0.0


def saturate(
    xf: Tensor,
    scale: Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    scratch: Scratch | None,
    amax: Tensor | float | None = None,
) -> Tensor:
    """``(xf * scale).clamp_(-fp8_max, fp8_max).to(dtype)``: the saturating cast of float32 ``xf``.

    With ``amax`` (``xf``'s ``max|x|``, where :func:`readable`; a tensor, or
    a float from :func:`host_abs_max`) and at least
    :data:`CLAMP_CHECK_MIN_NUMEL` elements, the clamp
    is left out where ``|amax * scale|`` is at most ``fp8_max``: a product
    rounds monotonically in its magnitude, so no element's product is
    larger, and the clamp would change nothing (a NaN or infinite amax or
    scale keeps it; a float amax is multiplied exactly, in double precision,
    which can only keep a clamp that float32's rounding would leave out).
    With ``scratch`` (only where :func:`quiet` holds), a contiguous ``xf``'s
    scaled copy is made in the scratch's ``"a"`` buffer: the FP8 data is the
    one tensor allocated.
    """
    in_range = False
    if amax is not None and xf.numel() >= CLAMP_CHECK_MIN_NUMEL:
        bound = amax * float(scale) if isinstance(amax, float) else float(amax * scale)
        in_range = abs(bound) <= fp8_max
    if scratch is None or not xf.is_contiguous():
        scaled = xf * scale
    else:
        scaled = torch.mul(xf, scale, out=scratch("a", xf.numel(), torch.float32, xf.device).view(xf.shape))
    return (scaled if in_range else scaled.clamp_(-fp8_max, fp8_max)).to(dtype)
