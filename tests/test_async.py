"""The asynchronous mode end to end: generation in its own process, the staleness bound, resume, and a clean
shutdown of the generation process when the run ends, fails or is interrupted with Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import time

import psutil
import pytest

from conftest import ROLLWISE, read_rows, subprocess_env, tiny_overrides
from rollwise.loop import train

ASYNC = {"control.mode": "async", "algo.is_correction": "tis_token", "reward.fn": "toy_plugins:digit_fraction",
         "run.report": False, "eval.n": 4}


def children() -> set[int]:
    """Live child processes, except multiprocessing's resource tracker (one per parent, for its lifetime)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
    return out


def quiet_train(cfg, run_dir, resume=False):
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir, resume=resume)


@pytest.mark.parametrize("staleness", [0, 1])
def test_async_training_never_exceeds_the_staleness_bound(make_config, tmp_path, staleness):
    before = children()
    cfg = make_config(**ASYNC, **{"control.max_staleness": staleness, "train.steps": 5,
                                  "control.dynamic_sampling": True})
    summary = quiet_train(cfg, tmp_path / "run")
    assert summary["steps"] == 5
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert all(r["control/staleness_max"] <= staleness for r in rows if "control/staleness_max" in r)
    assert all(r["control/groups_stale_dropped"] == 0 for r in rows)  # bounded by construction, not by dropping
    if staleness:  # generation ran ahead of the trainer: later batches are one version old
        assert any(r.get("control/off_policy_token_frac", 0) > 0 for r in rows)
    else:
        assert all(r.get("control/off_policy_token_frac", 0) == 0 for r in rows)
    assert children() == before  # the generation process is gone


def test_async_run_resumes_with_its_submitted_prompts(make_config, tmp_path):
    run = tmp_path / "run"
    quiet_train(make_config(**ASYNC, **{"train.steps": 2, "run.save_every_steps": 2}), run)
    summary = quiet_train(make_config(**ASYNC, **{"train.steps": 4, "run.save_every_steps": 2}), run, resume=True)
    assert summary["steps"] == 4
    # prompts submitted to the generation process before the checkpoint are generated again, in order
    rows = [r for r in read_rows(run) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_a_failing_reward_in_async_mode_still_stops_the_generation_process(make_config, tmp_path):
    before = children()
    cfg = make_config(**{**ASYNC, "reward.fn": "toy_plugins:always_raises", "train.steps": 2})
    from rollwise.rewards import RewardsFailingError

    with pytest.raises(RewardsFailingError, match="every reward failed"):
        quiet_train(cfg, tmp_path / "run")
    assert children() == before


def test_ctrl_c_stops_the_async_run_and_its_generation_process(tiny_model_dir, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, **{**ASYNC, "reward.fn": "toy_plugins:slow_digit_fraction",
                                                  "train.steps": 50})
    env = subprocess_env()
    env["ROLLWISE_TEST_REWARD_SLEEP"] = "0.05"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([ROLLWISE, "train", "--run-dir", str(run_dir), *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and '"kind":"train"' in metrics.read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0]
        generator = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                     if "resource_tracker" not in " ".join(p.cmdline())]
        assert generator, "no generation process was started"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 15
    alive = generator
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in generator if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"orphan generation processes after Ctrl-C: {alive}\n{output}"
