"""Crash-safe checkpoint files: ``torch.save`` that never leaves a torn file.

A checkpoint written straight to its path is destroyed by a crash in the
middle of the write (a ``kill -9``, a preempted node, a full disk): the old
file is already truncated and the new one incomplete, so the run cannot
resume at all. :func:`atomic_save` writes to a temporary file in the same
directory, makes it durable, and only then renames it over the path, so the
path holds either the previous complete checkpoint or the new complete one,
whatever moment the process dies at.

Example:
    >>> import os, tempfile, torch
    >>> from scalestate.atomic import atomic_save
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> atomic_save({"step": 3, "w": torch.ones(2)}, path)
    >>> torch.load(path, weights_only=True)["step"]
    3
    >>> os.listdir(os.path.dirname(path))
    ['ckpt.pt']
"""

from __future__ import annotations

import contextlib
import os
import uuid

import torch

__all__ = ["atomic_save"]


def atomic_save(obj: object, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, all or nothing, even if the process is killed.

    The steps: ``torch.save`` into a new hidden file beside ``path``
    (``.<name>.<random>.tmp``, created with the mode a new file gets from the
    umask), flush it and ``os.fsync`` it, ``os.replace`` it onto ``path`` (an
    atomic rename on POSIX and Windows), then ``os.fsync`` the directory so
    the rename itself survives a power loss (POSIX). At every instant ``path``
    is either absent, the previous complete file, or the new complete file.

    If saving raises (an object that cannot be serialized, a full disk, a
    ``KeyboardInterrupt``), the temporary file is removed, ``path`` is left as
    it was, and the exception propagates. A process killed mid-save cannot
    clean up: it may leave one hidden ``.<name>.*.tmp`` file, never a torn
    ``path``; such leftovers are safe to delete once no save is running.

    Load the result with ``torch.load(path, weights_only=True)`` (the
    documentation's checkpointing page, "Crash-safe checkpoints", has the full
    recipe).

    Args:
        obj: what to save, as for ``torch.save``.
        path: the checkpoint file. Its directory must exist; a symlink at
            ``path`` is replaced by the file, not followed.

    Raises:
        Exception: whatever ``torch.save`` or the file system raises (``OSError``
            for a full disk, a missing directory, no permission; ``pickle`` errors
            for an object that cannot be serialized); ``path`` is then unchanged.
    """
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    # O_EXCL: never write into a file that another save (or anything else) owns.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
