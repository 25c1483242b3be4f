"""Run untrusted Python (a policy's code) with no network, no view of the host's files and hard limits.

    result = run("print(input()[::-1])", stdin="abc\\n", limits=Limits(cpu_s=2, wall_s=5))
    result.stdout == "cba\\n"; result.exit_code == 0; result.killed_by is None

Backends (`backend=` or the environment variable `ROLLWISE_SANDBOX`: "auto" (default), "bwrap", "rlimits"):
- `bwrap`: bubblewrap with minimal read-only binds, every namespace new, a private tmpfs work dir (see
  `rollwise.sandbox.bwrap`); as root, under an unprivileged uid per concurrent slot (`rollwise.sandbox.slots`).
- `rlimits`: the same rlimits and, as root, the same pool uid and a fresh 0700 temp work dir; network and the
  file system stay visible (ONE loud warning says so). Not root: rlimits only, as the caller's own user.
  Asked for by name (`backend="rlimits"`, `ROLLWISE_SANDBOX=rlimits`), or as the fallback of "auto" when
  bubblewrap is missing or cannot start; that fallback runs code unconfined, so it is REFUSED (`SandboxError`)
  unless the user opted in: `sandbox.allow_unconfined = true` in a run's config, which sets
  `ROLLWISE_SANDBOX_UNCONFINED=allow` for this process and the reward workers it starts (`allow_unconfined`).
Inside, a small wrapper (`rollwise.sandbox.inner`) writes `files` and the code (`main.py`) into the work dir,
applies CPU / address-space / process / file-size / open-file rlimits (core dumps off) and runs the code with
the SYSTEM Python (`/usr/bin/python3 -E -s`): the pool uid must be able to read the interpreter, and a venv
under /root or /work is neither readable nor visible there. The code gets the standard library only.

`killed_by` names why the code stopped, for rewards and metrics: "timeout" (wall clock), "cpu" (RLIMIT_CPU),
"memory" (a MemoryError, or a signal with the peak memory at the limit), "processes" (a fork refused by
RLIMIT_NPROC ended the program), "output_limit" (stdout or stderr passed `max_output_bytes`; kept up to the cap,
`output_truncated`), "signal:N", or None. `SandboxError` is raised when the sandbox itself fails (bubblewrap
cannot start, no interpreter); the code failing is a result, never an exception.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from rollwise.sandbox import bwrap as bw
from rollwise.sandbox.process import kill_tree, read_status, watch
from rollwise.sandbox.slots import SlotDirError, uid_slot

SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_ARGV_PYTHON = (SYSTEM_PYTHON, "-E", "-s")
BACKENDS = ("auto", "bwrap", "rlimits")
ENV_BACKEND = "ROLLWISE_SANDBOX"
ENV_UNCONFINED = "ROLLWISE_SANDBOX_UNCONFINED"  # "allow": "auto" may fall back to rlimits (opt-in)
OWN_PROCESSES = 3  # the sandbox's own processes under the code's uid (bwrap, its pid 1, the wrapper)
SLOT_WAIT_S = 300.0
MEMORY_NEAR_LIMIT = 0.9  # a signal death with peak RSS over this share of memory_mb counts as "memory"

log = logging.getLogger("rollwise.sandbox")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran): bubblewrap could not start, no interpreter, no slot."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `cpu_s`: CPU seconds (RLIMIT_CPU, whole seconds, rounded up); `wall_s`: wall clock;
    `memory_mb`: address space (RLIMIT_AS); `max_processes`: RLIMIT_NPROC, per uid (hence a uid per slot);
    `max_file_mb`: largest file written (RLIMIT_FSIZE); `max_output_bytes`: kept of stdout and of stderr each;
    `disk_mb`: size of the tmpfs work dir and /tmp (bubblewrap only)."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_output_bytes: int = 64 * 1024
    disk_mb: int = 64

    def check(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "max_processes", "max_file_mb", "max_output_bytes", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """What one run did. `exit_code`: the code's exit status, or -N when signal N ended it (subprocess's
    convention); `wall_s`: seconds from start to teardown; `cpu_s` / `max_rss_mb`: from the wrapper's wait4
    (None when the code did not finish under it, e.g. killed at the wall-clock limit)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_by: str | None
    wall_s: float
    backend: str = ""
    cpu_s: float | None = None
    max_rss_mb: float | None = None
    output_truncated: bool = False
    orphans_killed: bool = False  # processes still held the output open after the code exited (fallback)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None


