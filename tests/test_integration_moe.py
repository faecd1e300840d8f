"""Hugging Face MoE models: FP8 grouped experts, checkpointing bitwise, generate records nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import scalestate as ss
from scalestate.integrations.transformers_moe import Experts, convert_experts
from scalestate.testing import assert_same, sqnr

VOCAB, E, K = 64, 4, 2
COMMON = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 32, "num_experts_per_tok": K,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}


def tiny(family: str) -> torch.nn.Module:
    """A tiny float32 MoE model from its config (nothing downloaded)."""
    torch.manual_seed(0)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=E))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, num_experts=E, moe_intermediate_size=64, head_dim=16))
    else:
        model = OlmoeForCausalLM(OlmoeConfig(**COMMON, num_experts=E))
    model.config._attn_implementation = "eager"
    return model.float()


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_experts_converted_keeping_parameters(family: str) -> None:
    model = tiny(family)
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    params = list(model.parameters())
    routers = [type(layer.mlp.gate) for layer in model.model.layers]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    manager = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation")
    ss.nn.convert(model, manager)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert sqnr(want, got) > 20  # FP8 experts (and attention) close to the model's own float32 forward
    assert {key: value.shape for key, value in model.state_dict().items()} == shapes
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert all(isinstance(experts, Experts) for experts in _experts(model))
    assert [type(layer.mlp.gate) for layer in model.model.layers] == routers  # routers stay high precision
    names = list(manager.handles)
    assert "model.layers.1.mlp.experts.gate_up_proj.3" in names and "model.layers.0.mlp.experts.down_proj.0" in names
    assert sum(".experts." in name for name in names) == 2 * 2 * E


def _reference(experts: torch.nn.Module, handles: dict[str, ss.ScalingHandle], x, index, weights) -> torch.Tensor:
    """The experts by hand: each expert's tokens (ascending) through ss.nn.linear, added in expert order."""
    out = torch.zeros_like(x)
    for e in range(E):
        token, pos = torch.where(index == e)
        if token.numel() == 0:
            continue
        h = ss.nn.linear(x[token], experts.gate_up_proj[e], None, handles[f"gate_up_proj.{e}"])
        gate, up = h.chunk(2, dim=-1)
        y = ss.nn.linear(experts.act_fn(gate) * up, experts.down_proj[e], None, handles[f"down_proj.{e}"])
        out.index_add_(0, token, y * weights[token, pos, None])
    return out


@pytest.mark.parametrize("recipe", [ss.DelayedScaling(history_len=4), ss.MXFP8Scaling()], ids=["delayed", "mxfp8"])
def test_forward_and_gradients_equal_a_per_expert_loop(recipe: ss.Recipe) -> None:
    """Same routing, with expert 3 never reached: output, input and weight gradients and state bitwise."""
    torch.manual_seed(1)
    config = MixtralConfig(**COMMON, num_local_experts=E)
    hf = MixtralExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj)
    torch.nn.init.normal_(hf.down_proj)
    x = torch.randn(24, 32)
    index = torch.randint(0, E - 1, (24, K))
    weights = torch.rand(24, K)
    results = []
    for converted in (True, False):
        manager = ss.ScalingStateManager(recipe, backend="emulation")
        gate_up = torch.nn.Parameter(hf.gate_up_proj.detach().clone())
        down = torch.nn.Parameter(hf.down_proj.detach().clone())
        xi = x.clone().requires_grad_()
        if converted:
            module = hf.__class__(config)
            module.gate_up_proj, module.down_proj = gate_up, down
            module = converted_module = ss.nn.convert(module, manager, prefix="x")
            with manager.forward():
                y = module(xi, index, weights)
        else:
            names = [f"{proj}.{e}" for proj in ("gate_up_proj", "down_proj") for e in range(E)]
            handles = {name: manager.register(f"x.{name}") for name in names}
            ref = torch.nn.Module()
            ref.gate_up_proj, ref.down_proj, ref.act_fn = gate_up, down, hf.act_fn
            with manager.forward():
                y = _reference(ref, handles, xi, index, weights)
        with manager.backward():
            (y**2).sum().backward()
        manager.step()
        results.append([y.detach(), xi.grad, gate_up.grad, down.grad, manager.state_dict()])
    assert_same(results[0], results[1], name="converted vs loop")
    unused = converted_module.gate_up_handles[E - 1]
    assert unused.name == "x.gate_up_proj.3"
    assert not any(bool(unused.amax_history(role).any()) for role in ss.Role)  # never reached: nothing recorded


