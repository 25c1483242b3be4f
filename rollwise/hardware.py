"""Run-time facts about the machine: physical cores, the share of them other processes leave free, native bf16.

Threads on a shared machine: torch's intra-op pool here is GNU OpenMP (libgomp, `torch.__config__.parallel_info()`),
whose threads spin at each barrier (GOMP_SPINCOUNT 300000 by default) before they sleep. With as many threads as
cores and one core taken by another process, every small op of the engine waits for a descheduled thread while the
others spin: measured on 2 cores, a 32-prompt `rollwise eval` took 146 s beside one busy loop against 10 s alone.
OMP_WAIT_POLICY=PASSIVE cures that but costs +50% on an idle machine (GOMP_SPINCOUNT=1000: +30%), so rollwise
instead runs as many threads as there are free cores: the cores it may use (affinity, cgroup quota) less the CPU
other processes were seen using (from /proc/stat, less this process tree's own time), and `ThreadGovernor`
re-checks that between steps. `ROLLWISE_THREADS` overrides the choice (a number, or `cores` for the old rule).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "ROLLWISE_THREADS"  # a number: that many threads; "cores": physical cores (the old rule); "auto"
FREE_CORE_MIN = 0.8  # a core is counted free when other processes leave at least this share of it idle
START_WINDOW_S = 0.3  # the shortest window over which the CPU use of other processes is measured
STALE_BASELINE_S = 60.0  # an older start snapshot says little about now: measure afresh


def physical_cores() -> int:
    """Cores this process may use, counting SMT siblings once."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen: set[str] = set()
    for cpu in allowed:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            seen.add(path.read_text().strip())
        except OSError:
            seen.add(str(cpu))
    return max(1, len(seen))


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_is_native(device_type: str = "cpu") -> bool:
    """bf16 runs natively: on CUDA, or on a CPU with bf16 dot-product instructions."""
    if device_type == "cuda":
        return True
    return device_type == "cpu" and cpu_has_native_bf16()