@lru_cache(maxsize=1)
def inner_source() -> str:
    return (Path(__file__).with_name("inner.py")).read_text(encoding="utf-8")


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One loud warning per process and kind (logging and `warnings`)."""
    if key in _warned:
        return
    _warned.add(key)
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def fallback_warning(reason: str, root: bool) -> str:
    uid = "an unprivileged uid, " if root else ""
    return (f"rollwise sandbox: {reason}; falling back to {uid}rlimits and a temp work dir. NOT contained: the "
            f"network (code can connect anywhere), the file system (code can read what is world-readable and "
            f"write world-writable places such as /tmp){'' if root else ', other processes of this user'}. "
            f"Install bubblewrap (`make setup` as root does) for containment.")


_opted_in_by_config = False


def allow_unconfined(allowed: bool) -> None:
    """Apply a run's `sandbox.allow_unconfined`: set `ROLLWISE_SANDBOX_UNCONFINED=allow` for this process and
    the processes it starts (reward workers inherit the environment). False withdraws only an opt-in an earlier
    run in this process made; the user's own environment variable stays an opt-in."""
    global _opted_in_by_config
    if allowed and not unconfined_allowed():
        os.environ[ENV_UNCONFINED] = "allow"
        _opted_in_by_config = True
    elif not allowed and _opted_in_by_config:
        os.environ.pop(ENV_UNCONFINED, None)
        _opted_in_by_config = False


def unconfined_allowed() -> bool:
    return os.environ.get(ENV_UNCONFINED, "").strip().lower() in ("allow", "1", "true", "yes")


def refuse_unconfined(reason: str) -> SandboxError:
    """The error of an "auto" sandbox that would run code unconfined without the user's opt-in."""
    return SandboxError(f"rollwise sandbox: {reason}, so code would run unconfined (network and files visible); "
                        "install bubblewrap (apt-get install bubblewrap, or `make setup` as root), or opt in with "
                        f"sandbox.allow_unconfined = true (environment: {ENV_UNCONFINED}=allow)")


def fallback(reason: str, root: bool) -> str:
    """'rlimits' for an "auto" sandbox without usable bubblewrap, with one loud warning, when the user opted in;
    SandboxError otherwise."""
    if not unconfined_allowed():
        raise refuse_unconfined(reason)
    warn_once(reason, fallback_warning(reason, root))
    return "rlimits"


def containment_problem(python: str = SYSTEM_PYTHON) -> str | None:
    """Why bubblewrap cannot contain code here (not installed, or cannot start), or None when it can. Starts
    bubblewrap once (cached) as the caller; `rollwise train --dry-run` asks before any code runs."""
    binary = bw.bwrap_path()
    if binary is None:
        return "bubblewrap (bwrap) is not installed"
    if os.geteuid() == 0:  # code runs under a pool uid: probe as one
        try:
            with uid_slot(SLOT_WAIT_S) as uid:
                reason = bw.probe(binary, python, uid)
        except (TimeoutError, SlotDirError) as exc:
            return str(exc)
    else:
        reason = bw.probe(binary, python, None)
    return None if reason is None else f"bubblewrap is installed but cannot start ({reason})"


def choose_backend(requested: str | None) -> str:
    """'bwrap', 'rlimits' or 'auto' (bwrap once its probe passes) for the requested backend (argument, else
    $ROLLWISE_SANDBOX, else 'auto'); SandboxError when "auto" would run code unconfined without the opt-in."""
    name = requested or os.environ.get(ENV_BACKEND, "auto")
    if name not in BACKENDS:
        raise ValueError(f"sandbox backend {name!r} (argument or ${ENV_BACKEND}) is not one of {', '.join(BACKENDS)}")
    if name == "rlimits":
        warn_once("forced", fallback_warning("backend 'rlimits' was asked for", os.geteuid() == 0))
        return "rlimits"
    if bw.bwrap_path() is None:
        if name == "bwrap":
            raise SandboxError("sandbox backend 'bwrap' was asked for but bubblewrap is not installed "
                               "(apt-get install bubblewrap, or `make setup` as root)")
        return fallback("bubblewrap (bwrap) is not installed", os.geteuid() == 0)
    return "bwrap" if name == "bwrap" else "auto"


def encode_files(files: dict[str, str | bytes] | None) -> dict[str, str]:
    """`files` as name -> base64; ValueError for a name that is absolute, climbs out or is `main.py`."""
    out = {}
    for name, data in (files or {}).items():
        parts = Path(name).parts
        if not name or os.path.isabs(name) or ".." in parts or name == "main.py":
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the work dir, not main.py")
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        out[name] = base64.b64encode(raw).decode("ascii")
    return out


