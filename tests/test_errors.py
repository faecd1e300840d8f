"""scalestate.errors: one vocabulary of errors, each also the builtin of its kind, and nothing raised outside it."""

from __future__ import annotations

import ast
import builtins
import doctest
import importlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import scalestate as ss
from scalestate import backends, errors
from scalestate.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    BackendUnavailableError,
    CastError,
    ConversionError,
    ConversionTypeError,
    DeviceUnavailableError,
    MissingDependencyError,
    NonFiniteAmaxError,
    PhaseError,
    ReadOnlyError,
    RecipeError,
    RecomputeMismatchError,
    ReductionError,
    ScaleStateError,
    SlotError,
    SlotMismatchError,
    StateDictError,
    UnknownBackendError,
)

ROOT = Path(__file__).resolve().parents[1]
#: The package's source: scalestate/ and backends/ (installed as scalestate.backends).
SOURCE_DIRS = (ROOT / "scalestate", ROOT / "backends")

#: Raises of a builtin that stay, keyed by (file, exception), each with its reason.
ALLOWED: dict[tuple[str, str], str] = {
    ("scalestate/demo/run.py", "SystemExit"): (
        "the demo command's flag checks end the program with a message and exit status 1, as argparse "
        "does for a bad flag; SystemExit is how a command exits, not an error a caller catches"
    ),
    ("scalestate/testing/compare.py", "AssertionError"): (
        "assert_same is a test assertion: a failed comparison is what test runners report as a failure, "
        "as torch.testing.assert_close raises it; it signals a failed test, not a misuse of scalestate"
    ),
}

#: Every class of scalestate.errors, and the builtin exception it also is.
CATEGORIES: list[tuple[type[ScaleStateError], type[BaseException]]] = [
    (ArgumentTypeError, TypeError),
    (ArgumentValueError, ValueError),
    (RecipeError, ValueError),
    (PhaseError, RuntimeError),
    (SlotError, ValueError),
    (SlotMismatchError, ValueError),
    (UnknownBackendError, LookupError),
    (BackendUnavailableError, RuntimeError),
    (StateDictError, ValueError),
    (CastError, ValueError),
    (RecomputeMismatchError, RuntimeError),
    (ReductionError, RuntimeError),
    (NonFiniteAmaxError, FloatingPointError),
    (ConversionError, ValueError),
    (ConversionTypeError, TypeError),
    (MissingDependencyError, ImportError),
    (ReadOnlyError, AttributeError),
    (DeviceUnavailableError, RuntimeError),
]

#: The one warning of scalestate.errors: a UserWarning, not an error.
WARNINGS = ["MissingStepWarning"]


def _source_files() -> Iterator[tuple[str, ast.Module]]:
    for folder in SOURCE_DIRS:
        for path in sorted(folder.rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _raised_name(node: ast.Raise) -> str | None:
    """The name of the class ``raise X(...)`` or ``raise X`` raises (``None`` for a bare re-raise)."""
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    if isinstance(exc, ast.Name):
        return exc.id
    if isinstance(exc, ast.Attribute):  # errors.ScaleStateError, builtins.ValueError
        return exc.attr
    return None


def _is_builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException)


class TestVocabulary:
    """Each error is a ScaleStateError, the builtin of its kind, and documented."""

    @pytest.mark.parametrize(("error", "builtin"), CATEGORIES, ids=[c.__name__ for c, _ in CATEGORIES])
    def test_is_scalestate_error_and_builtin(self, error: type[ScaleStateError], builtin: type[BaseException]):
        """``except ScaleStateError`` and ``except <builtin>`` both catch it."""
        assert issubclass(error, ScaleStateError) and issubclass(error, builtin)
        with pytest.raises(builtin, match="the message"):
            raise error("the message")

    def test_table_covers_the_module(self):
        """The table above lists every public error of scalestate.errors, and nothing else."""
        assert sorted(errors.__all__) == sorted([c.__name__ for c, _ in CATEGORIES] + ["ScaleStateError", *WARNINGS])
        assert all(getattr(errors, name).__module__ == "scalestate.errors" for name in errors.__all__)

    @pytest.mark.parametrize("name", errors.__all__)
    def test_documented(self, name: str):
        """Every class says, in its docstring, when it is raised."""
        doc = getattr(errors, name).__doc__
        assert doc is not None and len(doc.split()) >= 8, f"{name} needs a docstring saying when it is raised"

    def test_module_example(self):
        """The runnable example of the module docstring runs and prints what it says."""
        finder = doctest.DocTestFinder(recurse=False)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        tests = finder.find(errors, globs={})
        assert any(t.examples for t in tests)
        for t in tests:
            runner.run(t)
        assert runner.failures == 0

    def test_conversion_type_error_is_also_an_argument_type_error(self):
        """A conversion's wrong-type argument is caught as a ConversionError and as an ArgumentTypeError."""
        assert issubclass(ConversionTypeError, ConversionError) and issubclass(ConversionTypeError, ArgumentTypeError)

    def test_torchao_adapter_names_are_the_same_classes(self):
        """``scalestate.integrations.torchao`` still exports its error names: the classes of scalestate.errors."""
        torchao = importlib.import_module("scalestate.integrations.torchao")
        assert torchao.ConversionError is ConversionError
        assert torchao.ConversionTypeError is ConversionTypeError


