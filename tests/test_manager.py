"""ScalingStateManager: registration, phases, step, and invariants 2-6 and 8."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from helpers import backend_for
from scalestate.errors import PhaseError, ScaleStateError, SlotError
from scalestate.testing import CastSpy, OpLog, assert_same, snapshot

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT


def _row_amax(manager: ss.ScalingStateManager, name: str, role: ss.Role) -> float:
    sd = manager.state_dict()
    return float(sd["step_amax"][sd["slots"].index([name, role.value])])


class TestRegister:
    def test_rows_and_growth(self, delayed):
        """Each role is a row of one contiguous buffer per kind, growing as slots register."""
        delayed.register("a", roles=(I, W))
        delayed.register("b")
        sd = delayed.state_dict()
        assert sd["amax_history"].shape == (5, 4) and sd["scale"].shape == (5,) and sd["step_amax"].shape == (5,)
        assert delayed.slots == (("a", I), ("a", W), ("b", I), ("b", W), ("b", G))  # the buffers' rows
        assert sd["slots"] == [["a", "input"], ["a", "weight"], ["b", "grad_output"], ["b", "input"], ["b", "weight"]]
        assert delayed.capacity >= 5

    def test_growth_keeps_values(self, delayed):
        """Registering after training keeps every earlier slot's state."""
        h = delayed.register("a", roles=(I,))
        with delayed.forward():
            h.quantize(torch.full((4,), 3.0), I)
        delayed.step()
        before = h.amax_history(I)
        delayed.register("b", roles=(I,))
        assert torch.equal(h.amax_history(I), before)
        assert delayed.handles["b"].scale(I).item() == 1.0

    def test_duplicate_name(self, delayed):
        """A name can be registered once per manager."""
        delayed.register("fc")
        with pytest.raises(SlotError, match="already registered"):
            delayed.register("fc")

    @pytest.mark.parametrize("roles", [(), ("input",), (I, I)])
    def test_bad_roles(self, delayed, roles):
        """Roles must be distinct Role values, at least one."""
        with pytest.raises(SlotError, match=r"Role\.INPUT"):
            delayed.register("fc", roles=roles)

    @pytest.mark.parametrize("name", ["", None, 3])
    def test_bad_name(self, delayed, name):
        """Names are non-empty strings."""
        with pytest.raises(SlotError):
            delayed.register(name)

    def test_unregistered_role(self, delayed):
        """Casting a role the slot lacks says which roles it has."""
        h = delayed.register("fc", roles=(I,))
        with pytest.raises(SlotError, match=r"has roles \(INPUT\)"):
            h.quantize(torch.ones(2), G)

    def test_non_tensor_input(self, delayed):
        """Integer tensors and non-tensors are refused with the type received."""
        h = delayed.register("fc", roles=(I,))
        with pytest.raises(ScaleStateError, match=r"torch\.int64"):
            h.quantize(torch.ones(2, dtype=torch.long), I)

    def test_bad_recipe(self):
        """A manager needs a recipe object."""
        with pytest.raises(ScaleStateError, match="DelayedScaling"):
            ss.ScalingStateManager("delayed")  # type: ignore[arg-type]


