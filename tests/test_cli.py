"""The scalestate command and its demo."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scalestate as ss
from scalestate.cli import main
from scalestate.demo.data import corpus, decode, encode
from scalestate.demo.progress import Progress
from scalestate.demo.run import compare
from scalestate.demo.train import RECIPE_NAMES, DemoConfig, high_precision_ends, train

TINY = ["--steps", "3", "--microbatches", "2", "--microbatch-size", "2", "--seq-len", "16",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--quiet"]


class TestDemo:
    @pytest.mark.parametrize(
        ("recipe", "backend"),
        [
            ("delayed", "emulation"), ("delayed", "scaled_mm"),
            ("current", "emulation"), ("current", "scaled_mm"),
            ("rowwise", "emulation"), ("rowwise", "scaled_mm"),  # torch's CPU scaled_mm takes row-wise scales
            ("block", "emulation"), ("mxfp8", "emulation"), ("nvfp4", "emulation"),
        ],
    )
    def test_tiny_run_reports_bitwise_parity(self, capsys, recipe, backend):
        """A tiny demo runs all three trainings and reports bitwise equality."""
        assert main(["demo", *TINY, "--recipe", recipe, "--backend", backend]) == 0
        out = capsys.readouterr().out
        low = "NVFP4" if recipe == "nvfp4" else "FP8"
        for line in ("fp32", "fp8 + checkpointing", "fp8, no checkpointing", f"{low} vs fp32"):
            assert line in out
        assert out.count("EQUAL") == 4 and "DIFFERENT" not in out and "OK:" in out

    @pytest.mark.parametrize(
        ("recipe", "names"),
        [
            ("delayed", ("DelayedScaling(history_len=16",)),
            ("current", ("CurrentScaling(",)),
            ("rowwise", ("RowwiseScaling(", "one scale per row")),
            ("mxfp8", ("MXFP8Scaling(", "one E8M0 power of two per 32 elements")),
            ("nvfp4", ("NVFP4Scaling(", "one E4M3 scale per 16 elements", "kept:    head in high precision")),
        ],
    )
    def test_report_names_the_recipe_and_its_scales(self, capsys, recipe, names):
        """The report's header names the recipe, and for fine-grained ones where their scales lie."""
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", recipe]) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in names)
        assert ("  scales:  " in out) == (recipe not in ("delayed", "current"))

    def test_header_and_loss_window(self, capsys):
        """The header shows the format as code; the loss table says how many steps each mark averages,
        never more than lie between two marks."""
        assert main(["demo", *TINY, "--steps", "8", "--no-fp32"]) == 0
        out = capsys.readouterr().out
        assert "format=Format.HYBRID," in out and "<Format" not in out
        assert "step 2" in out and "step 4" in out and "(mean of the 2 steps up to each mark)" in out
        assert main(["demo", *TINY, "--no-fp32"]) == 0  # 3 steps: marks 1, 2, 3
        assert "(the loss at each mark)" in capsys.readouterr().out

    def test_block_size_follows_the_model_width(self, capsys):
        """--recipe block on a model narrower than 128 uses the largest power of two that fits,
        and says so; --block overrides it."""
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", "block"]) == 0
        out = capsys.readouterr().out
        assert "BlockScaling(format=Format.E4M3, block=32, power_of_2=True)" in out
        assert "1 x 32 tiles (inputs, output gradients), 32 x 32 blocks (weights); 32, not 128: --d-model is 32" in out
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", "block", "--block", "16"]) == 0
        out = capsys.readouterr().out
        assert "block=16," in out and "1 x 16 tiles" in out and "not 128" not in out

    def test_nvfp4_keeps_the_ends_in_high_precision(self):
        """The NVFP4 demo converts every layer but the first block's and the head (only the head at depth 1)."""
        cfg = DemoConfig(steps=1, microbatches=1, microbatch_size=2, seq_len=16, d_model=32, n_layers=3,
                         n_heads=2, recipe="nvfp4")
        run = train(cfg, fp8=True, checkpoint=False, label="nvfp4", show_progress=False)
        assert run.scaling is not None
        names = {name for name, _ in run.scaling["slots"]}
        assert names == {f"blocks.{b}.{layer}" for b in (1, 2) for layer in ("qkv", "proj", "fc1", "fc2")}
        keep = high_precision_ends(1)
        assert not keep("head", torch.nn.Linear(1, 1)) and keep("blocks.0.qkv", torch.nn.Linear(1, 1))

    def test_make_recipe(self):
        """Each --recipe name makes its recipe; the block edge is 128 unless the model is narrower."""
        made = {name: type(DemoConfig(recipe=name).make_recipe()) for name in RECIPE_NAMES}
        assert made == {
            "delayed": ss.DelayedScaling, "current": ss.CurrentScaling, "rowwise": ss.RowwiseScaling,
            "block": ss.BlockScaling, "mxfp8": ss.MXFP8Scaling, "nvfp4": ss.NVFP4Scaling,
        }
        widths = {128: 128, 512: 128, 96: 64, 64: 64, 32: 32, 1: 1}
        for d_model, block in widths.items():
            assert DemoConfig(recipe="block", d_model=d_model).make_recipe() == ss.BlockScaling(block=block)
        assert DemoConfig(recipe="block", d_model=32, block=8).make_recipe() == ss.BlockScaling(block=8)
        assert DemoConfig(recipe="delayed", history_len=4).make_recipe() == ss.DelayedScaling(history_len=4)

    def test_data_parallel_ranks_report_identical_state(self, capfd):
        """--ranks 2: DDP on gloo; the report says every rank holds the same state."""
        assert main(["demo", *TINY, "--ranks", "2", "--no-fp32"]) == 0
        out = capfd.readouterr().out
        assert "ranks:   2 (DistributedDataParallel, gloo)" in out
        assert out.count("IDENTICAL on every rank") == 4 and "DIFFERENT" not in out
        assert out.count("EQUAL") == 4 and "same scaling state" in out

    def test_under_torchrun(self, tmp_path):
        """The README's torchrun command: the ranks come from the environment."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "scalestate", "demo", *TINY, "--no-fp32"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
        # from elsewhere than the source tree, so that "-m scalestate" is the installed package
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.count("IDENTICAL on every rank") == 4 and out.stdout.count("scalestate demo:") == 1

    def test_bad_ranks(self):
        with pytest.raises(SystemExit, match="--ranks must be >= 1"):
            main(["demo", *TINY, "--ranks", "0"])

    def test_bad_backend(self, capsys):
        """An unknown backend is a clean error listing the registered ones, exit 2."""
        assert main(["demo", *TINY, "--backend", "nope"]) == 2
        assert "emulation" in capsys.readouterr().err

    def test_bad_size(self):
        """Sizes are validated with the flag's name."""
        with pytest.raises(SystemExit, match="--heads"):
            main(["demo", *TINY, "--d-model", "30", "--heads", "4"])
        with pytest.raises(SystemExit, match="--block must be >= 1; got 0"):
            main(["demo", *TINY, "--recipe", "block", "--block", "0"])

    def test_bad_recipe(self, capsys):
        """An unknown --recipe is a usage error that lists the six."""
        with pytest.raises(SystemExit) as exc:
            main(["demo", *TINY, "--recipe", "tensorwise"])
        assert exc.value.code == 2
        assert "delayed, current, rowwise, block, mxfp8, nvfp4" in capsys.readouterr().err.replace("'", "")

    def test_compare_detects_difference(self):
        """The report's comparison is bitwise: one changed bit in one parameter is DIFFERENT."""
        cfg = DemoConfig(steps=2, microbatches=2, microbatch_size=2, seq_len=16, d_model=32, n_layers=1, n_heads=2)
        a = train(cfg, fp8=True, checkpoint=False, label="a", show_progress=False)
        b = train(cfg, fp8=True, checkpoint=False, label="b", show_progress=False)
        assert all(compare(a, b).values())
        name = next(iter(b.params))
        p = b.params[name].view(-1)
        p[0] = torch.nextafter(p[0], torch.tensor(float("inf")))
        assert not compare(a, b)["parameters"]


