"""The asynchronous mode end to end: generation in its own process, the staleness bound, resume, and a clean
shutdown of the generation process when the run ends, fails or is interrupted with Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import json
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


EPISODES = {**ASYNC, "control.max_staleness": 1, "train.steps": 2, "rollout.max_new_tokens": 8,
            "env.max_turns": 3, "env.max_episode_tokens": 48, "run.samples_logged_per_step": 2}


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"data.task": "calc"}, {"env.name": "toy_plugins:toy_tool_env"}],
                         ids=["calc", "plugin_env"])
def test_episodes_run_in_the_generation_process_within_the_staleness_bound(make_config, tmp_path, env):
    """The environment is built again in the generation process from [env] (a built-in task's, or a plugin by
    dotted path); its episodes come back whole and train within the bound."""
    before = children()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(make_config(**EPISODES, **env), tmp_path / "run")
    assert summary["steps"] == 2
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert all(r["episode/n"] > 0 and r["rollout/tokens"] > 0 for r in rows)
    assert all(r["control/staleness_max"] <= 1 and r["control/groups_stale_dropped"] == 0 for r in rows)
    assert all("control/off_policy_token_frac" in r for r in rows)
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-2.jsonl").read_text().splitlines()]
    assert logged and all(row["transcript"][-1]["role"] == "assistant" for row in logged)
    if "env.name" in env:  # the tool ran in the child: calls came back with the episodes
        assert sum(r["episode/tool_calls_mean"] for r in rows) > 0
    else:  # calc's hard-sample substitution needs the engine in this process: off, and said so
        assert "hard-sample substitution needs the run's own engine; it is off with control.mode = 'async'" \
            in out.getvalue()
    assert children() == before


@pytest.mark.slow
def test_an_env_the_generation_process_cannot_build_stops_the_start_in_one_line(make_config, tmp_path):
    """A factory registered at run time in this process only: the child cannot import it."""
    from rollwise.envs import ENVS
    from rollwise.errors import UserError
    from rollwise.generate.process import GenerationSetupError
    from toy_plugins import toy_tool_env

    ENVS.register("registered_here_only")(toy_tool_env)
    before = children()
    try:
        with pytest.raises(GenerationSetupError) as raised:
            quiet_train(make_config(**EPISODES, **{"env.name": "registered_here_only"}), tmp_path / "run")
    finally:
        ENVS._entries.pop("registered_here_only")
    message = str(raised.value)
    assert isinstance(raised.value, UserError) and "\n" not in message
    assert message.startswith("in the generation process: env.name: unknown environment 'registered_here_only'")
    assert "name it as 'package.module:function'" in message
    assert children() == before