class TestPhases:
    def test_begin_calls_set_phase(self, delayed):
        """begin_* set the phase; step() returns to IDLE."""
        assert delayed.phase is ss.Phase.IDLE
        delayed.begin_forward()
        assert delayed.phase is ss.Phase.FORWARD
        delayed.begin_recompute()
        assert delayed.phase is ss.Phase.RECOMPUTE
        delayed.begin_backward()
        assert delayed.phase is ss.Phase.BACKWARD
        delayed.step()
        assert delayed.phase is ss.Phase.IDLE

    def test_blocks_restore(self, delayed):
        """A block restores the phase it found, also on error."""
        with delayed.forward():
            assert delayed.phase is ss.Phase.FORWARD
            with delayed.recompute():
                assert delayed.phase is ss.Phase.RECOMPUTE
            assert delayed.phase is ss.Phase.FORWARD
        with pytest.raises(KeyError), delayed.backward():
            raise KeyError
        assert delayed.phase is ss.Phase.IDLE

    def test_forward_inside_backward_block(self, delayed):
        """Opposite blocks cannot nest; the error says which block to close."""
        with delayed.backward(), pytest.raises(PhaseError, match="close the backward block"), delayed.forward():
            pass

    def test_begin_inside_block(self, delayed):
        """begin_forward() inside a block names both."""
        with delayed.backward(), pytest.raises(PhaseError, match=r"begin_forward\(\).*manager.backward"):
            delayed.begin_forward()

    def test_begin_recompute_inside_block_allowed(self, delayed):
        """Recompute may start inside any block; the block restores on exit."""
        with delayed.backward():
            delayed.begin_recompute()
            assert delayed.phase is ss.Phase.RECOMPUTE
        assert delayed.phase is ss.Phase.IDLE

    def test_step_inside_block(self, delayed):
        """step() inside a block is refused before anything changes."""
        with delayed.forward(), pytest.raises(PhaseError, match=r"step\(\) called inside"):
            delayed.step()
        assert delayed.iteration == 0

    def test_forward_cast_in_backward_phase_outside_autograd(self, delayed):
        """A forward cast in BACKWARD outside autograd's backward: error names the fix."""
        h = delayed.register("fc", roles=(I,))
        delayed.begin_backward()
        with pytest.raises(PhaseError, match=r"begin_forward\(\).*begin_recompute\(\)"):
            h.quantize(torch.ones(2), I)
        with torch.no_grad():  # an evaluation pass there is fine and records nothing
            h.quantize(torch.ones(2), I)
        assert _row_amax(delayed, "fc", I) == 0.0

    def test_forward_only_passes(self, delayed):
        """Several forwards per step and forwards without backward are normal."""
        h = delayed.register("fc", roles=(I,))
        for v in (1.0, 5.0, 2.0):
            with delayed.forward():
                h.quantize(torch.full((3,), v), I)
        assert _row_amax(delayed, "fc", I) == 5.0
        delayed.step()
        assert delayed.iteration == 1

    def test_repr(self, delayed):
        """The repr summarizes recipe, backend, phase, slots and step."""
        delayed.register("fc")
        delayed.begin_forward()
        assert repr(delayed) == (
            "<ScalingStateManager(recipe=DelayedScaling, backend='emulation', phase=FORWARD, slots=3, step=0)>"
        )

    def test_forward_casts_inside_function_forward_record(self, delayed):
        """A cast in autograd.Function.forward (grad disabled there) records in a training pass,
        and is evaluation when the Function runs under no_grad."""
        h = delayed.register("fc", roles=(I, G))

        class Cast(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return h.quantize(x, I).dequantize()

            @staticmethod
            def backward(ctx, g):
                return h.quantize(g, G).dequantize()

        x = torch.randn(4, requires_grad=True)
        with torch.no_grad():
            Cast.apply(x * 100)
        assert _row_amax(delayed, "fc", I) == 0.0
        Cast.apply(x).sum().backward()
        assert _row_amax(delayed, "fc", I) == x.abs().max().item()
        delayed.step()

    def test_unfed_forward_slot_is_caught(self, delayed):
        """A step whose gradient casts ran while every forward cast of the slot was evaluation
        is refused before anything changes, naming the slot and the fix."""
        h = delayed.register("fc", roles=(I, G))

        class Grad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return h.quantize(g, G).dequantize()

        x = torch.randn(4, requires_grad=True)
        with torch.no_grad():
            h.quantize(x, I)  # the forward cast, made as evaluation
        Grad.apply(x).sum().backward()
        with pytest.raises(PhaseError, match=r"'fc' was cast for GRAD_OUTPUT.*manager.forward"):
            delayed.step()
        assert delayed.iteration == 0


def _step_ops(slots: int, recipe: ss.Recipe, **kwargs) -> list[str]:
    """The tensor ops of one step() after one recorded cast of each of ``slots`` slots."""
    m = ss.ScalingStateManager(recipe, **kwargs)
    handles = [m.register(f"l{i}", roles=(I,)) for i in range(slots)]
    with m.forward():
        for h in handles:
            h.quantize(torch.randn(8), I)
    with OpLog() as counter:
        m.step()
    return counter.ops


class TestStepIsVectorized:
    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    def test_fixed_op_count(self, recipe, backend):
        """step() runs the same tensor ops for 2 slots as for 300."""
        few, many = (_step_ops(n, recipe, backend=backend_for(recipe, backend)) for n in (2, 300))
        assert few == many
        # rounding scales down to a power of two (block, MX) adds 5: two bit views, their detaches, a mask;
        # stochastic rounding (NVFP4) 2: the iteration's tensor and the casts' ordinals move on
        extra = 2 if isinstance(recipe, ss.NVFP4Scaling) and recipe.stochastic_rounding else 0
        assert 0 < len(few) <= (30 if recipe.power_of_2 else 25) + extra

    @pytest.mark.parametrize("policy", ["raise", "fallback"])
    def test_fixed_op_count_under_each_policy(self, policy):
        """The non-finite policies keep the count fixed too ("raise" adds its one host read)."""
        few, many = (_step_ops(n, ss.DelayedScaling(), backend="emulation", on_nonfinite=policy) for n in (2, 300))
        assert few == many
        assert 0 < len(few) <= 27


def _region_mechanisms():
    return {
        "reentrant": functools.partial(tcp.checkpoint, use_reentrant=True),
        "non_reentrant": functools.partial(tcp.checkpoint, use_reentrant=False),
        "ss": ss.checkpoint,
    }


class TestRecomputeIsInvisible:
    """Invariant 2."""

    @pytest.mark.parametrize("mechanism", ["reentrant", "non_reentrant", "ss"])
    def test_records_nothing_changes_nothing(self, manager, mechanism):
        """A recompute that sees 100x larger data leaves forward amaxes, scales and counters alone."""
        layer = ss.nn.Linear(16, 16, manager=manager, name="fc")
        box = [1.0]

        def region(x):
            return layer(x * box[0])

        x = torch.randn(4, 16, requires_grad=True)
        with manager.forward():
            y = _region_mechanisms()[mechanism](region, x)
        before = manager.state_dict()
        box[0] = 100.0
        with manager.backward():
            y.sum().backward()
        after = manager.state_dict()
        rows = {tuple(s): i for i, s in enumerate(after["slots"])}
        for role in ("input", "weight"):
            assert after["step_amax"][rows[("fc", role)]] == before["step_amax"][rows[("fc", role)]]
        assert after["step_amax"][rows[("fc", "grad_output")]] > 0
        assert torch.equal(after["scale"], before["scale"])
        assert torch.equal(after["amax_history"], before["amax_history"])
        assert after["iteration"] == before["iteration"] == manager.iteration == 0

    def test_explicit_recompute_phase(self, manager):
        """Casts in begin_recompute() / recompute() record nothing."""
        h = manager.register("fc", roles=(I, W))
        w = torch.randn(4, 4)
        with manager.recompute():
            h.quantize(torch.full((4,), 9.0), I)
            h.quantize(w, W)
        manager.begin_recompute()
        h.quantize(torch.full((4,), 9.0), I)
        assert manager.state_dict()["step_amax"].tolist() == [0.0, 0.0]


class TestScalesChangeOnlyInStep:
    """Invariant 3."""

    def test_one_scale_per_step_once_history_exists(self, backend):
        """After the first step every INPUT cast (microbatches, forward, recompute) uses one scale."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend)
        h = m.register("fc", roles=(I, G))
        with m.forward():
            h.quantize(torch.full((4,), 2.0), I)
        with m.backward():
            h.quantize(torch.full((4,), 0.5), G)
        m.step()
        want_i, want_g = 1 / h.scale(I), 1 / h.scale(G)
        seen_i, seen_g = [], []
        for v in (1.0, 30.0, 0.01):
            with m.forward():
                seen_i.append(h.quantize(torch.full((4,), v), I).scale_inv)
            with m.recompute():
                seen_i.append(h.quantize(torch.full((4,), v * 7), I).scale_inv)
            with m.backward():
                seen_g.append(h.quantize(torch.full((4,), v), G).scale_inv)
            assert torch.equal(1 / h.scale(I), want_i)
        assert all(torch.equal(s, want_i) for s in seen_i)
        assert all(torch.equal(s, want_g) for s in seen_g)

    def test_just_in_time_before_first_step(self, manager):
        """Before any history (and always with just-in-time recipes) each tensor scales itself."""
        h = manager.register("fc", roles=(I,))
        with manager.forward():
            qs = [h.quantize(torch.tensor([v, -v / 2]), I) for v in (1.0, 4.0)]
        if isinstance(manager.recipe, ss.NVFP4Scaling):  # the per-tensor level: S_enc = 448 * 6 / amax
            for q, v in zip(qs, (1.0, 4.0), strict=True):
                assert torch.equal(q.primary.tensor_scale_inv, torch.reciprocal(torch.tensor(2688.0) / v))
                assert torch.equal(q.dequantize(), torch.tensor([v, -v / 2]))  # 6 and -3 on the E2M1 grid
            return
        want = [torch.tensor(448.0) / v for v in (1.0, 4.0)]
        if manager.recipe.power_of_2:  # block and MX: rounded down to a power of two
            want = [torch.tensor(256.0), torch.tensor(64.0)]
        # Fine-grained recipes: the two elements are one row, tile or MX block (one scale, shape (1,));
        # MX's scale_inv is E8M0 (exact in float32).
        assert all(torch.equal(q.scale.reshape(()), w) for q, w in zip(qs, want, strict=True))
        assert all(torch.equal(q.scale_inv.float().reshape(()), w.reciprocal()) for q, w in zip(qs, want, strict=True))
        assert h.scale(I).item() == 1.0  # the state itself did not change

    def test_state_after_step_independent_of_microbatch_order(self, manager, backend):
        """Permuting the microbatches of a step gives bitwise the same state."""
        xs = [torch.randn(8, 16) * s for s in (1.0, 10.0, 0.1, 3.0)]
        states = []
        for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
            m = ss.ScalingStateManager(manager.recipe, backend=backend)
            torch.manual_seed(0)
            layer = ss.nn.Linear(16, 16, manager=m, name="fc")
            for step in range(3):
                for i in order:
                    with m.forward():
                        loss = layer(xs[i] * (step + 1)).square().sum()
                    with m.backward():
                        loss.backward()
                m.step()
            states.append(m.state_dict())
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(states[0][key], states[1][key])


class TestQuantizedCarriesScale:
    """Invariant 4."""

    def test_scale_inv_is_a_copy(self, manager):
        """A cast made before step() dequantizes the same after scales changed."""
        h = manager.register("fc", roles=(I,))
        with manager.forward():
            q = h.quantize(torch.tensor([1.0, -0.5]), I)
            h.quantize(torch.tensor([1000.0]), I)
        before_scale, before_inv, before = q.scale.clone(), q.scale_inv.clone(), q.dequantize()
        manager.step()
        with manager.forward():
            q2 = h.quantize(torch.tensor([5.0]), I)
        manager.step()
        # (fine-grained recipes: one row, tile or MX block, scale shape (1,); MX scale_inv is E8M0)
        assert not torch.equal(h.scale(I), before_scale.reshape(()))  # the slot's scale did change ...
        assert torch.equal(q.scale, before_scale) and torch.equal(q.scale_inv, before_inv)  # ... not q's
        assert torch.equal(q.dequantize(), before)
        if isinstance(manager.recipe, ss.NVFP4Scaling):  # e_b = 1 / (s_b * S_dec), s_b stored in E4M3
            s_dec = q2.primary.tensor_scale_inv
            assert torch.equal(q2.scale, torch.div(1.0, q2.scale_inv.float() * s_dec))
        else:
            assert torch.equal(q2.scale_inv.float(), torch.reciprocal(q2.scale))


class TestMicrobatchesAndEvaluation:
    """Invariant 6."""

    def test_max_reduced(self, manager):
        """The step amax is the max over microbatches, never the last one."""
        h = manager.register("fc", roles=(I,))
        for v in (2.0, 9.0, 3.0):
            with manager.forward():
                h.quantize(torch.tensor([v, -1.0]), I)
        assert _row_amax(manager, "fc", I) == 9.0

    def test_evaluation_records_nothing(self, manager):
        """A no_grad pass with no phase uses the scales and leaves the state bitwise unchanged."""
        layer = ss.nn.Linear(16, 8, manager=manager, name="fc")
        with manager.forward():
            layer(torch.randn(4, 16)).sum().backward()
        manager.step()
        before = manager.state_dict()
        with torch.no_grad():
            layer(torch.randn(4, 16) * 50)
        with torch.inference_mode():
            layer(torch.randn(4, 16) * 50)
        after = manager.state_dict()
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(before[key], after[key])

    def test_inference_mode_between_steps(self, recipe, backend):
        """Validation under inference_mode, of the model and of a copy sharing the manager, between
        microbatches and between steps, leaves no cast behind that training could not use and
        takes none away that it could: training casts each weight once per step and ends bitwise
        where it ends without validation."""

        def run(validate: bool):
            torch.manual_seed(0)
            m = ss.ScalingStateManager(recipe, backend=backend)
            layer = ss.nn.Linear(16, 8, manager=m, name="fc")
            ema = copy.deepcopy(layer, memo={id(m): m})  # an evaluation copy: its own weights, the same slots
            opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(1)
            probe = torch.randn(4, 16, generator=gen) * 50
            steps, weight_casts = [], []

            def validation() -> None:
                if validate:
                    with torch.inference_mode():
                        layer(probe)
                        ema(probe)

            for step in range(3):
                with CastSpy(m) as spy:
                    validation()  # a new epoch: nothing cached yet
                    for _ in range(2):
                        with m.forward():
                            y = layer(torch.randn(4, 16, generator=gen) * (step + 1))
                        with m.backward():
                            y.sum().backward()
                        validation()  # between microbatches: the training cast is cached
                    weight_casts.append(spy.casts_of(layer.weight))
                opt.step()
                opt.zero_grad()
                m.step()
                steps.append(snapshot(layer, m))
            assert m.iteration == 3
            return steps, weight_casts

        plain, plain_casts = run(False)
        validated, validated_casts = run(True)
        assert plain_casts == [1, 1, 1]
        # Validated: at each step's start, one uncached inference cast; then the training cast, once.
        assert validated_casts == [2, 2, 2]
        assert_same(validated, plain, name="steps")

    @pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
    @pytest.mark.parametrize("requires_grad", [False, True])
    @pytest.mark.parametrize("mechanism", ["torch", "ss"])
    def test_evaluation_through_reentrant_checkpoint(self, manager, mechanism, requires_grad):
        """A no_grad pass through a reentrant-checkpointed model records nothing, even when its input
        requires grad (as Hugging Face models with gradient checkpointing make it); the same call
        with grad enabled is training and records."""
        layer = ss.nn.Linear(16, 8, manager=manager, name="fc")
        run = functools.partial(tcp.checkpoint if mechanism == "torch" else ss.checkpoint, use_reentrant=True)
        x = (torch.randn(4, 16) * 300).requires_grad_(requires_grad)
        with torch.no_grad():
            run(layer, x)
        assert manager.state_dict()["step_amax"].tolist() == [0.0, 0.0, 0.0]
        if requires_grad:
            run(layer, x)
            assert _row_amax(manager, "fc", I) == x.abs().max().item()

    def test_no_grad_inside_forward_phase_records(self, manager):
        """Inside an explicit forward phase a no_grad pass is a training forward."""
        h = manager.register("fc", roles=(I,))
        with manager.forward(), torch.no_grad():
            h.quantize(torch.tensor([4.0]), I)
        assert _row_amax(manager, "fc", I) == 4.0


class TestNoGlobalState:
    """Invariant 8."""

    def test_two_managers_never_interact(self, recipe, backend):
        """Interleaved training with two managers equals training each alone, bitwise."""

        def make():
            m = ss.ScalingStateManager(recipe, backend=backend)
            torch.manual_seed(0)
            return m, ss.nn.Linear(8, 8, manager=m, name="fc")

        def train_step(m, layer, x):
            with m.forward():
                loss = layer(x).square().sum()
            with m.backward():
                loss.backward()
            m.step()

        xs = [torch.randn(4, 8) * (i + 1) for i in range(3)]
        alone_m, alone = make()
        for x in xs:
            train_step(alone_m, alone, x)
        (m1, l1), (m2, l2) = make(), make()
        for x in xs:
            train_step(m1, l1, x)
            with m2.forward():  # the other manager's phase is independent
                l2(x * 1000).sum()
            train_step(m2, l2, x)  # ... and its state differs from m1's
        assert torch.equal(m1.state_dict()["amax_history"], alone_m.state_dict()["amax_history"])
        assert torch.equal(l1.weight.grad, alone.weight.grad)
        assert not torch.equal(m2.state_dict()["amax_history"], m1.state_dict()["amax_history"])


class TestDevice:
    def test_follows_first_cast_then_pins(self, delayed):
        """The state moves to the first tensor's device; later another device is a clear error."""
        h = delayed.register("fc", roles=(I,))
        with delayed.forward():
            h.quantize(torch.ones(2), I)
        assert delayed.device == torch.device("cpu")
        with pytest.raises(ScaleStateError, match=r"one manager per device|manager.to"):
            h.quantize(torch.ones(2, device="meta"), I)

    def test_indexed_cpu(self):
        """device='cpu:0' is the CPU tensors report as 'cpu'."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", device="cpu:0")
        with m.forward():
            m.register("fc", roles=(I,)).quantize(torch.ones(2), I)
        assert m.device == torch.device("cpu")

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is missing")
    def test_missing_cuda_is_named(self):
        """device='cuda' without CUDA: the library's error says what is missing (not torch's AssertionError)."""
        missing = "without CUDA support" if torch.version.cuda is None else "torch sees no GPU"
        with pytest.raises(ss.errors.DeviceUnavailableError, match=missing) as caught:
            ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", device="cuda")
        assert isinstance(caught.value, RuntimeError) and "device 'cuda' asked for" in str(caught.value)
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        with pytest.raises(ss.errors.DeviceUnavailableError, match="device 'cuda:1' asked for"):
            m.to("cuda:1")
        assert m.device == torch.device("cpu")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    def test_gpu_index_past_the_last(self):
        """device='cuda:N' past the last GPU names how many there are."""
        count = torch.cuda.device_count()
        with pytest.raises(ss.errors.DeviceUnavailableError, match=f"torch sees {count} GPU"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", device=f"cuda:{count}")
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", device="cuda")
        assert m.device == torch.device("cuda", torch.cuda.current_device())

    def test_to_keeps_values(self, delayed):
        """to() moves the state with its values."""
        h = delayed.register("fc", roles=(I,))
        with delayed.forward():
            h.quantize(torch.full((2,), 3.0), I)
        delayed.step()
        before = delayed.state_dict()
        delayed.to("cpu")
        after = delayed.state_dict()
        assert torch.equal(before["amax_history"], after["amax_history"])


class TestCastRequests:
    """What the manager hands the backend: every decision made, nothing left to do after."""

    @staticmethod
    def _watch(manager):
        """A spy on the manager's backend, and a log of the ops dispatched outside its casts."""
        spy = CastSpy(manager)
        return spy, OpLog(when=lambda: not spy.casting)

    def test_recorded_cast_is_one_request_and_nothing_else(self, delayed):
        """A recorded cast is one request naming the slot's accumulator; the manager dispatches no
        tensor operation of its own (a fusing backend records in its single pass)."""
        h = delayed.register("fc", roles=(I,))
        x = torch.randn(4, 8)
        with delayed.forward():
            h.quantize(x, I)
        delayed.step()
        with delayed.forward():
            h.quantize(x, I)  # the slot now has history: known on the host from here on
        spy, outside = self._watch(delayed)
        with delayed.forward(), spy, outside:
            q = h.quantize(x, I)
        assert outside.ops == []
        (request,) = spy.requests
        assert request.jit is False and request.record is not None and not request.transpose
        assert torch.equal(request.scale, h.scale(I)) and torch.equal(q.scale, h.scale(I))
        assert request.record.data_ptr() == delayed.buffers()["step_amax"][0].data_ptr()

    def test_recorded_weight_cast_records_in_the_backend_pass(self, delayed):
        """A training weight cast records into the slot's accumulator in the backend's pass, and
        the cached cast's later training uses in the step dispatch nothing at all."""
        h = delayed.register("fc", roles=(W,))
        w = torch.randn(8, 8, requires_grad=True)
        for _ in range(2):  # the slot has history, and the host knows it
            with delayed.forward():
                h.quantize(w, W)
            delayed.step()
        spy, outside = self._watch(delayed)
        with delayed.forward(), spy, outside:
            q = h.quantize(w, W)
            assert h.quantize(w, W) is q  # a second microbatch: a hit
        assert outside.ops == ["aten.detach.default"]  # the weight's detach, before the request
        (request,) = spy.requests
        assert request.record is not None
        assert request.record.data_ptr() == delayed.buffers()["step_amax"][0].data_ptr()
        assert delayed.buffers()["step_amax"][0].item() == w.abs().max().item()

    def test_weight_cast_in_evaluation_keeps_its_amax_for_training(self, delayed):
        """A weight cast first made in evaluation records nothing, and its first training use in
        the step records the amax it kept."""
        h = delayed.register("fc", roles=(W,))
        w = torch.randn(8, 8)
        with CastSpy(delayed) as spy:
            with torch.no_grad():
                q = h.quantize(w, W)
            assert delayed.buffers()["step_amax"][0].item() == 0.0
            with delayed.forward():
                assert h.quantize(w, W) is q
        (request,) = spy.requests
        assert request.record is not None
        assert request.record.data_ptr() != delayed.buffers()["step_amax"][0].data_ptr()
        assert delayed.buffers()["step_amax"][0].item() == w.abs().max().item()

    @pytest.mark.parametrize("kind", ["evaluation", "recompute"])
    def test_unrecorded_casts_name_no_accumulator(self, delayed, kind):
        """Evaluation and recompute casts hand the backend no record target."""
        h = delayed.register("fc", roles=(I,))
        with CastSpy(delayed) as spy, torch.no_grad() if kind == "evaluation" else delayed.recompute():
            h.quantize(torch.randn(4), I)
        assert spy.requests[0].record is None

    def test_just_in_time_and_transpose(self, delayed):
        """Before any history the request scales just in time; transpose is passed through."""
        h = delayed.register("fc", roles=(I,))
        with CastSpy(delayed) as spy, delayed.forward():
            q = h.quantize(torch.randn(4, 6), I, transpose=True)
        assert spy.requests[0].jit is True and spy.requests[0].transpose and q.transposed is not None
        with pytest.raises(ScaleStateError, match=r"transpose=True needs a 2-d tensor"):
            h.quantize(torch.randn(4), I, transpose=True)
