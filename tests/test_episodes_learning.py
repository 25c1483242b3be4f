"""End to end with the real loop and multi-turn episodes: a random tiny model learns to call a toy tool."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

from conftest import read_rows, tiny_config
from rollwise.loop import train

TOOL_LEARN = {
    "reward.fn": "toy_plugins:tool_call_fraction",
    "env.name": "toy_plugins:toy_tool_env",
    "env.max_turns": 3,
    "env.max_episode_tokens": 64,
    "rollout.prompts_per_step": 4,
    "rollout.samples_per_prompt": 8,
    "rollout.max_new_tokens": 8,
    "train.lr": 3e-3,
    "train.steps": 20,
    "eval.n": 0,
    "run.report": True,
    "run.samples_logged_per_step": 2,
}


def test_random_tiny_model_learns_to_call_a_toy_tool(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(tiny_config(tiny_model_dir, **TOOL_LEARN), run_dir)
    assert summary["steps"] == 20
    rows = [r for r in read_rows(run_dir) if r["kind"] == "train"]
    calls = [r["episode/tool_calls_mean"] for r in rows]
    first, last = statistics.fmean(calls[:4]), statistics.fmean(calls[-4:])
    assert last >= first + 0.5, f"no clear learning: tool calls per episode {first:.2f} -> {last:.2f}"
    # the trainer saw exactly what the engine sampled, on the policy's tokens only (steps that trained)
    gaps = [r["mismatch/logprob_abs_diff_mean"] for r in rows if r["mismatch/logprob_abs_diff_mean"] is not None]
    assert len(gaps) >= 10 and max(gaps) < 1e-3
    assert all(r["episode/policy_tokens_mean"] < r["episode/tokens_mean"] for r in rows[-4:])
    logged = [json.loads(line) for line in (run_dir / "samples" / "step-20.jsonl").read_text().splitlines()]
    assert logged and all(row["transcript"][-1]["role"] == "assistant" for row in logged)
    assert "Episodes" in (run_dir / "report.html").read_text()


def test_episodes_with_dynamic_sampling_and_partial_rollouts(tmp_path, tiny_model_dir):
    """Episodes through the Control stage's refills and carried-over partial episodes (resume of such a run:
    tests/test_resume.py, variant episodes-partial)."""
    options = {**TOOL_LEARN, "train.steps": 3, "control.dynamic_sampling": True, "control.max_sampling_rounds": 2,
               "control.partial_rollouts": True, "control.over_provision": 2.0, "algo.is_correction": "tis_token",
               "run.report": False}
    with contextlib.redirect_stdout(io.StringIO()):
        train(tiny_config(tiny_model_dir, **options), tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert len(rows) == 3 and all(r["episode/n"] > 0 for r in rows)
    assert sum(r["control/responses_aborted"] for r in rows) > 0  # some episodes were carried over
    assert any(r["control/tokens_carried"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_mean"] is None or r["mismatch/logprob_abs_diff_mean"] < 1e-3 for r in rows)