def resolve_device(name: str):
    """`train.device` as a `torch.device`: `auto` is `cuda` when a GPU is visible, else `cpu`. ValueError (one
    line) for `cuda` / `cuda:N` that this machine does not have."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise ValueError(f"train.device = {name!r}, but this machine has {count} CUDA device(s) visible; use "
                             f"'auto' or 'cpu'" + (f", or cuda:0..cuda:{count - 1}" if count else ""))
    return device


def matmul_gflops(dtype, size: int = 128, repeats: int = 3) -> float:
    """GFLOP/s of one `size`^3 matmul in `dtype` on the current threads (best of `repeats`; a quick figure for
    messages; MFU uses `rollwise.perf`'s measured peak)."""
    import torch

    gen = torch.Generator().manual_seed(0)  # never the global RNG
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    a @ b
    fastest_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        fastest_s = min(fastest_s, time.perf_counter() - start)
    return 2 * size**3 / max(fastest_s, 1e-9) / 1e9


def slow_bf16_warning(model_dtype: str, precision: str, device_type: str = "cpu") -> str | None:
    """One line when bf16 was asked for explicitly (`model.dtype = "bfloat16"`, `train.precision = "bf16"`) on a
    CPU without native bf16 (no AVX512-BF16 or AMX): there a bf16 matmul runs about 100x slower than fp32 and a
    tiny run takes many minutes with no word why. The factor is measured here, now. None when it does not apply
    (`auto` already picks fp32 on such a CPU)."""
    asked = [key for key, on in (("model.dtype = 'bfloat16'", model_dtype == "bfloat16"),
                                 ("train.precision = 'bf16'", precision == "bf16")) if on]
    if not asked or device_type != "cpu" or cpu_has_native_bf16():
        return None
    import torch

    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    return (f"rollwise: warning: {' and '.join(asked)} on a CPU without native bf16 (no AVX512-BF16 or AMX): "
            f"a bf16 matmul runs at {bf16:.1f} GFLOP/s here against {fp32:.1f} in fp32 ({fp32 / bf16:.0f}x slower); "
            "use float32 / fp32 (or 'auto', which picks fp32 on this CPU)")




def configure_allocator() -> bool:
    """Keep mid-size freed blocks (up to 32 MB) in the process heap instead of returning them to the OS
    (glibc only).

    By default glibc serves blocks above a dynamic threshold with fresh `mmap` pages and unmaps them on
    free, so activation-sized tensors pay page faults on every first touch. Raising the mmap threshold to
    its maximum (32 MB) keeps those blocks reusable, while larger ones (logit chunks, the tied embedding's
    gradient) still go back to the OS, which bounds heap fragmentation (a first version that disabled mmap
    altogether coincided with a 1.4 GB higher peak on the quickstart run).
    Returns True when the setting was applied.
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        max_mmap_threshold = 32 * 2**20
        return bool(libc.mallopt(m_mmap_threshold, max_mmap_threshold)) and bool(
            libc.mallopt(m_trim_threshold, 2 * max_mmap_threshold))
    except (OSError, AttributeError):
        return False


# -- CPU left free by other processes ----------------------------------------------------------------------
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are idle time)


def parse_proc_stat(text: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """(busy, total) clock ticks since boot from /proc/stat text, summed over the `cpuN` lines of `cpus`
    (None: the aggregate `cpu` line). Steal time counts as busy: the hypervisor gave that CPU to someone else."""
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            continue
        wanted = cpus is None if name == "cpu" else cpus is not None and int(name[3:]) in cpus
        if not wanted:
            continue
        ticks = [int(v) for v in rest.split()[:8]]
        busy += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
        total += sum(ticks)
    return busy, total


def parse_pid_stat(text: str) -> int:
    """CPU clock ticks of one process from /proc/PID/stat text: utime + stime + cutime + cstime (its own threads'
    and its reaped children's). The command name (field 2) may hold spaces and parentheses: split after the last ')'."""
    fields = text[text.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return sum(int(fields[i]) for i in (11, 12, 13, 14))  # fields 14-17 of proc(5)


def parse_cgroup_v2_max(text: str) -> float | None:
    """CPUs of a cgroup v2 `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none)."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def parse_cgroup_v1_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs of a cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` pair (quota -1 for none)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 `cpu.max` or v1 CFS quota), None when unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    paths = {ctrl: path.lstrip("/") for _, ctrl, path in (line.split(":", 2) for line in lines if line.count(":") >= 2)}
    candidates = [root / paths.get("", "") / "cpu.max", root / "cpu.max"]
    for path in candidates:
        try:
            return parse_cgroup_v2_max(path.read_text())
        except (OSError, ValueError):
            continue
    v1 = next((path for ctrl, path in paths.items() if "cpu" in ctrl.split(",")), "")
    for base in (root / "cpu" / v1, root / "cpu,cpuacct" / v1, root / "cpu"):
        try:
            quota, period = (base / "cpu.cfs_quota_us").read_text(), (base / "cpu.cfs_period_us").read_text()
            return parse_cgroup_v1_quota(quota, period)
        except (OSError, ValueError):
            continue
    return None


def usable_cores() -> int:
    """Physical cores this process may use, capped by its cgroup CPU quota (rounded up)."""
    cores = physical_cores()
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, math.ceil(limit - 1e-9)))


def _allowed_cpus() -> set[int] | None:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (the async generation process, reward workers), from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{current}/task/{tid}/children").read_text().split()]
            except OSError:
                pass
    return out


def _tree_ticks(pid: int) -> int:
    ticks = 0
    for member in process_tree(pid):
        try:
            ticks += parse_pid_stat(Path(f"/proc/{member}/stat").read_text())
        except (OSError, ValueError, IndexError):
            pass  # exited meanwhile: its time moves to its parent's cutime
    return ticks


@dataclass(frozen=True)
class CpuSnapshot:
    """Clock ticks at one moment: `busy_ticks` of the CPUs this process may use, `own_ticks` of its process tree."""

    wall_s: float
    busy_ticks: int
    own_ticks: int


def take_snapshot() -> CpuSnapshot | None:
    """The CPU counters now, or None where /proc is not there (not Linux)."""
    try:
        busy, _ = parse_proc_stat(Path("/proc/stat").read_text(), _allowed_cpus())
    except OSError:
        return None
    return CpuSnapshot(time.monotonic(), busy, _tree_ticks(os.getpid()))


def others_busy_cores(before: CpuSnapshot, after: CpuSnapshot, ticks_per_s: float | None = None) -> float:
    """CPUs other processes kept busy between two snapshots (busy time of all, less this process tree's own)."""
    hz = ticks_per_s or os.sysconf("SC_CLK_TCK")
    wall_s = after.wall_s - before.wall_s
    if wall_s <= 0:
        return 0.0
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    return max(0.0, others / hz / wall_s)


def choose_threads(cores: int, others_busy: float, reserved: int = 0) -> int:
    """Threads for `cores` usable cores when other processes keep `others_busy` CPUs busy: the cores at least
    FREE_CORE_MIN idle, less `reserved` (taken by our own generation process), at least 1.

    >>> choose_threads(2, 0.05), choose_threads(2, 0.3), choose_threads(2, 1.0), choose_threads(16, 4.1)
    (2, 1, 1, 12)
    """
    free = math.floor(cores - others_busy + (1 - FREE_CORE_MIN) + 1e-9)
    return max(1, min(cores, free) - reserved)


_START: CpuSnapshot | None = take_snapshot()  # at first import: `rollwise.cli` imports this module before torch


def measure_others_busy(min_window_s: float = START_WINDOW_S) -> float:
    """CPUs other processes kept busy since this module was imported (the imports of a CLI run), waiting until
    the window spans `min_window_s`; a start snapshot older than STALE_BASELINE_S is replaced by a fresh one."""
    global _START
    start = _START
    if start is None or time.monotonic() - start.wall_s > STALE_BASELINE_S:
        start = take_snapshot()
        if start is None:
            return 0.0
    wait_s = min_window_s - (time.monotonic() - start.wall_s)
    if wait_s > 0:
        time.sleep(wait_s)
    now = take_snapshot()
    _START = now
    return others_busy_cores(start, now) if now is not None else 0.0


def threads_from_env(environ: dict[str, str] | None = None) -> int | str:
    """`ROLLWISE_THREADS`: a positive number, "cores" (one thread per physical core, load ignored), or "auto"/unset
    (returned as 0). Anything else is an error naming the variable."""
    value = (environ if environ is not None else os.environ).get(THREADS_ENV, "auto").strip().lower()
    if value in ("", "auto", "0"):
        return 0
    if value == "cores":
        return "cores"
    if value.isdigit():
        return int(value)
    raise ValueError(f"{THREADS_ENV}={value!r}: expected a positive number of threads, 'cores' or 'auto'")


def auto_threads(reserved: int = 0) -> int:
    """Threads to run now: `ROLLWISE_THREADS` if it names a number or "cores", else `choose_threads` over the
    usable cores and the CPU other processes use (measured, see `measure_others_busy`)."""
    setting = threads_from_env()
    if setting == "cores":
        return max(1, physical_cores() - reserved)
    if setting:
        return max(1, int(setting) - reserved)
    cores, others = usable_cores(), measure_others_busy()
    chosen = choose_threads(cores, others, reserved)
    if chosen + reserved < cores:
        _note(f"{chosen + reserved} of {cores} cores (other processes kept {others:.1f} CPUs busy)")
    return chosen


def _note(message: str) -> None:
    import sys

    print(f"rollwise: threads: {message}; set {THREADS_ENV} or model.threads to choose", file=sys.stderr, flush=True)


class ThreadGovernor:
    """Re-chooses torch's threads from the CPU other processes use, at most once every `interval_s`.

    Call `maybe_adjust()` between units of work (a step, a decode step) on the thread that runs the torch ops:
    OpenMP's thread count is per calling thread, so a background thread cannot change it. Fewer threads are
    taken at once (a spinning pool beside a competitor is the expensive case); more only after two windows agree.
    """

    def __init__(self, cores: int, threads: int, interval_s: float = 2.0):
        self.cores, self.threads, self.interval_s = cores, threads, interval_s
        self._last = take_snapshot()
        self._raise_votes = 0

    def maybe_adjust(self) -> int | None:
        """The new thread count when it changed (torch is set to it), else None."""
        if self._last is None or time.monotonic() - self._last.wall_s < self.interval_s:
            return None
        now = take_snapshot()
        if now is None:
            return None
        others = others_busy_cores(self._last, now)
        self._last = now
        wanted = self.decide(others)
        if wanted is None:
            return None
        import torch

        torch.set_num_threads(wanted)
        _note(f"{self.threads} -> {wanted} of {self.cores} cores (other processes kept {others:.1f} CPUs busy)")
        self.threads = wanted
        return wanted

    def decide(self, others_busy: float) -> int | None:
        """The thread count to switch to after a window in which others kept `others_busy` CPUs busy, or None
        to stay: down at once, up on the second window in a row that asks for more."""
        wanted = choose_threads(self.cores, others_busy)
        if wanted > self.threads:
            self._raise_votes += 1
            if self._raise_votes < 2:
                return None
        self._raise_votes = 0
        return None if wanted == self.threads else wanted


_GOVERNOR: ThreadGovernor | None = None


def configure_threads(threads: int = 0, reserved: int = 0) -> int:
    """Set torch's intra-op threads; returns the number set. `threads` > 0 is used as given; 0 means
    `auto_threads(reserved)`: the free cores now (or `ROLLWISE_THREADS`), re-checked by `adapt_threads()`."""
    import torch

    global _GOVERNOR
    n = threads or auto_threads(reserved)
    torch.set_num_threads(n)
    adaptive = not threads and not reserved and threads_from_env() == 0
    _GOVERNOR = ThreadGovernor(usable_cores(), n) if adaptive else None
    return n


def adapt_threads() -> int | None:
    """Re-check the free cores (at most every 2 s) when the threads were chosen automatically; the new count
    when it changed. Cheap when not due: call it once per step or decode step, on the thread that runs torch."""
    return _GOVERNOR.maybe_adjust() if _GOVERNOR is not None else None
