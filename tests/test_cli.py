"""The scalestate command and its demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scalestate as ss
from scalestate.cli import main
from scalestate.demo.data import corpus, decode, encode
from scalestate.demo.run import compare
from scalestate.demo.train import RECIPE_NAMES, DemoConfig, train

TINY = ["--steps", "3", "--microbatches", "2", "--microbatch-size", "2", "--seq-len", "16",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--quiet"]


class TestDemo:
    @pytest.mark.parametrize(
        ("recipe", "backend"),
        [
            ("delayed", "emulation"), ("delayed", "scaled_mm"),
            ("current", "emulation"), ("current", "scaled_mm"),
            ("rowwise", "emulation"), ("rowwise", "scaled_mm"),  # torch's CPU scaled_mm takes row-wise scales
            ("block", "emulation"), ("mxfp8", "emulation"),
        ],
    )
    def test_tiny_run_reports_bitwise_parity(self, capsys, recipe, backend):
        """A tiny demo runs all three trainings and reports bitwise equality."""
        assert main(["demo", *TINY, "--recipe", recipe, "--backend", backend]) == 0
        out = capsys.readouterr().out
        for line in ("fp32", "fp8 + checkpointing", "fp8, no checkpointing", "FP8 vs fp32"):
            assert line in out
        assert out.count("EQUAL") == 4 and "DIFFERENT" not in out and "OK:" in out

    @pytest.mark.parametrize(
        ("recipe", "names"),
        [
            ("delayed", ("DelayedScaling(history_len=16",)),
            ("current", ("CurrentScaling(",)),
            ("rowwise", ("RowwiseScaling(", "one scale per row")),
            ("mxfp8", ("MXFP8Scaling(", "one E8M0 power of two per 32 elements")),
        ],
    )
    def test_report_names_the_recipe_and_its_scales(self, capsys, recipe, names):
        """The report's header names the recipe, and for fine-grained ones where their scales lie."""
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", recipe]) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in names)
        assert ("  scales:  " in out) == (recipe not in ("delayed", "current"))

    def test_block_size_follows_the_model_width(self, capsys):
        """--recipe block on a model narrower than 128 uses the largest power of two that fits,
        and says so; --block overrides it."""
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", "block"]) == 0
        out = capsys.readouterr().out
        assert "BlockScaling(format=<Format.E4M3: 'e4m3'>, block=32, power_of_2=True)" in out
        assert "1 x 32 tiles (inputs, output gradients), 32 x 32 blocks (weights); 32, not 128: --d-model is 32" in out
        assert main(["demo", *TINY, "--steps", "1", "--no-fp32", "--recipe", "block", "--block", "16"]) == 0
        out = capsys.readouterr().out
        assert "block=16," in out and "1 x 16 tiles" in out and "not 128" not in out

    def test_make_recipe(self):
        """Each --recipe name makes its recipe; the block edge is 128 unless the model is narrower."""
        made = {name: type(DemoConfig(recipe=name).make_recipe()) for name in RECIPE_NAMES}
        assert made == {
            "delayed": ss.DelayedScaling, "current": ss.CurrentScaling, "rowwise": ss.RowwiseScaling,
            "block": ss.BlockScaling, "mxfp8": ss.MXFP8Scaling,
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
        """An unknown --recipe is a usage error that lists the five."""
        with pytest.raises(SystemExit) as exc:
            main(["demo", *TINY, "--recipe", "tensorwise"])
        assert exc.value.code == 2
        assert "delayed, current, rowwise, block, mxfp8" in capsys.readouterr().err.replace("'", "")

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
        assert "{delayed,current,rowwise,block,mxfp8}" in out

    def test_console_script(self, tmp_path):
        """The installed 'scalestate' command exists and answers --help."""
        script = Path(sys.executable).with_name("scalestate")
        assert script.exists(), f"no console script next to {sys.executable}; is scalestate installed?"
        out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, check=True)
        assert "demo" in out.stdout
