"""Comparing runs: bitwise equality of nested results, snapshots of a training step, SQNR."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from scalestate import ScalingStateManager
from scalestate.errors import ArgumentValueError

__all__ = ["assert_same", "differences", "snapshot", "sqnr"]

#: How many differences the message of :func:`assert_same` lists.
_SHOWN = 10

#: Prefixes that wrappers add to parameter names without changing the layer:
#: torch's ``checkpoint_wrapper`` and ``torch.compile``'s ``OptimizedModule``.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")

_FLOAT8 = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
}


def differences(a: object, b: object, *, bits: bool = False, name: str = "") -> list[str]:
    """Where two results differ, bitwise: one line per difference, each naming its path.

    Tensors are the same when their dtype, shape and device are and
    ``torch.equal`` holds (FP8 tensors, which ``torch.equal`` does not take on
    every device, are compared by their exactly upcast values); with
    ``bits=True``, when every byte is the same (so ``-0.0`` differs from
    ``0.0``, and a NaN equals a NaN of the same bits). Mappings must have the
    same keys in the same order, lists and tuples the same length, and both
    sides the same container type; their members are compared in turn. Any
    other value is compared with ``==`` and must have the same type.

    Args:
        a: a tensor, or a mapping, list or tuple nesting tensors and plain
            values (a state dict, a list of :func:`snapshot` s, a run's outputs).
        b: what to compare it with.
        bits: compare raw bytes instead of ``torch.equal``.
        name: the path of ``a`` and ``b`` in the messages (``"state"`` gives
            ``state['scale']``).

    Returns:
        Every difference found, empty when ``a`` and ``b`` are the same.

    Example:
        >>> import torch
        >>> from scalestate.testing import differences
        >>> differences({"w": torch.ones(2), "step": 3}, {"w": torch.tensor([1.0, 2.0]), "step": 3}, name="run")
        ["run['w']: 1 of 2 elements differ, the first at index (1,): 1.0 != 2.0"]
    """
    found: list[str] = []
    _compare(a, b, name or "value", bits, found)
    return found


def assert_same(a: object, b: object, *, bits: bool = False, name: str = "") -> None:
    """Raise ``AssertionError`` listing the differences unless ``a`` and ``b`` are the same, bitwise.

    The rules are those of :func:`differences`; the message lists the first
    ten differences and how many there are.

    Example:
        >>> import torch
        >>> from scalestate.testing import assert_same
        >>> assert_same([torch.zeros(3)], [torch.zeros(3)])
        >>> assert_same([torch.zeros(3)], [torch.zeros(3), torch.zeros(3)], name="outputs")
        Traceback (most recent call last):
        ...
        AssertionError: 1 difference:
          outputs: length 1 != 2
    """
    found = differences(a, b, bits=bits, name=name)
    if found:
        more = f"\n  ... and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        lines = "\n  ".join(found[:_SHOWN])
        plural = "" if len(found) == 1 else "s"
        # A test assertion: AssertionError is what pytest and unittest report as a failure (as
        # torch.testing.assert_close raises it); tests/test_errors.py allows this raise.
        raise AssertionError(f"{len(found)} difference{plural}:\n  {lines}{more}")


def _compare(a: object, b: object, where: str, bits: bool, found: list[str]) -> None:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            found.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
        else:
            _compare_tensors(a, b, where, bits, found)
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        if type(a) is not type(b):
            found.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
        ka, kb = list(a), list(b)
        if ka != kb:
            only_a, only_b = [k for k in ka if k not in b], [k for k in kb if k not in a]
            if only_a or only_b:
                found.append(f"{where}: keys only in the first {only_a}, only in the second {only_b}")
            else:
                found.append(f"{where}: the same keys in another order ({ka} != {kb})")
        for key in ka:
            if key in b:
                _compare(a[key], b[key], f"{where}[{key!r}]", bits, found)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b):
            found.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
        if len(a) != len(b):
            found.append(f"{where}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):  # noqa: B905  # unequal lengths are reported above
            _compare(x, y, f"{where}[{i}]", bits, found)
    elif type(a) is not type(b):
        found.append(f"{where}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}")
    elif not _same_value(a, b, bits):
        found.append(f"{where}: {a!r} != {b!r}")


def _same_value(a: object, b: object, bits: bool) -> bool:
    if bits and isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    try:
        return bool(a == b)
    except Exception:  # a value without a boolean ==: the same only if it is the same object
        return a is b


def _compare_tensors(a: Tensor, b: Tensor, where: str, bits: bool, found: list[str]) -> None:
    for what, left, right in (
        ("dtype", a.dtype, b.dtype), ("shape", tuple(a.shape), tuple(b.shape)), ("device", a.device, b.device)
    ):
        if left != right:
            found.append(f"{where}: {what} {left} != {right}")
            return
    a, b = a.detach(), b.detach()
    if bits:
        # Bytes per element, so that the index of the first difference is an element's.
        rows = max(a.numel(), 1)
        differ = (_bytes(a).reshape(rows, -1) != _bytes(b).reshape(rows, -1)).any(dim=1)[: a.numel()]
    else:
        x, y = (a.float(), b.float()) if a.dtype in _FLOAT8 else (a, b)
        if torch.equal(x, y):
            return
        differ = (x != y).reshape(-1)
    n = int(differ.sum())
    if n == 0:
        return
    first = int(differ.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), a.shape)) if a.dim() else ()
    va, vb = a.reshape(-1)[first], b.reshape(-1)[first]
    shown = (va.float(), vb.float()) if a.dtype in _FLOAT8 else (va, vb)
    found.append(
        f"{where}: {n} of {a.numel()} elements differ, the first at index {index}: "
        f"{shown[0].item()!r} != {shown[1].item()!r}"
    )


def _bytes(t: Tensor) -> Tensor:
    """The tensor's bytes, in element order (any dtype, 0-d included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def snapshot(model: nn.Module, manager: ScalingStateManager | None = None) -> dict[str, Any]:
    """What a training step leaves behind, copied: parameters, gradients and the scaling state.

    Take one after each step of two runs and compare the lists with
    :func:`assert_same`. Parameter names lose the prefixes of torch's
    ``checkpoint_wrapper`` and of ``torch.compile`` (``_checkpoint_wrapped_module.``,
    ``_orig_mod.``), so a run with checkpointing or compilation compares
    with one without, layer by layer.

    Returns:
        ``{"parameters": {name: tensor}, "gradients": {name: tensor or None}}``,
        and ``"scaling_state": manager.state_dict()`` when a manager is given.

    Example:
        >>> import torch, scalestate as ss
        >>> from torch.utils.checkpoint import checkpoint
        >>> from scalestate.testing import assert_same, snapshot
        >>> def run(checkpointed):
        ...     torch.manual_seed(0)
        ...     manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        ...     layer = ss.nn.Linear(8, 8, manager=manager)
        ...     steps = []
        ...     for _ in range(3):
        ...         x = torch.randn(4, 8)
        ...         with manager.forward():
        ...             y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        ...         with manager.backward():
        ...             y.square().mean().backward()
        ...         manager.step()
        ...         steps.append(snapshot(layer, manager))
        ...     return steps
        >>> assert_same(run(False), run(True), name="steps")
    """
    snap: dict[str, Any] = {
        "parameters": {_unwrapped(k): p.detach().clone() for k, p in model.named_parameters()},
        "gradients": {
            _unwrapped(k): None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()
        },
    }
    if manager is not None:
        snap["scaling_state"] = manager.state_dict()
    return snap


def _unwrapped(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sqnr(reference: Tensor, x: Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``reference``, in dB.

    ``10 * log10(sum(reference**2) / sum((reference - x)**2))``, computed in
    float64 from both tensors as given (any dtype and device; upcasting is
    exact). ``inf`` when ``x`` equals ``reference``; ``-inf`` when the
    reference is all zeros and ``x`` is not. Rules of thumb for random normal
    data, measured: an E4M3 cast about 31 dB, E5M2 about 25 dB, an FP8 linear
    layer's output (E4M3 operands) about 29 dB.

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.testing import sqnr
        >>> x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        >>> q = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation").register(
        ...     "x", roles=(ss.Role.INPUT,)).quantize(x, ss.Role.INPUT)
        >>> 30 < sqnr(x, q.dequantize()) < 33
        True
    """
    if reference.shape != x.shape:
        raise ArgumentValueError(
            f"sqnr() needs tensors of one shape; got {tuple(reference.shape)} and {tuple(x.shape)}"
        )
    ref = reference.detach().double()
    signal = float(ref.square().sum())
    noise = float((ref - x.detach().to(ref.device).double()).square().sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
