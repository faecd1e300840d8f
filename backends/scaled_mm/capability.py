"""What this torch build and its devices run: the capability probing of ``scaled_mm``.

Every fact is asked once, eagerly or at binding (``torch.compile`` cannot
trace the queries), and never by running a product where the dispatcher can
answer: availability may be asked during a first cast inside a checkpointed
region, where an extra operation would be recorded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scalestate.backends.scaled_mm.kinds import MX, ROW, Pair, kind_label

__all__ = ["Probe", "cpu_runs_functional", "default_device", "device_label", "has_functional_scaled_mm"]

#: The first torch whose CPU kernel of ``torch.nn.functional.scaled_mm`` was measured here to run
#: tensor-wise and row-wise products (torch 2.13).
_CPU_FUNCTIONAL_TORCH = (2, 13)
_BLOCK_WHERE = "an sm90 GPU (Hopper) with torch built for CUDA 12.9+ (cuBLASLt block scaling)"
_MX_WHERE = "an sm100+ GPU (Blackwell)"


class Probe:
    """The answers of one backend instance: its CPU kernel, each CUDA device's capability."""

    def __init__(self) -> None:
        self._cpu: tuple[bool, str] | None = None
        self._capabilities: dict[torch.device, tuple[int, int]] = {}
        #: Whether this torch's CPU kernel of ``torch.nn.functional.scaled_mm`` takes tensor-wise and
        #: row-wise scales (asked of the dispatcher, once).
        self.cpu_functional = cpu_runs_functional()

    def available(self, device: torch.device) -> tuple[bool, str]:
        """Whether ``torch._scaled_mm`` runs on ``device``, and why."""
        if not hasattr(torch, "_scaled_mm"):
            return False, f"torch {torch.__version__} has no torch._scaled_mm"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "no CUDA device is visible to torch"
            major, minor = self.capability(device)
            if (major, minor) < (8, 9):
                return False, f"torch._scaled_mm needs sm89+; found sm{major}{minor}"
            return True, f"torch._scaled_mm on sm{major}{minor}"
        if device.type == "cpu":
            if self._cpu is None:
                self._cpu = _probe_cpu()
                if self._cpu[0] and self.cpu_functional:
                    self._cpu = True, f"torch.nn.functional.scaled_mm on CPU (torch {torch.__version__})"
            return self._cpu
        return False, f"torch._scaled_mm is not supported on {device.type} here"

    def capability(self, device: torch.device) -> tuple[int, int]:
        """The compute capability of a CUDA ``device``, asked of torch once (at binding, by :meth:`available`)."""
        known = self._capabilities.get(device)
        if known is None:
            major, minor = torch.cuda.get_device_capability(device)
            known = self._capabilities[device] = (major, minor)
        return known

    def pair_runs(self, pair: Pair, device: torch.device) -> tuple[bool, str]:
        """Whether torch runs products of ``pair`` on ``device`` (which :meth:`available` accepts);
        if not, why not and what would."""
        if pair in ((None, None), (ROW, ROW)):
            # Row-wise runs wherever per-tensor does: the row and column scales factor out of every sum.
            return self.available(device)
        if None in pair:
            return False, f"no torch kernel multiplies {kind_label(pair[0])} times {kind_label(pair[1])}"
        mx = pair == (MX, MX)
        what, where = ("MX blocks", _MX_WHERE) if mx else ("1 x 128 tiles and 128 x 128 blocks", _BLOCK_WHERE)
        if device.type != "cuda":
            return False, (
                f"torch's {device.type.upper()} kernel takes per-tensor and row-wise scales only (torch 2.13 "
                f"refuses others with 'Invalid scaling configuration'); {what} run on {where}"
            )
        if torch.version.hip:
            return False, f"{what} are mapped to torch's kernels for NVIDIA GPUs only; they run on {where}"
        if not has_functional_scaled_mm():
            return False, (
                f"torch {torch.__version__} has no torch.nn.functional.scaled_mm, which {what} need, "
                f"on {where}"
            )
        major, minor = self.capability(device)
        if mx:
            if major < 10:
                return False, f"{what} run on {where}; found sm{major}{minor}"
            return True, f"{what} on sm{major}{minor}"
        if major != 9:
            return False, f"{what} run on {where}; found sm{major}{minor}"
        if _cuda_version() < (12, 9):
            return False, f"{what} run on {where}; this torch is built for CUDA {torch.version.cuda}"
        return True, f"{what} on sm{major}{minor}"


    def nvfp4_runs(self, device: torch.device) -> tuple[bool, str]:
        """Whether torch runs NVFP4 products (``BlockWise1x16`` with a ``TensorWise`` second level) on
        ``device``; if not, why not and what would."""
        where = f"{_MX_WHERE}, through torch.nn.functional.scaled_mm"
        if device.type != "cuda":
            return False, f"torch's {device.type.upper()} kernel takes no NVFP4 operands; NVFP4 products run on {where}"
        if torch.version.hip:
            return False, f"NVFP4 is mapped to torch's kernels for NVIDIA GPUs only; it runs on {where}"
        if not has_functional_scaled_mm():
            return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm; NVFP4 runs on {where}"
        major, minor = self.capability(device)
        if major < 10:
            return False, f"NVFP4 products run on {where}; found sm{major}{minor}"
        return True, f"NVFP4 blocks on sm{major}{minor}"


def default_device(device: torch.device | str | None) -> torch.device:
    """``device``, or CUDA if torch sees a GPU, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_label(device: torch.device) -> str:
    """A device in messages: ``"CPU (torch 2.13.0)"``, ``"cuda:0"``."""
    if device.type == "cpu":
        return f"CPU (torch {torch.__version__})"
    return str(device)


def has_functional_scaled_mm() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` (the fine-grained kernels' entry)."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _cuda_version() -> tuple[int, int]:
    if not torch.version.cuda:
        return (0, 0)
    major, _, minor = torch.version.cuda.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def cpu_runs_functional() -> bool:
    """Whether this torch's CPU kernel of ``torch.nn.functional.scaled_mm`` (``aten::_scaled_mm_v2``) takes
    tensor-wise and row-wise scales (measured in torch 2.13), asked of the dispatcher."""
    if not has_functional_scaled_mm() or _torch_version() < _CPU_FUNCTIONAL_TORCH:
        return False
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return has_kernel is not None and bool(has_kernel("aten::_scaled_mm_v2", "CPU"))


def _probe_cpu() -> tuple[bool, str]:
    """Whether this torch has a CPU kernel for ``torch._scaled_mm`` (older builds do not).

    Asked of the dispatcher, not by running a product: availability may be
    checked during a first cast inside a checkpointed region, where an extra
    operation would be recorded (selective checkpointing caches products by
    order). Torch builds without that query run a 1x1 product instead.
    """
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is not None:
        if has_kernel("aten::_scaled_mm", "CPU"):
            return True, f"torch._scaled_mm on CPU (torch {torch.__version__})"
        return False, f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm"
    one = torch.ones((), dtype=torch.float32)
    x = torch.ones(1, 1, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x, scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return False, f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm ({first})"
    return True, f"torch._scaled_mm on CPU (torch {torch.__version__})"
