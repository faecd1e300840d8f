"""mkdocs hook: let mkdocstrings read scalestate as it installs.

``pip install`` maps the top-level ``backends/`` folder to ``scalestate.backends``
(``[tool.setuptools.package-dir]`` in pyproject.toml). mkdocstrings reads the
source statically with griffe, which follows folders, not that mapping. So
before each build this hook copies ``scalestate/`` and ``backends/`` into a
temporary directory laid out as installed (as ``.ci/typecheck`` does for mypy)
and points the python handler's ``paths`` at it. The build then needs neither
an install nor importable optional dependencies, and reads the working tree,
not whatever version happens to be installed.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

_trees: list[Path] = []


class _SourcePaths(logging.Filter):
    """Report files of the temporary tree by their path in the source tree."""

    def __init__(self, tree: Path, root: Path) -> None:
        super().__init__()
        self._map = [(str(tree / "scalestate" / "backends"), str(root / "backends")), (str(tree), str(root))]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for temporary, source in self._map:
            message = message.replace(temporary, source)
        record.msg, record.args = message, None
        return True


def _lay_out(root: Path) -> Path:
    for folder in ("scalestate", "backends"):
        if not (root / folder).is_dir():
            raise PluginError(f"docs/hooks/layout.py: no folder {root / folder}; run mkdocs from the repository root")
    tree = Path(tempfile.mkdtemp(prefix="scalestate-docs-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "scalestate", tree / "scalestate", ignore=ignore)
    shutil.copytree(root / "backends", tree / "scalestate" / "backends", ignore=ignore)
    return tree


def _remove_trees() -> None:
    while _trees:
        shutil.rmtree(_trees.pop(), ignore_errors=True)


@event_priority(100)  # before mkdocstrings reads its handler configuration
def on_config(config: MkDocsConfig, **kwargs: Any) -> MkDocsConfig:
    """Lay out the package in a fresh temporary tree and search it first."""
    _remove_trees()  # `mkdocs serve` reloads the config on every rebuild
    root = Path(config.config_file_path).resolve().parent
    tree = _lay_out(root)
    _trees.append(tree)
    for handler in logging.getLogger("mkdocs").handlers:
        for old in [f for f in handler.filters if isinstance(f, _SourcePaths)]:
            handler.removeFilter(old)
        handler.addFilter(_SourcePaths(tree, root))
    mkdocstrings = config.plugins["mkdocstrings"]
    handlers = mkdocstrings.config["handlers"]
    handlers.setdefault("python", {})["paths"] = [str(tree)]
    return config


def on_shutdown(**kwargs: Any) -> None:
    """Remove the temporary tree."""
    _remove_trees()
