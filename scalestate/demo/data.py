"""The demo's corpus: docstrings of Python's own standard library.

Real English technical prose that ships with every Python, read through
:mod:`inspect`, encoded as UTF-8 bytes (a 256-symbol vocabulary). The same
Python version always yields the same text.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import torch
from torch import Tensor

__all__ = ["MODULES", "batches", "corpus", "encode", "decode"]

MODULES = (
    "argparse", "ast", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email", "enum",
    "fnmatch", "fractions", "functools", "glob", "gzip", "heapq", "http.client",
    "inspect", "itertools", "json", "logging", "operator", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "typing", "unittest", "urllib.parse", "zipfile",
)


def _own_doc(obj: object) -> str:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def corpus() -> str:
    """Module, class, function and method docstrings of :data:`MODULES`, in a fixed order."""
    docs: list[str] = []
    with warnings.catch_warnings():
        # typing.io and typing.re raise a DeprecationWarning when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in MODULES:
            _collect(importlib.import_module(name), docs)
    return "\n\n".join(d for d in docs if d)


def _collect(module: object, docs: list[str]) -> None:
    docs.append(_own_doc(module))
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != getattr(module, "__name__", None):
            continue
        docs.append(_own_doc(obj))
        if inspect.isclass(obj):
            docs.extend(_own_doc(m) for a, m in sorted(vars(obj).items()) if not a.startswith("_"))


def encode(text: str) -> Tensor:
    """UTF-8 bytes as a ``long`` tensor of token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: Tensor) -> str:
    """Token ids back to text (invalid UTF-8 is replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def batches(tokens: Tensor, *, steps: int, batch: int, seq_len: int, seed: int) -> Tensor:
    """``[steps, batch, seq_len + 1]`` random windows of ``tokens``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (steps, batch), generator=gen)
    offsets = torch.arange(seq_len + 1)
    return tokens[starts.unsqueeze(-1) + offsets]
