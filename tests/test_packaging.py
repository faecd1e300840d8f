"""Packaging: backends install as scalestate.backends, never as a top-level package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import scalestate


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)


class TestLayout:
    def test_no_top_level_backends(self, tmp_path):
        """'import backends' fails outside the source tree."""
        result = _run("import backends", tmp_path)
        assert result.returncode != 0 and "No module named 'backends'" in result.stderr

    def test_backends_subpackage(self, tmp_path):
        """scalestate.backends imports and comes from a 'backends' folder."""
        result = _run("import scalestate.backends as b, pathlib; print(pathlib.Path(b.__file__).parent.name)", tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "backends"

    def test_import_loads_no_backend(self, tmp_path):
        """Importing scalestate imports no backend module."""
        result = _run(
            "import sys, scalestate; print(sorted(m for m in sys.modules if m.startswith('scalestate.backends.')))",
            tmp_path,
        )
        assert result.stdout.strip() == "['scalestate.backends.base']", result.stderr

    def test_import_leaves_the_compiler_alone(self, tmp_path):
        """Importing scalestate (and making a manager) does not import torch's compiler, which would
        double the import time. Instead the one function the compiler must not trace carries the
        single mark that torch.compiler.assume_constant_result sets: this test fails if torch's
        mark changes, and tests/test_compile.py::TestCompiledLayer::test_first_cast_inside_a_compiled_checkpoint
        fails if scalestate's function lacks it."""
        result = _run(
            "import sys, scalestate as ss; ss.ScalingStateManager(ss.DelayedScaling()); "
            "print('torch._dynamo' in sys.modules)",
            tmp_path,
        )
        assert result.stdout.strip() == "False", result.stderr
        import torch

        def probe() -> int:
            return 1

        marked = torch.compiler.assume_constant_result(probe)
        assert [k for k in vars(marked) if k.startswith("_dynamo")] == ["_dynamo_marked_constant"]
        assert vars(marked)["_dynamo_marked_constant"] is True

    def test_every_package_is_installed(self):
        """Every folder of the package that holds an ``__init__.py`` is in pyproject's package list,
        so a wheel (not only an editable install) carries it."""
        tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
        root = Path(__file__).resolve().parent.parent
        config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
        found = set()
        for top, name in (("scalestate", "scalestate"), ("backends", "scalestate.backends")):
            for init in (root / top).rglob("__init__.py"):
                parts = init.parent.relative_to(root / top).parts
                found.add(".".join((name, *parts)))
        assert found == set(config["packages"])

    def test_no_module_outgrows_a_reading(self):
        """No source file of the package is over about 400 lines (420): one a reader can hold in
        mind. A file that grows past it splits by job, as scalestate._engine and
        backends/scaled_mm/ did."""
        root = Path(__file__).resolve().parent.parent
        files = [*(root / "scalestate").rglob("*.py"), *(root / "backends").rglob("*.py")]
        assert len(files) > 50
        long = {f.relative_to(root).as_posix(): n for f in files if (n := len(f.read_text().splitlines())) > 420}
        assert not long, f"split these by job: {long}"

    def test_py_typed(self):
        """The package ships its type information marker."""
        assert (Path(scalestate.__file__).parent / "py.typed").exists()
