"""The README's and docs' code examples run, and the API reference lists every public name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import scalestate as ss
from helpers import assert_bitwise, train
from scalestate import sac, testing

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


class TestReadme:
    def test_training_loop(self, tmp_path, monkeypatch):
        """The README's training loop runs as written (with a small model and loader)."""
        monkeypatch.chdir(tmp_path)
        loop = _python_blocks(ROOT / "README.md")[0]

        microbatches = []

        class MyTransformer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

            def forward(self, x):
                microbatches.append(len(x))
                return self.net(x).square().mean()

        namespace = {"MyTransformer": MyTransformer, "loader": [torch.randn(8, 16) for _ in range(3)]}
        exec(compile(loop, "README.md", "exec"), namespace)
        assert namespace["manager"].iteration == 3
        assert microbatches == [2] * 12  # "4 microbatches" per batch of 8 rows: chunks, not splits of 4 rows
        assert (tmp_path / "ckpt.pt").exists()

    def test_module_library_example(self):
        """The README's third-party module delegates correctly: checkpointing parity and recorded state."""
        namespace: dict = {}
        exec(compile(_python_blocks(ROOT / "README.md")[1], "README.md", "exec"), namespace)
        MyFP8Linear = namespace["MyFP8Linear"]

        def run(checkpoint: bool):
            m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
            torch.manual_seed(0)
            layer = MyFP8Linear(m, "mine", 32, 16)
            opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            outs = []
            for step in range(4):
                x = torch.randn(8, 32) * (step + 1)
                with m.forward():
                    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpoint else layer(x)
                with m.backward():
                    y.square().mean().backward()
                opt.step()
                opt.zero_grad()
                m.step()
                outs.append((y.detach(), layer.weight.detach().clone(), m.state_dict()["amax_history"]))
            return outs

        for a, b in zip(run(False), run(True), strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
        assert bool((run(False)[-1][2][:, -1] > 0).all())


    def test_compile_loop(self):
        """The README's torch.compile loop runs as written and trains the scaling state."""
        block = next(b for b in _python_blocks(ROOT / "README.md") if "torch.compile(model)" in b)
        manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        model = ss.nn.convert(
            torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 1)), manager
        )
        loss_model = torch.nn.Sequential(model, _MeanSquare())
        namespace = {
            "torch": torch, "model": loss_model, "manager": manager,
            "opt": torch.optim.SGD(loss_model.parameters(), lr=0.01),
            "loader": [torch.randn(8, 16) for _ in range(3)],
        }
        torch._dynamo.reset()
        exec(compile(block, "README.md", "exec"), namespace)
        assert manager.iteration == 3 and bool((manager.state_dict()["amax_history"][:, -1] > 0).all())

    def test_module_library_example_compiles(self):
        """The README's third-party module compiles with fullgraph=True and matches eager bitwise."""
        namespace: dict = {}
        exec(compile(_python_blocks(ROOT / "README.md")[1], "README.md", "exec"), namespace)

        def run(compiled: bool):
            m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
            torch.manual_seed(0)
            layer = namespace["MyFP8Linear"](m, "mine", 32, 16)
            call = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
            for step in range(3):
                with m.forward():
                    y = call(torch.randn(8, 32) * (step + 1))
                with m.backward():
                    y.square().mean().backward()
                m.step()
            return m.state_dict(), layer.weight.grad

        torch._dynamo.reset()
        (want, want_grad), (got, got_grad) = run(False), run(True)
        assert torch.equal(want["amax_history"], got["amax_history"]) and torch.equal(want["scale"], got["scale"])
        assert torch.equal(want_grad, got_grad)


    def test_integration_examples(self, tmp_path, monkeypatch):
        """The README's torchao and transformers snippets run as written on small models."""
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        from transformers.pytorch_utils import Conv1D

        monkeypatch.chdir(tmp_path)
        blocks = _python_blocks(ROOT / "README.md")
        torchao_block = next(b for b in blocks if "convert_to_float8_training" in b)
        hf_block = next(b for b in blocks if "ScalingStateCallback" in b)

        torch.manual_seed(0)
        ns: dict = {"ss": ss, "model": torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))}
        exec(compile(torchao_block, "README.md", "exec"), ns)
        ns["model"](torch.randn(8, 32)).square().mean().backward()
        assert set(ns["manager"].handles) == {"0", "1"}
        assert all(type(layer).__name__ == "ManagedFloat8Linear" for layer in ns["model"])

        config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": row, "labels": row} for row in ids]
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no")
        ns = {"ss": ss, "model": model, "args": args, "data": data, "Trainer": Trainer,
              "manager": ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")}
        exec(compile(hf_block, "README.md", "exec"), ns)
        assert ns["manager"].iteration == 2
        assert not any(type(m) is Conv1D for m in model.modules())  # every Conv1D became an FP8 one


class _MeanSquare(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()


class TestBackendsPage:
    def test_worked_backend(self):
        """docs/backends.md's third-party backend, written from the interface alone, trains
        bit for bit like the emulation backend (checkpointing and microbatches included)."""
        block = next(b for b in _python_blocks(ROOT / "docs" / "backends.md") if "class MyBackend" in b)
        exec(compile(block, "backends.md", "exec"), {})
        try:
            assert ss.backends.get_backend("mine").name == "mine"
            for recipe in (ss.DelayedScaling(history_len=4), ss.CurrentScaling()):
                mine = train(recipe, "mine", mechanism="non_reentrant", granularity="block")
                assert_bitwise(train(recipe, "emulation", mechanism="non_reentrant", granularity="block"), mine)
        finally:
            ss.backends.unregister_backend("mine")


class TestIntegrationGuide:
    def test_testing_your_module(self):
        """docs/integrations/custom.md's test of a module library runs as written and checks what it says."""
        page = ROOT / "docs" / "integrations" / "custom.md"
        block = next(b for b in _python_blocks(page) if "from scalestate.testing import" in b)
        namespace: dict = {}
        exec(compile(block, "custom.md", "exec"), namespace)
        assert len(namespace["plain"]) == 5 and len(namespace["spy"].requests) == 4 + 4 * 8


API_PAGES = ROOT / "docs" / "api"


def _directives() -> dict[str, str]:
    """Every `::: identifier` of the generated API reference, with the YAML options block under it."""
    found: dict[str, str] = {}
    for page in sorted(API_PAGES.glob("*.md")):
        for match in re.finditer(r"^::: (\S+)\n((?:[ ]{4}.*\n|\n)*)", page.read_text(), flags=re.M):
            found[match.group(1)] = match.group(2)
    return found


def _covered(module_name: str, name: str, directives: dict[str, str]) -> bool:
    """Whether the reference renders `module_name.name`: a directive of its own, or a directive of
    the module that renders every public member (no `members:` option) or lists it."""
    if f"{module_name}.{name}" in directives:
        return True
    if module_name not in directives:
        return False
    options = directives[module_name]
    listed = re.search(r"members:\s*(.*)", options)
    if listed is None:
        return True
    return re.search(rf"[\[\s,]{re.escape(name)}[\],\s]", listed.group(1) + " ") is not None


class TestApiReference:
    @pytest.mark.parametrize(
        "module_name",
        ["scalestate", "scalestate.nn", "scalestate.backends", "scalestate.errors", "scalestate.testing",
         "scalestate.integrations.torchao", "scalestate.integrations.transformers"],
    )
    def test_every_public_name_is_documented(self, module_name):
        """The generated API reference (docs/api/) renders every name in each public module's __all__."""
        import importlib

        module = importlib.import_module(module_name)
        directives = _directives()
        missing = [name for name in module.__all__ if not _covered(module_name, name, directives)]
        assert not missing, f"docs/api/ has no `::: {module_name}.NAME` directive for {missing}"

    def test_reference_is_generated(self):
        """The reference pages hold directives, not copies of docstrings: each page but the
        overview renders its module, and every directive names a scalestate object."""
        directives = _directives()
        assert all(target.startswith("scalestate") for target in directives)
        for page in API_PAGES.glob("*.md"):
            if page.name != "index.md":
                assert "\n::: " in page.read_text(), f"{page.name} renders nothing"

    def test_coverage_check_can_fail(self):
        """The coverage rule refuses a name that no directive renders."""
        directives = {"scalestate.math": "    options:\n      members: [roll_history]\n"}
        assert _covered("scalestate.math", "roll_history", directives)
        assert not _covered("scalestate.math", "update_scales", directives)
        assert not _covered("scalestate", "Quantized", directives)

    def test_recipes_page_covers_every_recipe(self):
        """docs/recipes.md describes every recipe class and every demo --recipe name, and the
        README and the user guide link to it."""
        from scalestate.demo.train import RECIPE_NAMES
        from scalestate.recipe import RECIPES

        text = (ROOT / "docs" / "recipes.md").read_text()
        missing = [cls.__name__ for cls in RECIPES if f"ss.{cls.__name__}(" not in text]
        assert not missing, f"docs/recipes.md does not describe {missing}"
        assert f"--recipe {'|'.join(RECIPE_NAMES)}" in text
        assert "](docs/recipes.md)" in (ROOT / "README.md").read_text()
        assert "](recipes.md)" in (ROOT / "docs" / "index.md").read_text()

    def test_docs_links_resolve(self):
        """Relative links between the README and docs point at files that exist."""
        for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
            for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


class TestSitePages:
    def test_getting_started_loop(self, tmp_path, monkeypatch):
        """docs/getting-started.md's first training loop runs as written: ten steps, with
        checkpointing and microbatches, trains every slot and saves a checkpoint."""
        monkeypatch.chdir(tmp_path)
        loop = next(b for b in _python_blocks(ROOT / "docs" / "getting-started.md") if "manager.step()" in b)
        namespace: dict = {}
        exec(compile(loop, "getting-started.md", "exec"), namespace)
        manager = namespace["manager"]
        assert manager.iteration == 10 and len(manager.slots) == 6
        assert bool((manager.state_dict()["amax_history"][:, -1] > 0).all())
        assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["fp8"]["iteration"] == 10

    def test_guarantees_page(self):
        """docs/guarantees.md explains the thirteen invariants, and every test it cites exists."""
        text = (ROOT / "docs" / "guarantees.md").read_text()
        headings = re.findall(r"^## (\d+)\. ", text, flags=re.M)
        assert headings == [str(i) for i in range(1, 14)]
        cited = re.findall(r"`(tests/test_\w+\.py)((?:::\w+)*)", text)
        assert len(cited) >= 13
        for path, names in cited:
            source = (ROOT / path).read_text()
            for name in names.split("::")[1:]:
                assert re.search(rf"^\s*(class|def) {name}\b", source, flags=re.M), f"{path} has no {name}"

    def test_every_page_is_in_the_nav(self):
        """mkdocs.yml's nav lists every page under docs/ (and only pages that exist or are
        written by the integrations and tooling)."""
        config = (ROOT / "mkdocs.yml").read_text()
        nav = re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", config, flags=re.M)
        pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
        assert pages <= set(nav), f"pages missing from the nav: {sorted(pages - set(nav))}"
        assert set(nav) <= pages, f"nav entries without a page: {sorted(set(nav) - pages)}"


class TestDocstringExamples:
    @pytest.mark.parametrize(
        "obj",
        [ss, ss.ScalingStateManager, ss.ScalingHandle, ss.Quantized, ss.DelayedScaling, ss.CurrentScaling,
         ss.RowwiseScaling, ss.BlockScaling, ss.MXFP8Scaling,
         ss.nn.Linear, ss.nn.convert, ss.checkpoint, ss.backends.available_backends,
         ss.backends.unregister_backend, sac.hidden_from_sac, testing, testing.assert_same, testing.differences,
         testing.snapshot, testing.sqnr, testing.OpLog, testing.CastSpy, testing.registered_backend,
         testing.Block, testing.TinyLM],
        ids=lambda o: getattr(o, "__name__", str(o)),
    )
    def test_doctest(self, obj):
        """The runnable example in each public docstring runs and prints what it says."""
        import doctest

        finder = doctest.DocTestFinder(recurse=False)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        tests = finder.find(obj, globs={})
        assert tests and any(t.examples for t in tests)
        for t in tests:
            runner.run(t)
        assert runner.failures == 0