class TestSource:
    """No raise in the package's source goes around scalestate.errors."""

    def test_no_builtin_or_bare_base_raised(self):
        """Every ``raise`` names a class of scalestate.errors other than the base (or is in ALLOWED)."""
        found, used, raises = [], set(), 0
        for path, tree in _source_files():
            for node in ast.walk(tree):
                if not isinstance(node, ast.Raise):
                    continue
                raises += 1
                name = _raised_name(node)
                if name is None:
                    continue  # a bare ``raise`` re-raises what was caught; it raises nothing new
                if (path, name) in ALLOWED:
                    used.add((path, name))
                elif name == "ScaleStateError" or _is_builtin_exception(name):
                    found.append(f"{path}:{node.lineno}: raise {name}")
        assert raises > 100, f"found only {raises} raises under {SOURCE_DIRS}: is the walk looking at the source?"
        assert not found, (
            "raise a class of scalestate.errors (a category, also the matching builtin), not a builtin or the "
            "bare ScaleStateError; add a category to scalestate/errors.py if none fits:\n" + "\n".join(found)
        )
        assert used == set(ALLOWED), f"allow-list entries that match no raise any more: {set(ALLOWED) - used}"

    def test_errors_are_defined_only_in_errors_module(self):
        """No module other than scalestate/errors.py defines an exception class."""
        exception_names = set(errors.__all__) | {n for n in dir(builtins) if _is_builtin_exception(n)}
        found = []
        for path, tree in _source_files():
            if path == "scalestate/errors.py":
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases}
                    if bases & exception_names:
                        found.append(f"{path}:{node.lineno}: class {node.name}")
        assert not found, "define exceptions in scalestate/errors.py:\n" + "\n".join(found)


def _manager(**kwargs: Any) -> ss.ScalingStateManager:
    return ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", **kwargs)


def _set_data(q: ss.Quantized) -> None:
    q.data = q.data  # type: ignore[misc]  # read-only on purpose


E4M3 = torch.float8_e4m3fn

#: (what is called, the error it raises, a piece of its message) for a call of each category.
CALLS: dict[str, tuple[Callable[[], object], type[ScaleStateError], str]] = {
    "manager recipe": (lambda: ss.ScalingStateManager("delayed"), ArgumentTypeError, "recipe must be one of"),
    "manager on_nonfinite": (lambda: _manager(on_nonfinite="ignore"), ArgumentValueError, "got 'ignore'"),
    "manager collect_stats": (lambda: _manager(collect_stats=1), ArgumentTypeError, "True or False; got 1"),
    "manager group": (lambda: _manager(group=3), ArgumentTypeError, "ProcessGroup"),
    "Linear manager": (lambda: ss.nn.Linear(4, 4, manager="m"), ArgumentTypeError, "ScalingStateManager"),
    "convert model": (lambda: ss.nn.convert("net", _manager()), ConversionTypeError, "torch.nn.Module"),
    "register_conversion fn": (
        lambda: ss.nn.register_conversion(torch.nn.Conv2d, 3),  # type: ignore[arg-type]
        ConversionTypeError,
        "must be callable",
    ),
    "unregister_conversion": (lambda: ss.nn.unregister_conversion(torch.nn.Conv3d), ConversionError, "nothing to"),
    "register_backend name": (lambda: backends.register_backend("auto", object), ArgumentValueError, "not be 'auto'"),
    "register_backend factory": (
        lambda: backends.register_backend("x", 3),  # type: ignore[arg-type]
        ArgumentTypeError,
        "must be callable",
    ),
    "backend member": (
        lambda: ss.ScalingStateManager(ss.DelayedScaling(), backend=object()),  # type: ignore[arg-type]
        ArgumentTypeError,
        "no method",
    ),
    "checkpoint context_fn": (
        lambda: ss.checkpoint(torch.sin, torch.ones(1), use_reentrant=True, context_fn=lambda: None),
        ArgumentValueError,
        "use_reentrant=False",
    ),
    "Quantized dtype": (lambda: ss.Quantized(torch.zeros(1), scale=torch.ones(())), CastError, "torch.float32"),
    "Quantized.t": (lambda: ss.Quantized(torch.zeros(3, dtype=E4M3), scale=torch.ones(())).t(), CastError, "2-d"),
    "Quantized read-only": (
        lambda: _set_data(ss.Quantized(torch.zeros(1, dtype=E4M3), scale=torch.ones(()))),
        ReadOnlyError,
        "read-only",
    ),
}


class TestCategories:
    """A user's mistake of each kind raises its category, which is also the builtin it used to be."""

    @pytest.mark.parametrize("case", list(CALLS))
    def test_raises_its_category(self, case: str):
        """The call raises the category named in the table, with the message of old."""
        call, error, message = CALLS[case]
        with pytest.raises(error, match=re.escape(message)):
            call()

    def test_missing_extra(self, monkeypatch: pytest.MonkeyPatch):
        """An integration imported without its library raises a MissingDependencyError, an ImportError."""
        monkeypatch.setitem(sys.modules, "transformers", None)
        monkeypatch.delitem(sys.modules, "scalestate.integrations.transformers", raising=False)
        with pytest.raises(MissingDependencyError, match=re.escape('pip install "scalestate[transformers]"')):
            importlib.import_module("scalestate.integrations.transformers")
