"""The thread choice on a shared machine (rollwise/hardware.py): parsers fed real /proc and cgroup text,
hand-computed choices, the CPU of real competitor processes, and the env/threads of real subprocesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollwise import hardware
from rollwise.hardware import (
    CpuSnapshot, ThreadGovernor, choose_threads, others_busy_cores, parse_cgroup_v1_quota, parse_cgroup_v2_max,
    parse_pid_stat, parse_proc_stat, process_tree, take_snapshot, threads_from_env,
)

LINUX = Path("/proc/stat").exists()
needs_proc = pytest.mark.skipif(not LINUX, reason="reads /proc")
HZ = os.sysconf("SC_CLK_TCK") if LINUX else 100


def test_parse_proc_stat_by_hand():
    text = ("cpu  10 1 5 100 7 2 3 4 0 0\n"
            "cpu0 6 1 2 50 3 1 2 3 0 0\n"
            "cpu1 4 0 3 50 4 1 1 1 0 0\n"
            "intr 12345 0 0\nctxt 999\n")
    # busy = user + nice + system + irq + softirq + steal; idle and iowait are not busy
    assert parse_proc_stat(text) == (10 + 1 + 5 + 2 + 3 + 4, 132)
    assert parse_proc_stat(text, {0}) == (6 + 1 + 2 + 1 + 2 + 3, 68)
    assert parse_proc_stat(text, {0, 1}) == (15 + 10, 68 + 64)


@needs_proc
def test_parse_proc_stat_real_file():
    text = Path("/proc/stat").read_text()
    busy, total = parse_proc_stat(text)
    per_cpu_busy, per_cpu_total = parse_proc_stat(text, set(range(os.cpu_count() or 1)))
    assert 0 < busy < total
    # the aggregate line is the sum of the per-CPU lines (the kernel reads them a moment apart: a few ticks)
    assert abs(per_cpu_total - total) <= 10 * (os.cpu_count() or 1)


def test_parse_pid_stat_name_with_spaces_and_parens():
    text = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 500 0 0 0 70 30 5 2 20 0 3 0 1000 0 0\n"
    assert parse_pid_stat(text) == 70 + 30 + 5 + 2  # utime stime cutime cstime


@needs_proc
def test_own_cpu_ticks_follow_process_time():
    before = parse_pid_stat(Path("/proc/self/stat").read_text())
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    after = parse_pid_stat(Path("/proc/self/stat").read_text())
    assert 0.3 * HZ - 3 <= after - before <= (time.process_time() - start) * HZ + 3


def test_cgroup_quota_text():
    assert parse_cgroup_v2_max("max 100000\n") is None
    assert parse_cgroup_v2_max("150000 100000\n") == 1.5
    assert parse_cgroup_v1_quota("-1\n", "100000\n") is None
    assert parse_cgroup_v1_quota("200000\n", "100000\n") == 2.0


@needs_proc
def test_cgroup_limit_of_this_machine_is_none_or_positive():
    limit = hardware.cgroup_cpu_limit()
    assert limit is None or limit > 0
    assert 1 <= hardware.usable_cores() <= hardware.physical_cores()


@pytest.mark.parametrize("cores, others, reserved, expected", [
    (2, 0.0, 0, 2),    # idle
    (2, 0.15, 0, 2),   # background noise: a core 85% free still counts
    (2, 0.3, 0, 1),    # a competitor on 30% of a core: a 2-thread pool would wait on it
    (2, 1.0, 0, 1),    # one busy loop
    (2, 2.0, 0, 1),    # never fewer than one
    (16, 4.1, 0, 12),
    (16, 0.0, 8, 8),   # async: the generation process's threads are reserved
    (4, 3.5, 2, 1),
])
def test_choose_threads(cores, others, reserved, expected):
    assert choose_threads(cores, others, reserved) == expected


def test_others_busy_cores_by_hand():
    before = CpuSnapshot(wall_s=10.0, busy_ticks=1000, own_ticks=300)
    after = CpuSnapshot(wall_s=12.0, busy_ticks=1000 + 300, own_ticks=300 + 100)  # 3 s busy of which 1 s ours
    assert others_busy_cores(before, after, ticks_per_s=100) == pytest.approx(1.0)
    assert others_busy_cores(after, after, ticks_per_s=100) == 0.0


def test_threads_from_env():
    assert threads_from_env({}) == 0
    assert threads_from_env({"ROLLWISE_THREADS": "auto"}) == 0
    assert threads_from_env({"ROLLWISE_THREADS": "3"}) == 3
    assert threads_from_env({"ROLLWISE_THREADS": "Cores"}) == "cores"
    with pytest.raises(ValueError, match="ROLLWISE_THREADS='two'"):
        threads_from_env({"ROLLWISE_THREADS": "two"})


def test_governor_lowers_at_once_and_raises_after_two_windows():
    governor = ThreadGovernor(cores=2, threads=2)
    assert governor.decide(0.05) is None
    assert governor.decide(1.0) == 1
    governor.threads = 1
    assert governor.decide(0.0) is None      # one quiet window is not enough
    assert governor.decide(0.9) is None      # ... and a busy one resets the count
    assert governor.decide(0.0) is None
    assert governor.decide(0.0) == 2


def _orphan_busy_loop() -> int:
    """A busy loop that is not our descendant (its shell parent exits), as another user's process is."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@needs_proc