def memfd_with(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: it is passed to the child
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def count_user_tasks(uid: int) -> int:
    """Threads of every process of `uid` (what RLIMIT_NPROC counts), from /proc."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    total += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return total


def run(code: str, files: dict[str, str | bytes] | None = None, stdin: str = "", limits: Limits | None = None,
        argv_python: Sequence[str] | None = None, backend: str | None = None) -> SandboxResult:
    """Run `code` as `main.py` in the sandbox's work dir with `files` beside it and `stdin` on its input."""
    limits = limits or Limits()
    limits.check()
    argv = list(argv_python or DEFAULT_ARGV_PYTHON)
    if not os.access(argv[0], os.X_OK):
        raise SandboxError(f"sandbox interpreter {argv[0]} is missing or not executable (install python3, or pass "
                           f"argv_python= with an interpreter every user can read)")
    job = {"code": code, "files": encode_files(files), "argv": argv}
    mode = choose_backend(backend)
    root = os.geteuid() == 0
    if not root:
        return _run_as(mode, None, job, stdin, limits)
    try:
        with uid_slot(SLOT_WAIT_S) as uid:
            return _run_as(mode, uid, job, stdin, limits)
    except (TimeoutError, SlotDirError) as exc:
        raise SandboxError(str(exc)) from None


def _run_as(mode: str, uid: int | None, job: dict, stdin: str, limits: Limits) -> SandboxResult:
    """Resolve 'auto' with the one-time probe, then run."""
    if mode in ("auto", "bwrap"):
        reason = bw.probe(bw.bwrap_path(), job["argv"][0], uid)
        if reason is not None and mode == "bwrap":
            raise SandboxError(f"bubblewrap cannot start here ({reason}); use backend 'rlimits' to run uncontained")
        mode = fallback(f"bubblewrap is installed but cannot start ({reason})", uid is not None) \
            if reason is not None else "bwrap"
    if mode == "bwrap":
        nproc = limits.max_processes + OWN_PROCESSES  # counted inside the sandbox's own user namespace
    elif uid is not None:
        nproc = limits.max_processes + OWN_PROCESSES
    else:  # our own uid: its other processes count too
        nproc = count_user_tasks(os.getuid()) + limits.max_processes
    job = {**job, "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "max_file_mb": limits.max_file_mb,
                             "nproc": nproc}}
    return _launch(mode, uid, job, stdin, limits)


def _launch(mode: str, uid: int | None, job: dict, stdin: str, limits: Limits) -> SandboxResult:
    payload_fd = memfd_with("rollwise-sandbox-job", json.dumps(job).encode("utf-8"))
    stdin_fd = memfd_with("rollwise-sandbox-stdin", stdin.encode("utf-8"))
    status_r, status_w = os.pipe()
    inner = [job["argv"][0], "-E", "-s", "-c", inner_source(), str(payload_fd), str(status_w)]
    workdir = None
    if mode == "bwrap":
        argv, cwd = bw.bwrap_argv(bw.bwrap_path(), inner, limits.disk_mb), "/"
        env = {"PATH": "/usr/bin:/bin"}
    else:
        workdir = tempfile.mkdtemp(prefix="rollwise-sandbox-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        argv, cwd = inner, workdir
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env=env, pass_fds=(payload_fd, status_w), start_new_session=True, **ids)
    except OSError as exc:
        raise SandboxError(f"cannot start the sandbox ({mode}): {exc}") from None
    finally:
        for fd in (payload_fd, stdin_fd, status_w):
            os.close(fd)
    try:
        try:
            seen = watch(proc, limits.wall_s, limits.max_output_bytes, start)
        except BaseException:  # e.g. a reward's RewardTimeout (SIGALRM) or Ctrl-C: never leave the code running
            kill_tree(proc, uid)
            raise
        kill_tree(proc, uid if (mode == "rlimits" or seen.stop) else None)
        wall_s = time.monotonic() - start
        records = read_status(status_r)
    finally:
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    return classify(seen, records, proc.returncode, limits, mode, wall_s)


def classify(seen, records: list[dict], returncode: int, limits: Limits, mode: str, wall_s: float) -> SandboxResult:
    """Build the result from what was read and what the wrapper reported; SandboxError if it never started."""
    stdout = seen.stdout.decode("utf-8", "replace")
    stderr = seen.stderr.decode("utf-8", "replace")
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise SandboxError(f"the sandbox wrapper failed ({mode}): {errors[0]}")
    if not any(r.get("started") for r in records):
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
        cause = f"did not come up within {limits.wall_s} s" if seen.stop == "timeout" else f"exit {returncode}: {last}"
        raise SandboxError(f"the sandbox ({mode}) did not start: {cause}")
    final = next((r for r in records if "exit" in r or "signal" in r), None)
    if final is None:
        code = -signal.SIGKILL if seen.stop else returncode
    else:
        code = final["exit"] if "exit" in final else -final["signal"]
    result = SandboxResult(stdout, stderr, code, seen.stop == "timeout", None, wall_s, backend=mode,
                           cpu_s=final.get("cpu_s") if final else None,
                           max_rss_mb=final.get("maxrss_mb") if final else None,
                           output_truncated=seen.truncated, orphans_killed=seen.stop == "orphans")
    result.killed_by = cause_of(result, seen.stop, limits)
    return result


def cause_of(result: SandboxResult, stop: str | None, limits: Limits) -> str | None:
    """Why the code stopped (see the module docstring); None for a normal exit, zero or not."""
    if stop in ("timeout", "output_limit"):
        return stop
    tail = result.stderr[-2000:]
    if result.exit_code < 0:
        sig = -result.exit_code
        cpu_used = result.cpu_s or 0.0
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= int(limits.cpu_s + 0.999) - 0.05):
            return "cpu"
        if result.max_rss_mb is not None and result.max_rss_mb >= MEMORY_NEAR_LIMIT * limits.memory_mb:
            return "memory"
        return f"signal:{sig}"
    if result.exit_code != 0 and "MemoryError" in tail:
        return "memory"
    if result.exit_code != 0 and "BlockingIOError: [Errno 11]" in tail:
        return "processes"
    return None


__all__ = ["Limits", "SandboxError", "SandboxResult", "SYSTEM_PYTHON", "run"]
