"""The demo's model: the tiny transformer of :mod:`scalestate.testing` (kept importable from here)."""

from __future__ import annotations

from scalestate.testing.model import Block, TinyLM

__all__ = ["Block", "TinyLM"]
