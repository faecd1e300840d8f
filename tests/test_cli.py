"""The scalestate command and its demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalestate.cli import main
from scalestate.demo.data import corpus, decode, encode
from scalestate.demo.run import compare
from scalestate.demo.train import DemoConfig, train

TINY = ["--steps", "3", "--microbatches", "2", "--microbatch-size", "2", "--seq-len", "16",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--quiet"]


class TestDemo:
    @pytest.mark.parametrize("recipe", ["delayed", "current"])
    @pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
    def test_tiny_run_reports_bitwise_parity(self, capsys, recipe, backend):
        """A tiny demo runs all three trainings and reports bitwise equality."""
        assert main(["demo", *TINY, "--recipe", recipe, "--backend", backend]) == 0
        out = capsys.readouterr().out
        for line in ("fp32", "fp8 + checkpointing", "fp8, no checkpointing", "FP8 vs fp32"):
            assert line in out
        assert out.count("EQUAL") == 4 and "DIFFERENT" not in out and "OK:" in out

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
        for flag in ("--steps", "--d-model", "--layers", "--backend", "--recipe", "--microbatches"):
            assert flag in out

    def test_console_script(self, tmp_path):
        """The installed 'scalestate' command exists and answers --help."""
        script = Path(sys.executable).with_name("scalestate")
        assert script.exists(), f"no console script next to {sys.executable}; is scalestate installed?"
        out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=tmp_path, check=True)
        assert "demo" in out.stdout
