"""Distillation settings that cannot run together stop `rollwise train --dry-run` with one line (exit 2), and
those that need the models to tell stop the run at start, before any step, with one line too."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from conftest import tiny_overrides
from rollwise.cli import app
from test_distill_state import _recipe

ENGINE_TEACHER = {"teacher.weights": "base", "teacher.context": "hint", "teacher.backend": "engine"}
MIXTURE = {"algo.is_correction": "tis_token"}


def _demos(tmp_path) -> str:
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "response": f"{i + 1}"}) + "\n"
                            for i in range(4)))
    return str(path)


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("body, overrides, message", [
    ("", {**ENGINE_TEACHER, "distill.trb_steps": 2}, "teacher.backend = 'engine' only scores"),
    ("", {**ENGINE_TEACHER, **MIXTURE, "distill.teacher_rollouts_per_group": 1},
     "teacher.backend = 'engine' only scores"),
    ('[[stage]]\nkind = "sft"\nsteps = 1\ndata = "{demos}"\n[[stage]]\nkind = "rl"\nsteps = 1\n',
     {"algo.advantage": "gae"}, "no reward for algo.advantage = 'gae'"),
    ('[[stage]]\nkind = "rl"\nsteps = 2\ndata = "{demos}"\n', {}, r"\[\[stage\]\] number 1 \(kind 'rl'\) has data"),
    ("", {"distill.objective": "gkd"}, "distill.objective = 'gkd' is a loss against a teacher"),
])
def test_combinations_that_cannot_run_fail_at_dry_run_in_one_line(tmp_path, tiny_model_dir, body, overrides,
                                                                     message):
    recipe = _recipe(tmp_path, tiny_model_dir, "\n" + body.format(demos=_demos(tmp_path)), **overrides)
    line = _one_error_line(CliRunner().invoke(app, ["train", str(recipe), "--dry-run"]))
    assert re.search(message, line), line


def test_a_gkd_top_k_over_the_vocabulary_stops_the_run_before_any_step(tmp_path, tiny_model_dir):
    args = tiny_overrides(tiny_model_dir, **{"teacher.weights": "base", "teacher.context": "hint",
                                             "distill.objective": "gkd", "teacher.top_k": 1000, "eval.n": 0})
    line = _one_error_line(CliRunner().invoke(app, ["train", "--run-dir", str(tmp_path / "run"), *args]))
    assert "teacher.top_k = 1000 is more than the teacher's 476 tokens" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