class TestCorpus:
    def test_real_text(self):
        """The corpus is real English text from the standard library, reproducible."""
        text = corpus()
        assert len(text) > 100_000 and text == corpus()
        assert "Text wrapping and filling" in text

    def test_bytes_round_trip(self):
        """Encoding is UTF-8 bytes, decoding inverts it."""
        assert decode(encode("naïve café")) == "naïve café"


class TestEntryPoints:
    def _env(self):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return env

    def test_module_help(self, tmp_path):
        """python -m scalestate demo --help documents every flag."""
        out = subprocess.run(
            [sys.executable, "-m", "scalestate", "demo", "--help"],
            capture_output=True, text=True, cwd=tmp_path, env=self._env(), check=True,
        ).stdout
        for flag in ("--steps", "--d-model", "--layers", "--backend", "--recipe", "--microbatches", "--block"):
            assert flag in out
        assert "{delayed,current,rowwise,block,mxfp8,nvfp4}" in out

    def test_console_script(self, tmp_path):
        """The installed 'scalestate' command exists and answers --help."""
        script = Path(sys.executable).with_name("scalestate")
        assert script.exists(), f"no console script next to {sys.executable}; is scalestate installed?"
        out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, check=True)
        assert "demo" in out.stdout


def _saved_state(recipe: ss.Recipe, steps: int = 3) -> dict:
    """A manager's state after a few steps of a small model, with one slot never run in training."""
    torch.manual_seed(0)
    m = ss.ScalingStateManager(recipe, backend="emulation")
    model = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), m)
    m.register("idle", roles=(ss.Role.INPUT,))  # never cast: flagged no-amax
    for step in range(steps):
        with m.forward():
            loss = model(torch.randn(4, 32) * (step + 1)).square().mean()
        with m.backward():
            loss.backward()
        m.step()
    return m.state_dict()