def test_route_orders_by_expert_and_drops_foreign_indices() -> None:
    index = torch.tensor([[2, 0], [1, 2], [4, 0]])  # 4: no expert of these 3 (one on another rank)
    order, tokens, sizes = ss.nn.sort_by_expert(index, 3)
    assert sizes == [2, 1, 2]
    assert tokens.tolist() == [0, 2, 1, 0, 1]
    assert order.tolist() == [1, 5, 2, 0, 3]


def _train(family: str, reentrant: bool | None, steps: int = 3) -> list:
    model = tiny(family)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    ss.nn.convert(model, manager)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    record = []
    for _ in range(steps):
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
            with manager.forward():
                loss = model(input_ids=ids, labels=ids).loss
            with manager.backward():
                loss.backward()
            record.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()
        record.append({k: p.detach().clone() for k, p in model.named_parameters()})
        record.append(manager.state_dict())
    return record


@pytest.fixture(scope="module")
def plain_mixtral() -> list:
    return _train("mixtral", None)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_bitwise(reentrant: bool, plain_mixtral: list) -> None:
    """A converted tiny Mixtral trains; with HF gradient checkpointing every loss, parameter and slot is bitwise."""
    got = _train("mixtral", reentrant)
    assert_same(got, plain_mixtral, name="checkpointed vs plain")
    history = got[-1]["amax_history"]
    assert bool((history[:, -1] > 0).any())


def test_generate_records_nothing() -> None:
    model = tiny("mixtral")
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    ss.nn.convert(model, manager)
    before = manager.state_dict()
    out = model.generate(torch.randint(0, VOCAB, (2, 4)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 8)
    pending = manager.buffers()["step_amax"]
    assert torch.equal(pending, torch.zeros_like(pending))
    assert_same(manager.state_dict(), before)


def test_other_layouts_left_alone_and_refused() -> None:
    """GPT-OSS (transposed, interleaved, biased) is not converted, and converting it by hand says why."""
    config = GptOssConfig(
        hidden_size=32, intermediate_size=32, num_local_experts=E, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=1, vocab_size=VOCAB,
    )
    experts = GptOssExperts(config)
    manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
    net = torch.nn.Sequential(experts)
    ss.nn.convert(net, manager)
    assert net[0] is experts and not manager.handles
    with pytest.raises(ss.errors.ConversionTypeError, match=r"has_bias|differs"):
        convert_experts(experts, ss.nn.ConversionRequest(manager, "gpt_oss"))


def test_registered_lazily_without_importing_transformers(tmp_path) -> None:
    """import scalestate never imports transformers; once a MoE family is imported, convert() converts it."""
    script = """
import sys, torch, scalestate as ss
ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), ss.ScalingStateManager(ss.DelayedScaling()))
assert "transformers" not in sys.modules, "core imported transformers"
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
assert "scalestate.integrations.transformers_moe" not in sys.modules
experts = MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
net = ss.nn.convert(torch.nn.Sequential(experts), ss.ScalingStateManager(ss.DelayedScaling()))
assert type(net[0]).__name__ == "Experts", type(net[0])
from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
from transformers import OlmoeConfig
net = ss.nn.convert(torch.nn.Sequential(OlmoeExperts(OlmoeConfig(hidden_size=8, intermediate_size=16, num_experts=2))),
                    ss.ScalingStateManager(ss.DelayedScaling()))
assert type(net[0]).__name__ == "Experts", type(net[0])
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_compiled_mixtral_is_one_graph_for_every_routing() -> None:
    """A converted Mixtral under torch.compile(fullgraph=True): its experts keep the group sizes on the
    device, so three steps of new routings run one compiled graph, with the eager model's losses and
    scaling state, bitwise."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def run(compiled: bool) -> tuple[list, int]:
        torch._dynamo.reset()
        model = tiny("mixtral")
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        ss.nn.convert(model, manager)
        counter = CompileCounterWithBackend("aot_eager")
        forward = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        out: list = []
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
            with manager.forward():
                loss = forward(input_ids=ids, labels=ids).loss
            with manager.backward():
                loss.backward()
            out.append(loss.detach())
            opt.step()
            opt.zero_grad()
            manager.step()
            out.append(manager.state_dict())
        return out, counter.frame_count

    (got, frames), (want, _) = run(True), run(False)
    assert frames == 1
    assert_same(got, want, name="compiled Mixtral vs eager")
