"""Bad inputs end in one clear `error:` line: a table of real `rollwise train` subprocesses.

Each row is a real CLI invocation on the tiny model: its exit code and the words its last `error:` line must
contain. No row may print a Python traceback (the full one goes to RUN_DIR/error.log). Rows that must train
(a TRL-style float reward) check what the run wrote instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROLLWISE, read_rows, subprocess_env, tiny_config, tiny_overrides

pytestmark = pytest.mark.slow

DENSE_REWARD = "reward.fn=toy_plugins:digit_fraction"  # rewards vary within groups: every step trains
GOOD_ROWS = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(40)]


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_train(args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    full_env = {**subprocess_env(), **(env or {})}
    return subprocess.run([ROLLWISE, "train", *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def last_error_line(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors, f"no error line; rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: "), "the error line must come last"
    return errors[-1]


def data_files(tmp: Path) -> dict[str, str]:
    good = [json.dumps(r) for r in GOOD_ROWS]
    return {
        "malformed": write_jsonl(tmp / "malformed.jsonl", good[:2] + ['{"prompt": "What is 1 + 1?", "answer": '] + good[3:]),
        "missing": write_jsonl(tmp / "missing.jsonl", good[:4] + [json.dumps({"prompt": "What is 2 + 2?"})] + good[5:]),
        "empty": write_jsonl(tmp / "empty.jsonl", []),
    }


def _fill(override: str, files: dict[str, str]) -> str:
    for key, path in files.items():
        override = override.replace("{" + key + "}", path)
    return override


# (id, overrides (with {placeholders}), expected exit code, words the error line must contain)
TABLE = [
    ("unknown key", ["train.stepz=3"], 2, ["unknown key 'train.stepz'", "steps"]),
    ("bad value", ["train.steps=-1"], 2, ["train.steps", "greater than or equal to 0"]),
    ("bad stop string", ['rollout.stop=[""]'], 2, ["rollout.stop", "empty stop string"]),
    ("eval max_new_tokens 0", ["eval.max_new_tokens=0"], 2, ["eval.max_new_tokens", "greater than 0"]),
    ("server engine without its URL", ["rollout.engine=openai"], 2, ["rollout.engine", "rollout.server"]),
    ("unknown loss", ["algo.loss=ppo_clp"], 2, ["algo.loss = 'ppo_clp'", "valid:", "ppo_clip"]),
    ("unknown advantage", ["algo.advantage=grp"], 2, ["algo.advantage = 'grp'", "grpo", "gae"]),
    ("unknown aggregation", ["algo.aggregation=mean"], 2, ["algo.aggregation = 'mean'", "token_mean"]),
    ("unknown kl estimator", ["algo.kl_estimator=k9"], 2, ["algo.kl_estimator = 'k9'", "k3"]),
    ("unknown is correction", ["algo.is_correction=tis"], 2, ["algo.is_correction = 'tis'", "tis_token"]),
    ("unknown shaping", ["algo.shaping={overlong={}}"], 2, ["algo.shaping.overlong", "overlong_soft"]),
    ("unknown reward", ["reward.fn=arithm"], 2, ["reward.fn = 'arithm'", "arith"]),
    ("unknown task", ["data.task=arth"], 2, ["data.task = 'arth'", "letters"]),
    ("unimportable plugin", ["reward.fn=no_such_module:score"], 2, ["reward.fn", "cannot import module 'no_such_module'"]),
    ("plugin without the attribute", ["reward.fn=toy_plugins:no_such_fn"], 2, ["toy_plugins", "no attribute 'no_such_fn'"]),
    ("bad loss option", ["algo.loss_options={clip_q=1.0}"], 2, ["algo.loss_options", "clip_q"]),
    ("missing model", ["model.name=/no/such/model"], 2, ["/no/such/model", "not found"]),
    ("malformed JSONL row", ["data.path={malformed}"], 2, ["malformed.jsonl", "line 3", "not valid JSON"]),
    ("missing field", ["data.path={missing}"], 2, ["missing.jsonl", "answer"]),
    ("empty dataset", ["data.path={empty}"], 2, ["empty.jsonl", "empty"]),
    ("fact split for a task without it", ["data.task=letters", 'data.split="fact"'], 2,
     ["data.split", "letters", "arith"]),
    ("missing data file", ["data.path=/no/such/data.jsonl"], 2, ["data.path", "/no/such/data.jsonl"]),
    ("always-raising reward stops", ["reward.fn=toy_plugins:always_raises", "train.steps=6"], 2,
     ["every reward failed", "2 steps", "this reward always fails"]),
    ("NaN loss stops after the limit", ["algo.loss=toy_plugins:nan_loss", "reward.fn=toy_plugins:digit_fraction",
                                        "train.steps=6"], 2,
     ["NaN/Inf", "3 steps in a row", "train.max_nonfinite_steps"]),
]


@pytest.mark.parametrize("case", TABLE, ids=[row[0] for row in TABLE])
def test_bad_input_ends_in_one_error_line(case, tmp_path, tiny_model_dir):
    name, overrides, code, words = case
    files = data_files(tmp_path)
    args = [_fill(o, files) for o in overrides]
    run_dir = tmp_path / "run"
    proc = run_train([*tiny_overrides(tiny_model_dir), *args, "--run-dir", str(run_dir)])
    assert proc.returncode == code, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    line = last_error_line(proc)
    for word in words:
        assert word in line, f"{word!r} not in: {line}"
    assert "Traceback (most recent call last)" not in proc.stdout + proc.stderr or name.startswith("always")
    if name.startswith("always"):  # the reward's own traceback is printed once, above the error line
        assert "FlakyRewardError" in proc.stderr and "toy_plugins.py" in proc.stderr


def test_float_reward_trains(tmp_path, tiny_model_dir):
    """A reward that returns a plain float (TRL style) is a reward, not a failure: the run trains on it."""
    run_dir = tmp_path / "run"
    proc = run_train([*tiny_overrides(tiny_model_dir), "reward.fn=toy_plugins:float_digit_fraction",
                      "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in read_rows(run_dir) if r.get("kind") == "train"]
    assert all(r["reward/errors"] == 0 for r in rows)
    assert sum(r.get("train/tokens") or 0 for r in rows) > 0


def test_nan_loss_skips_updates_and_never_checkpoints_nan(tmp_path, tiny_model_dir):
    """One poisoned minibatch is skipped and counted; weights stay those of the start; checkpoints stay finite."""
    run_dir = tmp_path / "run"
    proc = run_train([*tiny_overrides(tiny_model_dir), "algo.loss=toy_plugins:nan_loss", "train.steps=2", DENSE_REWARD,
                      "run.save_every_steps=1", "--run-dir", str(run_dir)], env={"ROLLWISE_TEST_NAN_CALLS": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in read_rows(run_dir) if r.get("kind") == "train"]
    assert [r["train/nonfinite_steps"] for r in rows] == [1.0, 0.0]
    assert rows[0]["train/loss"] == "nan"  # written as the string, never as null ("not measured")
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    step1 = load_file(str(run_dir / "checkpoints" / "step-1" / "model.safetensors"))
    for key, value in step1.items():
        assert torch.isfinite(value).all()
        assert torch.equal(value, start[key]), f"{key} changed by a skipped update"
    step2 = load_file(str(run_dir / "checkpoints" / "step-2" / "model.safetensors"))
    assert any(not torch.equal(step2[k], start[k]) for k in step2)  # the next, finite step did update


def test_nan_stop_leaves_only_finite_checkpoints(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    proc = run_train([*tiny_overrides(tiny_model_dir), "algo.loss=toy_plugins:nan_loss", "train.steps=6", DENSE_REWARD,
                      "run.save_every_steps=1", "--run-dir", str(run_dir)])
    assert proc.returncode == 2
    assert (run_dir / "error.log").read_text().count("NonFiniteError") >= 1
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    # step-0: the starting model, the best evaluation so far (checkpoints/best); step 3 hit the limit before saving
    assert [c.name for c in checkpoints] == ["step-0", "step-1", "step-2"]
    for ckpt in checkpoints:
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "model.safetensors")).values())


def _mount_small_fs(path: Path, size_kib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_disk_full_at_checkpoint_keeps_the_previous_one(tmp_path, tiny_model_dir):
    """The run directory on a small tmpfs with room for one checkpoint, not two: a real ENOSPC at step 2."""
    args = [*tiny_overrides(tiny_model_dir), "run.save_every_steps=1", "run.report=false", DENSE_REWARD]
    probe = tmp_path / "probe"  # how much one checkpoint and the rest of a run directory take
    assert run_train([*args, "train.steps=1", "--run-dir", str(probe)]).returncode == 0
    one_ckpt = _tree_bytes(probe / "checkpoints" / "step-1")
    mount = tmp_path / "small"
    if not _mount_small_fs(mount, size_kib=int((_tree_bytes(probe) + 0.5 * one_ckpt) / 1024) + 64):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run_dir = mount / "run"
        proc = run_train([*args, "train.steps=3", "--run-dir", str(run_dir)])
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = last_error_line(proc)
        assert "disk full" in line and "checkpoints/step-2" in line and "MiB" in line, line
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-1"
        from rollwise.train.checkpoint import latest_checkpoint
        assert latest_checkpoint(run_dir).name == "step-1"
        rows = read_rows(run_dir)  # every line parses: metrics written so far are intact
        assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2]
        assert not any(p.name.startswith(".step-") for p in (run_dir / "checkpoints").iterdir())
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_ctrl_c_mid_step_exits_130_and_resumes(tmp_path, tiny_model_dir):
    """SIGINT during a step: the step finishes, a checkpoint is written, exit 130, nothing left running."""
    import psutil

    run_dir = tmp_path / "run"
    args = [*tiny_overrides(tiny_model_dir), "train.steps=4", "reward.fn=toy_plugins:slow_digit_fraction",
            "--run-dir", str(run_dir)]
    env = {**subprocess_env(), "ROLLWISE_TEST_REWARD_SLEEP": "0.1"}  # 16 samples: 1.6 s of scoring per step
    proc = subprocess.Popen([ROLLWISE, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and '"kind":"train"' not in (run_dir / "metrics.jsonl").read_text():
        time.sleep(0.2)
    time.sleep(0.5)  # inside step 2
    children = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "interrupted" in last_error_line(subprocess.CompletedProcess([], 130, out, err))
    assert "--resume" in err
    time.sleep(0.5)
    assert not [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    from rollwise.train.checkpoint import latest_checkpoint

    saved = latest_checkpoint(run_dir)
    assert saved is not None and saved.name == "step-2"
    resumed = run_train(["--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr
    steps = [r["step"] for r in read_rows(run_dir) if r.get("kind") == "train"]
    assert steps == [1, 2, 3, 4]


def test_config_with_plugin_names_round_trips_through_resume(tmp_path, tiny_model_dir):
    """A plugin name with a dot and a colon as an inline-table key is written quoted: --resume reads it."""
    run_dir = tmp_path / "run"
    shaping = 'algo.shaping={"toy_plugins:length_bonus"={scale=0.0}}'
    proc = run_train([*tiny_overrides(tiny_model_dir), shaping, "run.save_every_steps=1", "train.steps=1",
                      "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    assert '"toy_plugins:length_bonus" = {scale = 0.0}' in (run_dir / "config.toml").read_text()
    resumed = run_train(["--resume", str(run_dir), "train.steps=2"])
    assert resumed.returncode == 0, resumed.stderr


def test_ctrl_c_after_a_steps_row_and_before_the_next_step_still_saves(tmp_path, tiny_model_dir, monkeypatch):
    """SIGINT while the step's samples are being logged (after its row, before the next step): that iteration
    counts as the step's, so it finishes, saves step 1 and stops, instead of stopping with no checkpoint."""
    import contextlib
    import io
    import os

    import rollwise.loop as loop
    from rollwise.interrupt import RunInterrupted
    from rollwise.train.checkpoint import latest_checkpoint

    real = loop.log_samples

    def interrupted_logging(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled by the run's Ctrl-C handler
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "log_samples", interrupted_logging)
    cfg = tiny_config(tiny_model_dir, **{"train.steps": 3, "eval.n": 0, "reward.fn": "toy_plugins:digit_fraction"})
    with pytest.raises(RunInterrupted) as stopped, contextlib.redirect_stdout(io.StringIO()):
        loop.train(cfg, tmp_path / "run")
    assert stopped.value.checkpoint is not None and stopped.value.checkpoint.name == "step-1"
    assert latest_checkpoint(tmp_path / "run").name == "step-1"
