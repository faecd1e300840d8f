"""What tests of FP8 training on scalestate need: comparisons, spies, a tiny transformer.

The library's own tests use these, and so can yours: a module library
checking that its layers keep scalestate's guarantees, a backend checking
that it matches the emulation backend bit for bit, a training framework
checking its checkpointing. Nothing here is imported by ``import scalestate``;
``import scalestate.testing`` (it needs nothing beyond scalestate's own
dependencies).

* Comparing runs: :func:`assert_same` and :func:`differences` (bitwise
  equality of nested results: state dicts, lists of per-step
  :func:`snapshot` s), :func:`sqnr` (accuracy against a high-precision
  reference).
* Watching what runs: :class:`OpLog` (the tensor operations dispatched),
  :class:`CastSpy` (every cast request a backend receives, and its result).
* :func:`registered_backend`: a backend registered for one ``with`` block.
* :class:`TinyLM` and :class:`Block`: the small transformer of
  ``scalestate demo``, made of plain ``torch.nn`` layers for
  :func:`scalestate.nn.convert` to turn into FP8; :class:`MoE` and
  :class:`Experts`, its mixture-of-experts MLP (``scalestate demo --moe``).

Example:
    Checkpointing changes nothing, bit for bit (invariant 1):

    >>> import torch, scalestate as ss
    >>> from scalestate.testing import Block, assert_same, snapshot
    >>> def run(checkpointed):
    ...     torch.manual_seed(0)
    ...     manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    ...     block = ss.nn.convert(Block(32, n_heads=2), manager)
    ...     steps = []
    ...     for step in range(3):
    ...         x = torch.randn(2, 8, 32) * (step + 1)
    ...         with manager.forward():
    ...             y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    ...         with manager.backward():
    ...             y.square().mean().backward()
    ...         manager.step()
    ...         steps.append(snapshot(block, manager))
    ...     return steps
    >>> assert_same(run(False), run(True), name="steps")
"""

from __future__ import annotations

from scalestate.testing.compare import assert_same, differences, snapshot, sqnr
from scalestate.testing.model import Block, Experts, MoE, TinyLM
from scalestate.testing.registry import registered_backend
from scalestate.testing.spies import CastSpy, OpLog, saved_for_backward_bytes

__all__ = [
    # comparing runs
    "assert_same",
    "differences",
    "snapshot",
    "sqnr",
    # watching what runs
    "OpLog",
    "CastSpy",
    "saved_for_backward_bytes",
    "registered_backend",
    # a model to run
    "Block",
    "Experts",
    "MoE",
    "TinyLM",
]
