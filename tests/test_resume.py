"""Resume: 2 steps + resume to 4 equals 4 straight steps bit for bit; a SIGKILLed CLI run resumes and finishes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ROLLWISE, read_rows, subprocess_env, tiny_config, tiny_overrides
from rollwise.loop import train
from rollwise.train.checkpoint import is_complete, list_checkpoints, load_trainer_state

# Dense reward so every step trains (a run where nothing is trained would make "equal weights" trivial).
BASE = {"reward.fn": "toy_plugins:digit_fraction", "run.save_every_steps": 2, "run.report": False, "eval.n": 8}
COMPARED_KEYS = ("reward/mean", "reward/std", "reward/accuracy", "reward/errors", "rollout/response_len_mean",
                 "rollout/tokens", "filter/kept_frac", "train/loss", "train/entropy", "train/grad_norm",
                 "train/clip_frac", "train/lr", "train/tokens", "mismatch/k3", "control/tokens_carried",
                 "control/groups_carried", "control/off_policy_token_frac", "replay/size", "replay/replayed_frac")


def quiet_train(cfg, run_dir: Path, resume: bool = False) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir, resume=resume)


def load_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(ckpt).state_dict()


# The schedule must not depend on train.steps (B's first part runs with steps=2): constant, with warm-up.
VARIANTS = {
    "default": {},
    "kl-warmup-ppo": {"algo.kl_coef": 0.05, "train.warmup_steps": 2, "train.ppo_epochs": 2,
                      "train.minibatches_per_epoch": 2, "train.weight_decay": 0.01},
    # unfinished responses and the replay buffer cross the checkpoint
    "partial-replay": {"control.partial_rollouts": True, "control.over_provision": 2.0, "rollout.stop": ["e"],
                       "rollout.max_new_tokens": 24, "algo.is_correction": "tis_token", "replay.kind": "ssr",
                       "replay.mix_ratio": 0.5, "control.dynamic_sampling": True},
    # multi-turn episodes, some carried over mid-episode (their env state and transcript cross the checkpoint)
    "episodes-partial": {"env.name": "toy_plugins:toy_tool_env", "reward.fn": "toy_plugins:tool_call_fraction",
                         "env.max_turns": 3, "env.max_episode_tokens": 64, "control.partial_rollouts": True,
                         "control.over_provision": 2.0, "algo.is_correction": "tis_token",
                         "control.dynamic_sampling": True},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def straight_and_resumed(request, tmp_path_factory, tiny_model_dir):
    """Run A: 4 steps. Run B: 2 steps, then `train(..., resume=True)` with train.steps=4."""
    root = tmp_path_factory.mktemp(f"resume-{request.param}")
    a, b = root / "A", root / "B"
    base = {**BASE, **VARIANTS[request.param]}
    quiet_train(tiny_config(tiny_model_dir, **base, **{"train.steps": 4}), a)
    quiet_train(tiny_config(tiny_model_dir, **base, **{"train.steps": 2}), b)
    # step-2 (run.save_every_steps), and step-0 when the starting evaluation is the best (checkpoints/best)
    assert [p.name for p in list_checkpoints(b)][-1] == "step-2"
    summary = quiet_train(tiny_config(tiny_model_dir, **base, **{"train.steps": 4}), b, resume=True)
    return a, b, summary


def test_resumed_run_ends_with_exactly_equal_weights(straight_and_resumed):
    a, b, summary = straight_and_resumed
    assert summary["steps"] == 4
    for step in (2, 4):
        wa = load_state_dict(a / "checkpoints" / f"step-{step}")
        wb = load_state_dict(b / "checkpoints" / f"step-{step}")
        assert wa.keys() == wb.keys()
        different = [k for k in wa if not torch.equal(wa[k], wb[k])]
        assert not different, f"step {step}: tensors differ: {different[:5]}"
    # the weights did move: the comparison is not trivially between two copies of one model
    w2, w4 = load_state_dict(a / "checkpoints" / "step-2"), load_state_dict(a / "checkpoints" / "step-4")
    assert any(not torch.equal(w2[k], w4[k]) for k in w2)


def test_resumed_run_restores_trainer_state(straight_and_resumed):
    a, b, _ = straight_and_resumed
    sa = load_trainer_state(a / "checkpoints" / "step-4")
    sb = load_trainer_state(b / "checkpoints" / "step-4")
    assert sa["step"] == sb["step"] == 4
    assert sa["data_position"] == sb["data_position"] >= 4 * 4  # 4 prompts per step (more with over-provision)
    assert repr(sa["controller"]) == repr(sb["controller"]) and repr(sa["replay"]) == repr(sb["replay"])
    assert sa["engine_version"] == sb["engine_version"] == 4
    assert torch.equal(sa["rng"]["engine"], sb["rng"]["engine"])
    assert torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])
    assert sa["scheduler"]["last_epoch"] == sb["scheduler"]["last_epoch"]
    opt_a, opt_b = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for k in opt_a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a[k][name], opt_b[k][name]), (k, name)


def test_resumed_run_generates_the_same_samples(straight_and_resumed):
    a, b, _ = straight_and_resumed
    for step in (1, 2, 3, 4):
        name = f"samples/step-{step}.jsonl"
        assert (a / name).read_text() == (b / name).read_text(), name


def test_resumed_run_writes_the_same_metrics_rows(straight_and_resumed):
    a, b, _ = straight_and_resumed
    rows_a = {(r["kind"], r["step"]): r for r in read_rows(a)}
    rows_b = {(r["kind"], r["step"]): r for r in read_rows(b)}
    for step in (3, 4):
        assert ("train", step) in rows_b, f"resumed run has no metrics row for step {step}"
        ra, rb = rows_a[("train", step)], rows_b[("train", step)]
        assert {k: ra.get(k) for k in COMPARED_KEYS} == {k: rb.get(k) for k in COMPARED_KEYS}
    assert ("eval", 4) in rows_b
    assert rows_a[("eval", 4)]["eval/sampled_accuracy"] == rows_b[("eval", 4)]["eval/sampled_accuracy"]


def test_rows_before_the_resume_point_match(straight_and_resumed):
    a, b, _ = straight_and_resumed
    rows_a = {(r["kind"], r["step"]): r for r in read_rows(a)}
    rows_b = {(r["kind"], r["step"]): r for r in read_rows(b)}
    for step in (1, 2):
        ra, rb = rows_a[("train", step)], rows_b[("train", step)]
        assert {k: ra.get(k) for k in COMPARED_KEYS} == {k: rb.get(k) for k in COMPARED_KEYS}


# --------------------------------------------------------------------------------- SIGKILL + resume

KILL_STEPS = 6


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, tiny_model_dir):
    """A CLI run checkpointing every step, SIGKILLed after its first checkpoint (step-0, its starting evaluation
    being its best so far: checkpoints/best; or a later one), then `--resume`d."""
    run_dir = tmp_path_factory.mktemp("kill") / "run"
    overrides = tiny_overrides(tiny_model_dir, **{
        "reward.fn": "toy_plugins:slow_digit_fraction",  # sleeps per sample while ROLLWISE_TEST_REWARD_SLEEP is set
        "train.steps": KILL_STEPS,
        "run.save_every_steps": 1,
        "eval.n": 4,
    })
    env = subprocess_env()
    env["ROLLWISE_TEST_REWARD_SLEEP"] = "0.05"  # 16 samples x 0.05 s: ~0.8 s a step, time to kill mid-run
    proc = subprocess.Popen([ROLLWISE, "train", "--run-dir", str(run_dir), *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 90
    try:
        while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert latest.exists(), f"no checkpoint appeared (rc={proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"run ended before the kill (rc={proc.returncode}):\n{output}"
    killed_at = sorted(int(p.name.split("-")[1]) for p in list_checkpoints(run_dir))
    assert killed_at and killed_at[-1] < KILL_STEPS
    snapshot = {p.name: load_state_dict(p) for p in list_checkpoints(run_dir)}

    resumed = subprocess.run([ROLLWISE, "train", "--resume", str(run_dir)], capture_output=True, text=True,
                             timeout=120, env=subprocess_env())
    return run_dir, killed_at, snapshot, resumed


def test_killed_run_resumes_and_finishes(killed_and_resumed):
    run_dir, killed_at, _, resumed = killed_and_resumed
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{KILL_STEPS}"
    steps = [int(p.name.split("-")[1]) for p in list_checkpoints(run_dir)]
    assert steps == list(range(0, KILL_STEPS + 1))  # step-0: the starting model, kept as the first best
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == KILL_STEPS
    assert load_trainer_state(run_dir / "checkpoints" / f"step-{KILL_STEPS}")["data_position"] == KILL_STEPS * 4
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temp entries left behind: {leftovers}"


def test_checkpoints_from_before_the_kill_stay_loadable_and_unchanged(killed_and_resumed):
    run_dir, killed_at, snapshot, _ = killed_and_resumed
    for name, before in snapshot.items():
        ckpt = run_dir / "checkpoints" / name
        assert is_complete(ckpt), name
        after = load_state_dict(ckpt)
        assert all(torch.equal(before[k], after[k]) for k in before), name
    for ckpt in list_checkpoints(run_dir):
        AutoModelForCausalLM.from_pretrained(ckpt)


def test_killed_and_resumed_run_has_each_step_once_in_metrics(killed_and_resumed):
    run_dir, *_ = killed_and_resumed
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, KILL_STEPS + 1))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, KILL_STEPS]


def test_resumed_summary_reports_the_first_evaluation(straight_and_resumed):
    a, b, summary = straight_and_resumed
    first = next(r for r in read_rows(b) if r.get("kind") == "eval" and r["step"] == 0)
    assert summary["eval_before"]["eval/sampled_accuracy"] == first["eval/sampled_accuracy"]
    assert summary["eval_after"]["step"] == 4
