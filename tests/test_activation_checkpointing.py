"""Activation checkpointing: bitwise parity with plain training (invariants 1, 2, 7).

Every run trains 5 optimizer steps of 2 microbatches with AdamW and data whose
range grows each step, then compares outputs, input grads, weight grads,
parameters, amax histories and scales after every step with ``torch.equal``.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import scalestate as ss
from helpers import MECHANISMS, assert_bitwise, train

#: Each fine-grained recipe on one backend here (see conftest.FINE_RECIPE_BACKEND).
FINE_RECIPES_ON_ONE_BACKEND = True


@functools.cache
def reference(recipe: ss.Recipe, backend: str, kind: str, explicit: bool = True):
    return train(recipe, backend, kind=kind, explicit_phases=explicit)


@pytest.fixture(autouse=True)
def _quiet():
    # Nested reentrant checkpoints warn that their (no-grad) inputs need no grad.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*requires_grad.*")
        yield


class TestReferenceMoves:
    def test_scales_really_move(self, recipe, backend):
        """The reference run's scales change from step to step (so parity is not vacuous)."""
        ref = reference(recipe, backend, "block")
        assert len({tuple(s.tolist()) for s in ref.scales}) == len(ref.scales)
        assert not torch.equal(ref.params[0]["body.0.fc1.weight"], ref.params[-1]["body.0.fc1.weight"])


class TestMechanisms:
    @pytest.mark.parametrize("mechanism", MECHANISMS)
    @pytest.mark.parametrize("kind", ["linear", "block"])
    def test_every_block_checkpointed(self, recipe, backend, mechanism, kind):
        """Each mechanism, a region per block (or around the single Linear): bitwise parity."""
        got = train(recipe, backend, kind=kind, mechanism=mechanism, granularity="block")
        assert_bitwise(reference(recipe, backend, kind), got)

    @pytest.mark.parametrize("mechanism", MECHANISMS)
    def test_without_explicit_phases(self, recipe, backend, mechanism):
        """A loop that sets no phase at all: still bitwise parity."""
        got = train(recipe, backend, mechanism=mechanism, granularity="block", explicit_phases=False)
        assert_bitwise(reference(recipe, backend, "block", explicit=False), got)

    def test_explicit_and_implicit_loops_agree(self, recipe, backend):
        """Setting phases or not changes nothing in plain training."""
        assert_bitwise(reference(recipe, backend, "block"), reference(recipe, backend, "block", False))


class TestGranularity:
    @pytest.mark.parametrize("mechanism", ["non_reentrant", "reentrant", "wrapper", "ss", "selective"])
    @pytest.mark.parametrize("granularity", ["model", "nested"])
    def test_whole_model_and_nested(self, recipe, backend, mechanism, granularity):
        """One region around the model, or per-block regions nested inside it: bitwise parity."""
        got = train(recipe, backend, mechanism=mechanism, granularity=granularity)
        assert_bitwise(reference(recipe, backend, "block"), got)


class TestManualRecompute:
    def test_begin_recompute_outside_autograd(self, recipe, backend):
        """A framework that reruns the forward itself, marked with begin_recompute(): bitwise parity."""
        got = train(recipe, backend, schedule="manual_recompute")
        assert_bitwise(reference(recipe, backend, "block"), got)


class TestBF16:
    def test_bf16_model(self, backend):
        """bf16 parameters and activations: bitwise parity too."""
        recipe = ss.DelayedScaling(history_len=4)
        ref = train(recipe, backend, dtype=torch.bfloat16)
        got = train(recipe, backend, dtype=torch.bfloat16, mechanism="non_reentrant", granularity="block")
        assert_bitwise(ref, got)