def test_busy_loops_of_others_count_and_our_children_do_not():
    ours = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert ours.pid in process_tree(os.getpid())
        before = take_snapshot()
        time.sleep(0.5)
        after = take_snapshot()
        # our own busy child is ours: its ~0.5 s show in own_ticks, not in what others use
        assert after.own_ticks - before.own_ticks >= 0.3 * HZ
    finally:
        ours.kill()
        ours.wait()
    other = _orphan_busy_loop()
    try:
        assert other not in process_tree(os.getpid())
        time.sleep(0.1)
        before = take_snapshot()
        time.sleep(0.5)
        assert others_busy_cores(before, take_snapshot()) >= 0.7
    finally:
        os.kill(other, 9)


@needs_proc
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_governor_drops_to_one_thread_beside_a_competitor():
    old = torch.get_num_threads()
    governor = ThreadGovernor(cores=2, threads=2, interval_s=0.3)
    other = _orphan_busy_loop()
    try:
        time.sleep(0.4)
        assert governor.maybe_adjust() == 1
        assert torch.get_num_threads() == 1
        assert governor.maybe_adjust() is None  # not due yet
    finally:
        os.kill(other, 9)
        torch.set_num_threads(old)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@needs_proc
def test_cli_import_precedes_torch_and_openmp():
    """`rollwise.cli` takes the CPU snapshot at import and loads neither torch nor libgomp, so the OpenMP
    environment can still be chosen when a command starts."""
    out = _run_python("import sys, rollwise.cli, rollwise.hardware as h\n"
                      "maps = open('/proc/self/maps').read()\n"
                      "print('torch' in sys.modules, 'libgomp' in maps, h._START is not None)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]


@pytest.mark.slow
@needs_proc
def test_threads_set_in_a_real_process():
    code = ("import torch\nfrom rollwise.hardware import configure_threads, physical_cores\n"
            "n = configure_threads(0)\nprint(n, torch.get_num_threads(), physical_cores())")
    fixed = _run_python(code, ROLLWISE_THREADS="1")
    assert fixed.stdout.split()[:2] == ["1", "1"], fixed.stderr
    cores = _run_python(code, ROLLWISE_THREADS="cores")
    n, set_, physical = cores.stdout.split()
    assert n == set_ == physical
    bad = _run_python(code, ROLLWISE_THREADS="many")
    assert bad.returncode != 0 and "ROLLWISE_THREADS='many'" in bad.stderr


@pytest.mark.slow
@needs_proc
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_auto_threads_leave_a_busy_core_to_its_process():
    other = _orphan_busy_loop()
    try:
        time.sleep(0.2)
        out = _run_python("import torch\nfrom rollwise.hardware import configure_threads, physical_cores\n"
                          "print(configure_threads(0), torch.get_num_threads(), physical_cores())",
                          ROLLWISE_THREADS="auto")
    finally:
        os.kill(other, 9)
    n, set_, physical = map(int, out.stdout.split())
    assert n == set_ <= physical - 1
    assert f"rollwise: threads: {n} of {physical} cores" in out.stderr


def test_explicit_bf16_on_a_cpu_without_native_bf16_is_named_at_dry_run_with_the_measured_factor(monkeypatch, tmp_path):
    """`model.dtype = "bfloat16"` where the CPU lacks AVX512-BF16 / AMX: `--dry-run` says so in one line with
    the bf16 and fp32 matmul rates measured now; `auto` and fp32 say nothing."""
    from typer.testing import CliRunner

    import rollwise.hardware as hardware
    from rollwise.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    result = CliRunner().invoke(app, ["train", "--dry-run", "model.dtype=bfloat16", "train.precision=bf16"])
    assert result.exit_code == 0
    warning = [line for line in result.output.splitlines() if line.startswith("rollwise: warning:")]
    assert len(warning) == 1
    assert re.search(r"model.dtype = 'bfloat16' and train.precision = 'bf16' on a CPU without native bf16 .*"
                     r"runs at [\d.]+ GFLOP/s here against [\d.]+ in fp32 \(\d+x slower\)", warning[0]), warning[0]
    for quiet in (["model.dtype=auto", "train.precision=auto"], ["model.dtype=float32"]):
        out = CliRunner().invoke(app, ["train", "--dry-run", *quiet]).output
        assert "rollwise: warning:" not in out
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert "rollwise: warning:" not in CliRunner().invoke(app, ["train", "--dry-run", "model.dtype=bfloat16"]).output
