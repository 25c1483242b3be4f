"""Running the sandbox process: capped output reading, the wall-clock limit, killing the whole tree.

`watch(proc, wall_s, max_output_bytes)` reads stdout and stderr with a cap per stream and returns when both
pipes are closed, the process has exited and a short grace for buffered output is over, the wall clock runs
out, or a stream passes its cap. The caller then calls `kill_tree`.

Killing: `os.killpg` on the process's own session (it is started with `start_new_session`), and, when a pool
uid ran it, `sweep_uid`: SIGKILL to every process of that uid (`kill(-1)` from a child running as the uid;
Linux never signals the caller itself). That reaches a `setsid` orphan outside the group, which in fallback
mode nothing else would. Under bubblewrap the pid namespace already ends with its pid 1, and `--die-with-parent`
ends pid 1 with bwrap.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field

CHUNK_BYTES = 65536
EXIT_GRACE_S = 0.2  # after the process exits, output still in flight is read for this long
KILL_BINARY = "/bin/kill"
SWEEP_WAIT_S = 0.5


@dataclass
class Watched:
    """What `watch` saw: the captured bytes of each stream and why it stopped early, if it did."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    stop: str | None = None  # "timeout" | "output_limit" | "orphans" (pipes held open after the exit) | None


def _append(buffer: bytearray, data: bytes, cap: int) -> bool:
    """Append up to the cap; True when the cap was passed."""
    room = cap - len(buffer)
    buffer += data[:max(room, 0)]
    return len(data) > room


def watch(proc: subprocess.Popen, wall_s: float, max_output_bytes: int, start: float) -> Watched:
    """Read `proc`'s stdout / stderr until done (see the module docstring)."""
    seen = Watched()
    buffers = {proc.stdout.fileno(): seen.stdout, proc.stderr.fileno(): seen.stderr}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = start + wall_s
    exited_at: float | None = None
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                seen.stop = "timeout"
                return seen
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_GRACE_S:
                seen.stop = "orphans"
                return seen
            for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
                try:
                    data = os.read(key.fd, CHUNK_BYTES)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(key.fd)
                elif _append(buffers[key.fd], data, max_output_bytes):
                    seen.truncated = True
                    seen.stop = "output_limit"
                    return seen
        remaining = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(remaining, 0.0))
        except subprocess.TimeoutExpired:
            seen.stop = "timeout"
        return seen
    finally:
        selector.close()


def _kill_all_of(uid: int) -> bool:
    """One `kill -KILL -1` as `uid`; True when some process (a zombie too) got the signal."""
    done = subprocess.run([KILL_BINARY, "-KILL", "-1"], user=uid, group=uid, extra_groups=[],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    return done.returncode == 0


def sweep_uid(uid: int) -> bool:
    """SIGKILL every process of `uid` (root only) and wait until none is left (a signalled process takes a moment
    to die; an unreaped zombie ends the wait after SWEEP_WAIT_S). True when there was one."""
    if not _kill_all_of(uid):
        return False
    deadline = time.monotonic() + SWEEP_WAIT_S
    while _kill_all_of(uid) and time.monotonic() < deadline:
        time.sleep(0.002)
    return True


def kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the sandbox's session and, with a pool uid, every process of that uid; reap `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        sweep_uid(uid)
    proc.wait()


def read_status(fd: int) -> list[dict]:
    """The JSON lines the wrapper wrote to the status pipe (non-blocking; its write end is closed by now)."""
    import json

    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:
            break
        if not data:
            break
        chunks.append(data)
    records = []
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
