"""A pool of unprivileged uids, one per concurrent sandbox (used when rollwise runs as root).

RLIMIT_NPROC counts the processes of a real uid, so two sandboxes sharing a uid would share one process budget
(and one could kill the other's processes). Each run therefore holds a slot: uid `UID_BASE + slot` (gid the
same), taken with an exclusive `flock` on `LOCK_DIR/slot-N.lock`. The lock is per open file, so it excludes
threads of one process and separate processes (several trainers, reward workers) alike, and it is released by
the kernel if the holder dies.

`ROLLWISE_SANDBOX_UID_BASE` (default 60000) and `ROLLWISE_SANDBOX_SLOTS` (default 64) move or size the pool;
the uids need no /etc/passwd entry and must not belong to real users.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

DEFAULT_UID_BASE = 60000
DEFAULT_SLOTS = 64
POLL_S = 0.005  # wait between sweeps over the pool when every slot is busy


def uid_base() -> int:
    return int(os.environ.get("ROLLWISE_SANDBOX_UID_BASE", DEFAULT_UID_BASE))


def num_slots() -> int:
    return max(1, int(os.environ.get("ROLLWISE_SANDBOX_SLOTS", DEFAULT_SLOTS)))


class SlotDirError(RuntimeError):
    """The lock directory exists but is not this user's private directory (another user made it first)."""


def lock_dir() -> str:
    """`$TMPDIR/rollwise-sandbox-slots-<uid>`, created 0700; SlotDirError when it already exists and is not a
    directory of this user that only this user can enter. Otherwise another local user who created it first could
    hold every slot's lock (no sandbox would start) or watch which uid runs which code; code run under a pool uid
    (the fallback sees /tmp) must not be able to take a slot either."""
    path = os.path.join(tempfile.gettempdir(), f"rollwise-sandbox-slots-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a directory"
        raise SlotDirError(f"sandbox lock directory {path} is {kind} owned by uid {info.st_uid} with mode "
                           f"{stat.S_IMODE(info.st_mode):o}; it must be this user's (uid {os.getuid()}) with mode 700: "
                           "remove it (another user may have made it), or point TMPDIR elsewhere")
    return path


@contextmanager
def uid_slot(wait_s: float) -> Iterator[int]:
    """Hold one free uid of the pool for the duration of the block; TimeoutError after `wait_s` seconds."""
    directory, base, slots = lock_dir(), uid_base(), num_slots()
    start = os.getpid() % slots  # spread processes over the pool
    deadline = time.monotonic() + wait_s
    while True:
        for i in range(slots):
            slot = (start + i) % slots
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(os.path.join(directory, f"slot-{slot}.lock"), flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield base + slot
            finally:
                os.close(fd)  # releases the lock
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"all {slots} sandbox uid slots stayed busy for {wait_s:.0f} s "
                               f"(raise ROLLWISE_SANDBOX_SLOTS or run fewer sandboxes at once)")
        time.sleep(POLL_S)