class TestInspect:
    def _run(self, capsys, *argv: str) -> tuple[int, str, str]:
        code = main(["inspect", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    def test_every_recipe_plain_file(self, capsys, tmp_path, recipe):
        """A file holding a manager state: one table row per slot, the recipe and step in the header."""
        sd = _saved_state(recipe)
        torch.save(sd, tmp_path / "s.pt")
        code, out, err = self._run(capsys, str(tmp_path / "s.pt"))
        assert code == 0 and err == ""
        assert f"{type(recipe).__name__}(" in out and "step 3, 7 slots" in out
        rows = [line for line in out.splitlines() if line.startswith("│")]
        assert len(rows) == len(sd["slots"]) == 7
        idle = next(r for r in rows if "idle" in r)
        assert "no-amax" in idle and "no-amax: no amax recorded" in out

    def test_nested_dict_found_by_itself(self, capsys, tmp_path):
        """A training checkpoint holding the state deep inside: found without --key, path shown."""
        scaling = _saved_state(ss.DelayedScaling())
        ckpt = {"model": {"w": torch.ones(2)}, "trainer": {"extra": [1, 2], "scaling": scaling}}
        torch.save(ckpt, tmp_path / "c.pt")
        code, out, _ = self._run(capsys, str(tmp_path / "c.pt"))
        assert code == 0 and "[trainer.scaling]" in out and "low-headroom" in out

    def test_ambiguity_names_keys_and_key_selects(self, capsys, tmp_path):
        """Two states: an error naming both paths and --key; --key (dotted, list index) picks one."""
        a, b = _saved_state(ss.DelayedScaling()), _saved_state(ss.CurrentScaling())
        torch.save({"a": a, "runs": [b]}, tmp_path / "two.pt")
        code, out, err = self._run(capsys, str(tmp_path / "two.pt"))
        assert code == 1 and out == ""
        assert "found 2 scalestate manager states, at 'a', 'runs.0'; choose one with --key" in err
        code, out, _ = self._run(capsys, str(tmp_path / "two.pt"), "--key", "runs.0")
        assert code == 0 and "CurrentScaling(" in out
        code, _, err = self._run(capsys, str(tmp_path / "two.pt"), "--key", "runs.1")
        assert code == 1 and "--key 'runs.1': no '1' under 'runs'" in err
        code, _, err = self._run(capsys, str(tmp_path / "two.pt"), "--key", "a.slots")
        assert code == 1 and "not a scalestate manager state" in err

    def test_bad_files(self, capsys, tmp_path):
        """Missing, garbage, no state inside, corrupt state, untrusted pickle: one line on stderr, status 1."""
        (tmp_path / "garbage.pt").write_text("not a checkpoint")
        torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "none.pt")
        corrupt = _saved_state(ss.DelayedScaling())
        corrupt["scale"][0] = float("nan")
        torch.save(corrupt, tmp_path / "corrupt.pt")
        torch.save({"args": argparse.Namespace(lr=1.0), "fp8": _saved_state(ss.DelayedScaling())}, tmp_path / "ns.pt")
        cases = {
            "missing.pt": "no such file",
            "garbage.pt": "not a file saved by torch.save",
            "none.pt": "no scalestate manager state found in a dict with keys ['model']",
            "corrupt.pt": "scale[",
            "ns.pt": "argparse.Namespace",
        }
        for name, message in cases.items():
            code, out, err = self._run(capsys, str(tmp_path / name))
            assert code == 1 and out == "" and message in err, (name, err)
            assert "Traceback" not in err and err.count("\n") == 1
        code, out, _ = self._run(capsys, str(tmp_path / "ns.pt"), "--unsafe-load")
        assert code == 0 and "[fp8]" in out

    def test_truncated_and_empty_files_say_so(self, capsys, tmp_path):
        """A checkpoint cut short at any point, or empty, is called truncated: one line, status 1."""
        torch.save({"fp8": _saved_state(ss.DelayedScaling()), "w": torch.randn(64, 64)}, tmp_path / "full.pt")
        data = (tmp_path / "full.pt").read_bytes()
        for cut in (0, 10, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1):
            (tmp_path / "cut.pt").write_bytes(data[:cut])
            code, out, err = self._run(capsys, str(tmp_path / "cut.pt"))
            assert code == 1 and out == "" and err.count("\n") == 1, (cut, err)
            assert ("is empty" if cut == 0 else "is truncated") in err and "Traceback" not in err, (cut, err)
            assert "Errno" not in err and "torch.load cannot read it" not in err, err

    def test_unreadable_format_version_is_named(self, capsys, tmp_path):
        """A state of a format version this scalestate does not read: the version found and those read."""
        for version, hint in ((99, "saved by a newer scalestate"), (0, "the state is corrupt")):
            torch.save({"fp8": {**_saved_state(ss.DelayedScaling()), "format_version": version}}, tmp_path / "v.pt")
            code, out, err = self._run(capsys, str(tmp_path / "v.pt"))
            assert code == 1 and out == ""
            assert f"format_version {version}; this scalestate reads 1, 2 and 3" in err and hint in err, err

    def test_a_state_with_a_key_missing_is_found_and_named(self, capsys, tmp_path):
        """A state lacking a key is a corrupt state (the key named), not 'no state found'."""
        sd = _saved_state(ss.DelayedScaling())
        del sd["scale"]
        torch.save({"fp8": sd}, tmp_path / "s.pt")
        code, _, err = self._run(capsys, str(tmp_path / "s.pt"))
        assert code == 1 and "lacks key(s) ['scale']" in err

    def test_state_without_slots(self, capsys, tmp_path):
        """A manager that registered nothing: a line saying so, status 0 (also with --check); plot draws it."""
        torch.save(ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation").state_dict(), tmp_path / "e.pt")
        code, out, err = self._run(capsys, str(tmp_path / "e.pt"), "--check")
        assert code == 0 and err == "" and "0 slots" in out and "no slots" in out and "0 of 0 slots flagged" in out
        assert main(["plot", str(tmp_path / "e.pt"), "-o", str(tmp_path / "e.png")]) == 0
        assert "0 of 0 slot names" in capsys.readouterr().out and (tmp_path / "e.png").stat().st_size > 0

    def test_forgotten_step_is_flagged(self, capsys, tmp_path):
        """A state saved after training passes but no step(): no-step on the slots that recorded, --check fails."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.Linear(8, 8, manager=m)
        for _ in range(3):
            with m.forward():
                loss = layer(torch.randn(4, 8)).sum()
            with m.backward():
                loss.backward()
        torch.save(m.state_dict(), tmp_path / "s.pt")
        code, out, _ = self._run(capsys, str(tmp_path / "s.pt"), "--check")
        assert code == 3 and "step 0" in out and out.count("no-step") == 3 + 1  # 3 rows and the legend
        assert "no-step: casts were recorded but manager.step() never ran" in out

    def test_a_healthy_run_of_the_demo_recipe_passes_check(self, capsys, tmp_path):
        """The demo's recipe (delayed, history 16, margin 0) on a small demo run: nothing flagged, --check 0,
        though most slots have under 1 bit of headroom (what low-headroom once fired on)."""
        cfg = DemoConfig(steps=20, microbatches=2, microbatch_size=4, seq_len=16, d_model=32, n_layers=2, n_heads=2)
        assert cfg.make_recipe() == ss.DelayedScaling(history_len=16)
        run = train(cfg, fp8=True, checkpoint=False, label="fp8", show_progress=False)
        torch.save({"model": run.params, "fp8": run.scaling}, tmp_path / "ckpt.pt")
        stats = ss.stats_from_state_dict(run.scaling)
        assert len([s for s in stats.slots() if s.headroom_bits < 1]) > len(stats.slots()) // 2
        code, out, _ = self._run(capsys, str(tmp_path / "ckpt.pt"), "--check")
        assert code == 0 and f"0 of {len(stats.slots())} slots flagged" in out

    def test_check_flag_sets_status(self, capsys, tmp_path):
        """--check: status 3 when a slot is flagged."""
        torch.save(_saved_state(ss.DelayedScaling()), tmp_path / "s.pt")
        code, out, _ = self._run(capsys, str(tmp_path / "s.pt"), "--check")
        assert code == 3 and "slots flagged" in out

    def test_names_with_brackets_are_shown_verbatim(self, capsys, tmp_path):
        """Slot names are text, not rich markup."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        m.register("layers[bold]0", roles=(ss.Role.INPUT,))
        torch.save(m.state_dict(), tmp_path / "s.pt")
        _, out, _ = self._run(capsys, str(tmp_path / "s.pt"))
        assert "layers[bold]0" in out


class TestPlot:
    def test_png_size_and_content(self, capsys, tmp_path):
        """The PNG opens and is 1200 x 100 * (1 + 2 * names) pixels (3 names: 2 layers and the idle slot)."""
        import matplotlib.image

        torch.save({"fp8": _saved_state(ss.DelayedScaling())}, tmp_path / "s.pt")
        assert main(["plot", str(tmp_path / "s.pt"), "-o", str(tmp_path / "amax.png")]) == 0
        assert "3 of 3 slot names" in capsys.readouterr().out
        image = matplotlib.image.imread(tmp_path / "amax.png")
        assert image.shape[:2] == (700, 1200) and image.std() > 0

    def test_capped_with_a_note(self, capsys, tmp_path):
        """--max-slots caps the rows (flagged names first) and says how many were left out."""
        torch.save(_saved_state(ss.MXFP8Scaling()), tmp_path / "s.pt")
        out_png = tmp_path / "a.png"
        assert main(["plot", str(tmp_path / "s.pt"), "-o", str(out_png), "--max-slots", "1", "--dpi", "50"]) == 0
        assert "1 of 3 slot names (2 left out: --max-slots)" in capsys.readouterr().out
        import matplotlib.image

        assert matplotlib.image.imread(out_png).shape[:2] == (150, 600)

    def test_missing_matplotlib_names_the_extra(self, capsys, tmp_path, monkeypatch):
        """Without matplotlib: status 1 and the extra to install."""
        torch.save(_saved_state(ss.DelayedScaling()), tmp_path / "s.pt")
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        assert main(["plot", str(tmp_path / "s.pt"), "-o", str(tmp_path / "a.png")]) == 1
        err = capsys.readouterr().err  # said once, not "scalestate plot: scalestate plot needs ..."
        needs = 'drawing needs matplotlib, which is not installed: pip install "scalestate[plot]"'
        assert err == f"scalestate plot: {needs}\n"


class TestProgress:
    def test_plain_lines_every_tenth_when_not_a_terminal(self):
        """Not a terminal: one plain line per 10% of the run, the last at 100%."""
        stream = io.StringIO()
        with Progress("fp8 run", 200, stream=stream) as progress:
            for i in range(200):
                progress.update(2.0 - i / 200)
        lines = stream.getvalue().splitlines()
        assert not progress.tty and len(lines) == 10
        assert lines[0].startswith("fp8 run") and " 20/200 ( 10%) loss " in lines[0]
        assert "200/200 (100%) loss  1.005" in lines[-1] and "\r" not in stream.getvalue()

    def test_rich_bar_on_a_terminal(self, monkeypatch):
        """On a terminal (forced here), rich draws the bar and leaves it complete."""
        monkeypatch.setenv("FORCE_COLOR", "1")
        monkeypatch.delenv("NO_COLOR", raising=False)
        stream = io.StringIO()
        with Progress("fp8 run", 4, stream=stream) as progress:
            for _ in range(4):
                progress.update(1.5)
        assert progress.tty and "4/4" in stream.getvalue() and "1.500" in stream.getvalue()

    def test_quiet_demo_prints_no_progress(self, capfd):
        """--quiet: the report only."""
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32"]) == 0
        captured = capfd.readouterr()
        assert "loss" in captured.out and "/1 (100%)" not in captured.err + captured.out
