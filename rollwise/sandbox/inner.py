"""The wrapper that runs INSIDE the sandbox, under the system Python, as the sandbox uid.

Its source is passed to the interpreter with `-c` (the module is never imported by rollwise itself; it uses
only the standard library and must run under any Python 3.8+). `argv`: PAYLOAD_FD STATUS_FD.

1. Reads the job (JSON) from PAYLOAD_FD: `code`, `files` (name -> base64), `limits`, `argv` (the interpreter
   command that runs the code).
2. Writes `files` and the code (`main.py`) into the current directory, the sandbox's work dir.
3. Writes `{"started": true}` to STATUS_FD (the host now knows the sandbox itself came up: a failure after this
   point is the code's), forks, and in the child applies the rlimits (CPU, AS, NPROC, FSIZE, NOFILE, CORE=0)
   and execs the code. The child keeps stdin/stdout/stderr; every other descriptor is closed by exec.
4. Waits for the child and writes its true status to STATUS_FD: `{"exit": N}` or `{"signal": N}`, with the CPU
   seconds and peak resident memory from `wait4` (bwrap would report a signal as the ambiguous code 128+N).
"""

import base64
import json
import os
import resource
import sys

MB = 1024 * 1024
MAX_OPEN_FILES = 256


def write_files(files, code):
    for name, data in files.items():
        parent = os.path.dirname(name)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(name, "wb") as handle:
            handle.write(base64.b64decode(data))
    with open("main.py", "w", encoding="utf-8") as handle:
        handle.write(code)


def apply_limits(limits):
    cpu_s = max(1, int(limits["cpu_s"] + 0.999))
    memory = int(limits["memory_mb"] * MB)
    file_size = int(limits["max_file_mb"] * MB)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at the soft limit, SIGKILL 1 s later
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))


def not_dumpable():
    """PR_SET_DUMPABLE 0 (Linux): processes of the same uid can no longer ptrace this one or open its
    /proc/PID/mem. The forked child inherits it until its exec, which makes the code dumpable again."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def report(status_fd, record):
    try:
        os.write(status_fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def main():
    payload_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
    try:
        with os.fdopen(payload_fd, "rb") as handle:
            job = json.loads(handle.read().decode("utf-8"))
        write_files(job["files"], job["code"])
    except Exception as exc:  # the sandbox could not set itself up: the host raises SandboxError
        report(status_fd, {"error": "%s: %s" % (type(exc).__name__, exc)})
        os._exit(125)
    report(status_fd, {"started": True})
    not_dumpable()  # the code runs as this uid: it must not read or write this process (its status report)
    child = os.fork()
    if child == 0:
        try:
            os.close(status_fd)
            apply_limits(job["limits"])
            argv = job["argv"] + ["main.py"]
            os.execv(argv[0], argv)
        except BaseException as exc:
            os.write(2, ("rollwise sandbox: cannot start the code: %s\n" % exc).encode())
        os._exit(126)
    _, status, usage = os.wait4(child, 0)
    record = {"cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_mb": usage.ru_maxrss / 1024.0}
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
        code = 128 + record["signal"]
    else:
        record["exit"] = code = os.WEXITSTATUS(status)
    report(status_fd, record)
    os._exit(code)


if __name__ == "__main__":
    main()
