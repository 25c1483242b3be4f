"""The bubblewrap command line, and the one-time check that bubblewrap works here.

What the sandbox sees: `/usr` read-only (the system Python and its standard library live there), `/lib`,
`/lib64`, `/bin`, `/sbin` as the symlinks or read-only binds the host has, a fresh `/proc` and `/dev`, a
private tmpfs `/tmp` and the work dir `WORKDIR` (a tmpfs of `disk_mb`), nothing else: no `/etc`, `/root`,
`/home`, `/work`, `/tmp` of the host. Every namespace is new (`--unshare-all`: no network, no host pids, no
host IPC), nested user namespaces are refused (`--disable-userns`), the environment is cleared, the code runs
in a new session (no TIOCSTI on the host terminal) and dies with bwrap (`--die-with-parent`).

Uid: bwrap itself is started as the unprivileged pool uid (see `rollwise.sandbox.slots`) rather than as root
with `--uid`: as root, `--uid N` only maps N onto the host's uid 0, for which the kernel ignores RLIMIT_NPROC
(a fork bomb is not stopped).
"""

from __future__ import annotations

import os
import shutil
import subprocess

WORKDIR = "/sandbox"
SYSTEM_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
PROBE_TIMEOUT_S = 10.0


def bwrap_path() -> str | None:
    return shutil.which("bwrap") or (os.access("/usr/bin/bwrap", os.X_OK) and "/usr/bin/bwrap") or None


def system_binds() -> list[str]:
    """`/usr` read-only, and each of `SYSTEM_DIRS` as the host has it (a symlink into /usr, or a real dir)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_argv(binary: str, inner_argv: list[str], disk_mb: int) -> list[str]:
    """The full command: bwrap's options, then `inner_argv` (the wrapper) run in WORKDIR."""
    size = str(int(disk_mb) * 1024 * 1024)
    return [
        binary, *system_binds(),
        "--proc", "/proc", "--dev", "/dev",
        "--size", size, "--tmpfs", "/tmp",
        "--size", size, "--tmpfs", WORKDIR, "--chdir", WORKDIR,
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--", *inner_argv,
    ]


_PROBED: dict[tuple[str, str, bool], str | None] = {}


def probe(binary: str, python: str, uid: int | None) -> str | None:
    """Run `python -c pass` in bwrap once per (binary, interpreter, pool uid or not); None when it works, else
    the reason in one line (bwrap's own message, e.g. user namespaces disabled). The caller holds `uid`'s slot."""
    key = (binary, python, uid is not None)
    if key not in _PROBED:
        _PROBED[key] = _probe(binary, python, uid)
    return _PROBED[key]


def _probe(binary: str, python: str, uid: int | None) -> str | None:
    argv = bwrap_argv(binary, [python, "-c", "pass"], disk_mb=1)
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S,
                              cwd="/", env={"PATH": "/usr/bin:/bin"}, **ids)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"exit {done.returncode}: {message[-1] if message else 'no message'}"
    return None
