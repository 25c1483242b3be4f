"""Evaluation when rewards fail: the accuracy is unknown (null), not 0, and the errors are counted."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from conftest import tiny_config
from rollwise.loop import train
from rollwise.rewards.scoring import RewardsFailingError


def test_an_eval_whose_rewards_all_fail_reports_no_accuracy_and_counts_the_errors(tmp_path, tiny_model_dir):
    """The starting evaluation of a run whose reward always raises: `eval/*_accuracy` are null (every answer an
    error is not an accuracy of 0, which is what was written before) and `eval/reward_errors` counts all 16."""
    cfg = tiny_config(tiny_model_dir, **{"eval.n": 16, "train.steps": 3, "reward.fn": "toy_plugins:always_raises"})
    with pytest.raises(RewardsFailingError), contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["kind"] == "eval")
    assert first["eval/sampled_accuracy"] is None and first["eval/greedy_accuracy"] is None
    assert first["eval/reward_errors"] == 16.0 and first["eval/greedy_reward_errors"] == 16.0


def test_rollwise_eval_with_every_prompt_too_long_is_a_user_error_not_a_bug_report(tiny_model_dir):
    """`rollwise eval` whose held-out prompts are all over data.max_prompt_tokens: exit code 2 and one line that
    names the key and what to do, not "an internal error: please report it"."""
    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from rollwise.cli import app

    overrides = [o for o in tiny_overrides(tiny_model_dir) if not o.startswith("model.name=")]
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n", "4", *overrides,
                                      "data.max_prompt_tokens=1"])
    assert result.exit_code == 2, result.output
    assert "data.max_prompt_tokens=1; raise it" in result.output and "internal error" not in result.output
