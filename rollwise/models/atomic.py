"""Crash-safe filesystem steps shared by the model cache and training checkpoints.

The pattern: write everything into a temporary sibling directory, fsync it, then `os.rename` it into place. A
reader sees either the old directory or the complete new one, never a half-written one, even after SIGKILL or
power loss.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory, to disk."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: temp file, fsync, `os.replace`, fsync the directory."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path, aside: Path) -> None:
    """Rename the finished directory `tmp` to `final`, replacing an existing `final` safely.

    An existing `final` is first renamed to `aside`, then `tmp` is renamed in, then `aside` is deleted; a crash
    in between leaves `aside` complete, so callers can restore it.
    """
    if final.exists():
        os.rename(final, aside)
        fsync_dir(final.parent)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def remove_dir(path: Path, aside: Path) -> None:
    """Delete a directory so that it disappears at once: rename it to `aside`, then remove `aside`."""
    os.rename(path, aside)
    fsync_dir(path.parent)
    shutil.rmtree(aside)
