"""`train.early_stop`: real tiny runs whose held-out metric rises then collapses (tests/toy_eval_plugins.py
`peak_at_step_2`: all prompts correct at policy version 2), the best checkpoint kept and evaluable, resume, and
bad settings failing at --dry-run."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.train.checkpoint import best_checkpoint, list_checkpoints, mark_best, save_checkpoint

EARLY = {"metric": "eval/greedy_accuracy", "patience": 2}


def _train(args: list[str]):
    return CliRunner().invoke(app, ["train", *args])


def _overrides(model_dir, **extra):
    return tiny_overrides(model_dir, **{"reward.fn": "toy_eval_plugins:peak_at_step_2", "eval.every_steps": 1,
                                        "eval.n": 16, "run.keep_checkpoints": 1, **extra})


def _evals(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval/greedy_accuracy"] for r in read_rows(run_dir) if r["kind"] == "eval"}


@pytest.mark.slow
def test_a_run_that_peaks_stops_after_patience_and_keeps_the_peak(tmp_path, tiny_model_dir):
    """Evaluations at steps 0..4 rise to 1.0 at step 2 and fall: with patience 2 the run stops after step 4,
    says so in one line naming step 2, keeps checkpoints/best -> step-2 although run.save_every_steps = 0 and
    run.keep_checkpoints = 1 (the final checkpoint step-4 is `latest`), and `rollwise eval --best` (or
    RUN/checkpoints/best) evaluates step-2."""
    run_dir = tmp_path / "run"
    result = _train([*_overrides(tiny_model_dir, **{"train.steps": 10, "train.early_stop": EARLY}),
                     "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    evals = _evals(run_dir)
    assert sorted(evals) == [0, 1, 2, 3, 4] and evals[2] == 1.0 and max(evals[3], evals[4]) < 1.0
    assert [r["step"] for r in read_rows(run_dir) if r["kind"] == "train"] == [1, 2, 3, 4]
    [line] = [ln for ln in result.output.splitlines() if "early stop" in ln]
    assert line.startswith("rollwise: early stop after step 4: eval/greedy_accuracy has not improved on 1 "
                           "(step 2) for 2 evaluations; best checkpoint ") and "step-2 (checkpoints/best)" in line
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-2", "step-4"]
    assert (run_dir / "checkpoints" / "best").read_text().strip() == "step-2"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-4"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["early_stop"] == {"metric": "eval/greedy_accuracy", "best_step": 2, "best_value": 1.0,
                                     "stopped_early": True}
    assert summary["steps"] == 4
    for args in (["--model", str(run_dir), "--best"], ["--model", str(run_dir / "checkpoints" / "best")]):
        evaluated = CliRunner().invoke(app, ["eval", *args, "--n", "4", "--max-new-tokens", "4", "model.threads=1"])
        assert evaluated.exit_code == 0, evaluated.output
        assert json.loads(evaluated.stdout.strip().splitlines()[-1])["model"].endswith("checkpoints/step-2")


@pytest.mark.slow
def test_resume_keeps_the_early_stop_state(tmp_path, tiny_model_dir):
    """A run of 3 steps (best at step 2, one evaluation without improvement after it: the final one at step 3)
    resumed to 10 steps with patience 3 stops after step 5, two evaluations later: the count and the best went
    on where the checkpoint left them (a fresh count would take the step-4 evaluation as its best and stop
    after step 7)."""
    run_dir = tmp_path / "run"
    early = {"metric": "eval/greedy_accuracy", "patience": 3}
    first = _train([*_overrides(tiny_model_dir, **{"train.steps": 3, "train.early_stop": early}),
                    "--run-dir", str(run_dir)])
    assert first.exit_code == 0, first.output
    assert "is below the best 1.000 (step 2) by more than its noise" in first.output  # the step-3 evaluation
    resumed = _train(["--resume", str(run_dir), "train.steps=10"])
    assert resumed.exit_code == 0, resumed.output
    assert "early stop after step 5" in resumed.output and "(step 2) for 3 evaluations" in resumed.output
    assert sorted(_evals(run_dir)) == [0, 1, 2, 3, 4, 5]
    assert best_checkpoint(run_dir).name == "step-2"


@pytest.mark.slow
def test_a_run_that_reaches_its_last_step_did_not_stop_early(tmp_path, tiny_model_dir):
    """train.steps = 3, patience 1: the final evaluation (step 3) is the first without an improvement, but the
    run ended at train.steps: it names its best step (below which it ended) and is not reported as stopped
    early."""
    run_dir = tmp_path / "run"
    result = _train([*_overrides(tiny_model_dir, **{"train.steps": 3, "train.early_stop": {
        "metric": "eval/greedy_accuracy", "patience": 1}}), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert re.search(r"rollwise: the final greedy accuracy 0\.\d+ \(step 3\) is below the best 1\.000 \(step 2\)",
                     result.output)
    assert "early stop" not in result.output
    assert json.loads((run_dir / "summary.json").read_text())["early_stop"]["stopped_early"] is False


def test_eval_best_without_a_best_checkpoint_says_so(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_checkpoint(tmp_path, 1, model, AutoTokenizer.from_pretrained(tiny_model_dir), {})
    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path), "--best"])
    assert result.exit_code == 2, result.output
    assert "has no checkpoints/best naming a complete checkpoint: the run had no evaluation (eval.n = 0" in result.output


def test_best_is_never_pruned_and_names_only_complete_checkpoints(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    save_checkpoint(tmp_path, 1, model, tok, {})
    mark_best(tmp_path, 1)
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, model, tok, {}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-4"]
    assert best_checkpoint(tmp_path).name == "step-1"
    with pytest.raises(FileNotFoundError, match="step-9 is not a complete checkpoint"):
        mark_best(tmp_path, 9)
    assert not list((tmp_path / "checkpoints").glob(".best.tmp-*"))


@pytest.mark.parametrize("extra, message", [
    ({"train.early_stop": {"metric": "eval/greedy_acc"}},
     "train.early_stop.metric = 'eval/greedy_acc' is not written by the evaluation"),
    ({"train.early_stop": {"metric": "eval/pass@8"}, "eval.k": 4},
     "'eval/pass@8' is not written by the evaluation with eval.k = 4"),
    ({"train.early_stop": {"metric": "eval/greedy_accuracy"}, "eval.greedy": False},
     "is not written by the evaluation with eval.k = 1, eval.greedy = false"),
    ({"train.early_stop": {"metric": "eval/greedy_accuracy"}, "eval.every_steps": 0},
     "train.early_stop compares evaluations during the run: set eval.every_steps"),
    ({"train.early_stop": {"metric": "eval/greedy_accuracy"}, "eval.n": 0}, "set eval.n > 0"),
    ({"train.early_stop": {"metric": "eval/greedy_accuracy", "patience": -1}}, "train.early_stop.patience"),
    ({"train.early_stop": {"metric": "eval/greedy_accuracy", "mode": "up"}}, "train.early_stop.mode"),
])
def test_bad_early_stop_settings_fail_at_dry_run(tiny_model_dir, extra, message):
    result = _train([*tiny_overrides(tiny_model_dir, **{"eval.every_steps": 5, **extra}), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_good_early_stop_settings_pass_dry_run(tiny_model_dir):
    early = {"metric": "eval/pass@4", "patience": 3, "mode": "max", "min_delta": 0.01}
    result = _train([*tiny_overrides(tiny_model_dir, **{"eval.every_steps": 5, "eval.k": 4,
                                                        "train.early_stop": early}), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert 'early_stop = {metric = "eval/pass@4", mode = "max", patience = 3, min_delta = 0.01}' in result.output
