"""scalestate.integrations.transformers: HF models converted, gradient checkpointing, generate, Trainer resume."""

from __future__ import annotations

import copy
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.pytorch_utils import Conv1D as HFConv1D

import scalestate as ss
from scalestate import testing
from scalestate.integrations.transformers import Conv1D, ScalingStateCallback

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
SEQ = 16


def tiny(kind: str) -> torch.nn.Module:
    """A tiny float32 model with no dropout, built from its config (no download)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            attention_dropout=0.0,
        )
        model = LlamaForCausalLM(config)
    config._attn_implementation = "eager"
    return model.float()


def fp8(kind: str) -> tuple[torch.nn.Module, ss.ScalingStateManager]:
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    return ss.nn.convert(tiny(kind), manager), manager


def batches(steps: int, microbatches: int = 2, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(microbatches)] for _ in range(steps)]


def assert_same(a, b, where="state"):
    """Bitwise equality of nested dicts/lists of tensors and plain values (:func:`scalestate.testing.assert_same`)."""
    testing.assert_same(a, b, name=where)


def snapshot(model: torch.nn.Module, manager: ss.ScalingStateManager) -> dict:
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "iteration": manager.iteration,
        "manager": copy.deepcopy(manager.state_dict()),
        "histories": {name: [h.amax_history(r) for r in h.roles] for name, h in manager.handles.items()},
    }


def train_steps(model, manager, opt, data, losses):
    """The documented loop: phases as blocks, 2 microbatches per optimizer step."""
    model.train()
    for step in data:
        for ids in step:
            with manager.forward():
                loss = model(input_ids=ids, labels=ids).loss
            with manager.backward():
                (loss / len(step)).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()


def run(kind: str, reentrant: bool | None, steps: int = 6) -> tuple[list[torch.Tensor], dict]:
    model, manager = fp8(kind)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[torch.Tensor] = []
    train_steps(model, manager, opt, batches(steps), losses)
    return losses, snapshot(model, manager)


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, tuple[list[torch.Tensor], dict]]:
    """The reference runs, without checkpointing (shared by the parametrized tests)."""
    return {kind: run(kind, None) for kind in ("gpt2", "llama")}


class TestConvertModels:
    @pytest.mark.parametrize("kind", ["gpt2", "llama"])
    def test_every_layer_converted(self, kind):
        """GPT-2: every Conv1D and the lm_head; Llama: every Linear; state_dict keys and shapes unchanged."""
        model = tiny(kind)
        shapes = {key: value.shape for key, value in model.state_dict().items()}
        params = list(model.parameters())
        manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        ss.nn.convert(model, manager)
        assert {key: value.shape for key, value in model.state_dict().items()} == shapes
        assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
        left = [name for name, m in model.named_modules() if type(m) in (HFConv1D, torch.nn.Linear)]
        assert not left
        per_block = 4 if kind == "gpt2" else 7
        assert len(manager.handles) == 2 * per_block + 1 and "lm_head" in manager.handles
        if kind == "gpt2":
            assert isinstance(model.transformer.h[0].attn.c_attn, Conv1D)
            assert model.lm_head.weight is model.transformer.wte.weight  # still tied

    @pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
    @pytest.mark.parametrize("kind", ["gpt2", "llama"])
    def test_gradient_checkpointing_bitwise(self, kind, reentrant, plain_runs):
        """With HF gradient checkpointing, every loss, parameter and the scaling state equal the plain run, bitwise,
        over 6 optimizer steps of 2 microbatches."""
        losses, state = run(kind, reentrant)
        ref_losses, ref_state = plain_runs[kind]
        assert len(losses) == 12
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
        assert_same(state, ref_state)
        assert state["iteration"] == 6
        assert any(h[0][-1] > 0 for h in state["histories"].values())  # histories really recorded


class TestNotTraining:
    @pytest.mark.parametrize("kind", ["gpt2", "llama"])
    def test_generate_and_no_grad_record_nothing(self, kind):
        """generate() and a torch.no_grad() validation pass in train mode with gradient checkpointing on record
        nothing, and the next training step is bitwise that of a run without them."""
        data = batches(3)

        def go(with_eval: bool):
            model, manager = fp8(kind)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses: list[torch.Tensor] = []
            train_steps(model, manager, opt, data[:2], losses)
            if with_eval:
                before = snapshot(model, manager)
                assert model.training
                out = model.generate(data[0][0][:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
                assert out.shape == (2, 8)
                with torch.no_grad():
                    model(input_ids=data[0][1], labels=data[0][1])
                assert model.training
                assert_same(snapshot(model, manager), before)
            train_steps(model, manager, opt, data[2:], losses)
            return losses, snapshot(model, manager)

        plain_losses, plain = go(False)
        losses, state = go(True)
        assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
        assert_same(state, plain)


def dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=gen) for _ in range(n)]
    return [{"input_ids": row, "labels": row} for row in rows]


def trainer(out: Path, manager, model, *, max_steps: int = 4, **extra) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False}, **extra,
    )
    return Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[ScalingStateCallback(manager)])


class TestTrainerCallback:
    def test_resume_is_bitwise(self, tmp_path):
        """Trainer with gradient accumulation 2: the manager steps once per optimizer step, its state is saved
        in each checkpoint, and a fresh Trainer resumed from the middle one ends bitwise where the
        uninterrupted run ended."""
        model, manager = fp8("gpt2")
        trainer(tmp_path, manager, model).train()
        assert manager.iteration == 4
        whole = snapshot(model, manager)
        for step in (2, 4):
            saved = torch.load(tmp_path / f"checkpoint-{step}" / "scalestate.pt", weights_only=True)
            assert saved["iteration"] == step and saved["global_step"] == step
        model2, manager2 = fp8("gpt2")
        trainer(tmp_path, manager2, model2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
        assert manager2.iteration == 4
        assert_same(snapshot(model2, manager2), whole)

    def test_resume_from_folder_outside_output_dir(self, tmp_path):
        """A checkpoint copied elsewhere is found through TrainingArguments(resume_from_checkpoint=...);
        without it, a clear error."""
        import shutil

        model, manager = fp8("gpt2")
        trainer(tmp_path / "a", manager, model, max_steps=2).train()
        moved = shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "moved")
        model2, manager2 = fp8("gpt2")
        with pytest.raises(ss.errors.StateDictError, match=r"cannot find the scaling state .*resume_from_checkpoint"):
            trainer(tmp_path / "b", manager2, model2).train(resume_from_checkpoint=str(moved))
        model3, manager3 = fp8("gpt2")
        trainer(tmp_path / "b", manager3, model3, resume_from_checkpoint=str(moved)).train(
            resume_from_checkpoint=str(moved)
        )
        assert manager3.iteration == 4

    def test_other_runs_state_refused(self, tmp_path):
        """A state file of another run at the same step is not loaded."""
        model, manager = fp8("gpt2")
        trainer(tmp_path / "a", manager, model, max_steps=2).train()
        other, other_manager = fp8("gpt2")
        trainer(tmp_path / "b", other_manager, other, max_steps=2).train()
        (tmp_path / "b" / "checkpoint-2" / "scalestate.pt").replace(tmp_path / "a" / "checkpoint-2" / "scalestate.pt")
        model2, manager2 = fp8("gpt2")
        with pytest.raises(ss.errors.StateDictError, match="saved by another run"):
            trainer(tmp_path / "a", manager2, model2).train(resume_from_checkpoint=True)

    def test_checkpoint_without_callback(self, tmp_path):
        """Resuming a checkpoint saved without the callback: an error naming restore=False, which goes on."""
        model = tiny("gpt2")
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, save_steps=2,
            report_to=[], use_cpu=True, disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=dataset()).train()
        model2, manager2 = fp8("gpt2")
        with pytest.raises(ss.errors.StateDictError, match=r"saved without ScalingStateCallback.*restore=False"):
            trainer(tmp_path, manager2, model2).train(resume_from_checkpoint=True)
        args.max_steps = 3
        callback = ScalingStateCallback(manager2, restore=False)
        Trainer(model=model2, args=args, train_dataset=dataset(), callbacks=[callback]).train(
            resume_from_checkpoint=True
        )
        assert manager2.iteration == 1

    def test_bad_arguments(self, delayed):
        """The callback names a wrong manager or restore flag."""
        with pytest.raises(TypeError, match="needs a ScalingStateManager; got str"):
            ScalingStateCallback("manager")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="restore must be True or False"):
            ScalingStateCallback(delayed, restore="yes")  # type: ignore[arg-type]

    def test_state_file_per_process(self):
        """One process: scalestate.pt; several: one file per process index."""
        single = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
        assert ScalingStateCallback.state_file_name(single) == "scalestate.pt"

        class TwoRanks:
            world_size = 2
            process_index = 1

        assert ScalingStateCallback.state_file_name(TwoRanks()) == "scalestate_1.pt"  # type: ignore[arg-type]


def _fsdp_conv1d(rank: int, world: int) -> dict:
    """GPT-2-style Conv1D layers under FSDP2, with and without the FP8 all-gather: losses, grads-moved
    weights and scaling state, and the type of the unsharded weight the layer saw."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for fp8_gather in (False, True):
        manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        torch.manual_seed(0)
        model = torch.nn.Sequential(HFConv1D(24, 16), torch.nn.ReLU(), HFConv1D(6, 24))
        ss.nn.convert(model, manager, fp8_all_gather=fp8_gather)
        seen: list[str] = []
        model[0].register_forward_pre_hook(lambda module, args, seen=seen: seen.append(type(module.weight).__name__))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            for micro in range(2):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                loss = model(x * (1 + step)).square().mean()
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            manager.step()
        out[fp8_gather] = {"losses": losses, "state": manager.state_dict(), "seen": seen[0]}
    return out


def test_conv1d_fp8_all_gather_under_fsdp2():
    """FSDP2 with fp8_all_gather=True gathers the Conv1D weight in FP8 and trains bitwise as without it."""
    from dist_harness import run_ranks

    for rank_out in run_ranks(_fsdp_conv1d, 2, timeout=120.0):
        plain, gathered = rank_out[False], rank_out[True]
        assert gathered["seen"] == "GatheredFP8Weight" and plain["seen"] != "GatheredFP8Weight"
        assert all(torch.equal(a, b) for a, b in zip(plain["losses"], gathered["losses"], strict=True))
        assert_same(plain["state"], gathered["state"])


def test_missing_extra_names_it(monkeypatch):
    """Without transformers, importing the integration is an ImportError naming the extra."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "scalestate.integrations.transformers")
    with pytest.raises(ImportError, match=re.escape('pip install "scalestate[transformers]"')):
        importlib.import_module("scalestate.integrations.transformers")


def test_core_never_imports_transformers_and_registers_conv1d_lazily(tmp_path):
    """import scalestate and convert() leave transformers alone; once the program imports it, convert()
    converts its Conv1D without the integration being imported by hand."""
    script = """
import sys, torch, scalestate as ss
m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), m)
assert "transformers" not in sys.modules, "core imported transformers"
from transformers.pytorch_utils import Conv1D
assert "scalestate.integrations.transformers" not in sys.modules
net = ss.nn.convert(torch.nn.Sequential(Conv1D(4, 4)), ss.ScalingStateManager(ss.DelayedScaling()))
assert type(net[0]).__module__ == "scalestate.integrations.transformers", type(net[0])
print("ok")
"""
    # cwd outside the source tree: `python -c` puts the cwd first on sys.path, and the source tree's
    # scalestate/ lacks scalestate.backends (installed from backends/)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_docs_example_runs(tmp_path, monkeypatch):
    """docs/integrations/transformers.md: its example runs as written, saving the state in each checkpoint."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "integrations" / "transformers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(blocks[0], "transformers.md", "exec"), namespace)
    assert namespace["manager"].iteration == 4
    assert (tmp_path / "out" / "checkpoint-4" / "scalestate.pt").exists()


def test_docs_registration_example_runs():
    """docs/integrations/transformers.md: the register_conversion example converts the user's type."""
    text = (ROOT / "docs" / "integrations" / "transformers.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[1]
    namespace: dict = {}
    try:
        exec(compile(block, "transformers.md", "exec"), namespace)
        model, manager = namespace["model"], namespace["manager"]
        assert type(model[0]).__name__ == "FP8Doubled" and list(manager.handles) == ["0", "1"]
        x = torch.randn(4, 8)
        ref = ss.ScalingStateManager(ss.DelayedScaling(), backend=manager.backend)
        assert torch.equal(model[0](x), 2 * ss.nn.linear(x, model[0].weight, None, ref.register("r", tuple(ss.Role))))
    finally:
        if "Doubled" in namespace:
            ss.nn.unregister_conversion(namespace["Doubled"])
