"""The best checkpoint, kept by default whenever a run evaluates (`train.keep_best`, rollwise/early_stop.py).

The CLI runs use `toy_eval_plugins:peak_at_step_2`: correctness by the policy version that sampled a response,
rising to every prompt correct at version 2 and falling after (a held-out collapse, deterministic on any
machine), with an evaluation after every step.
"""

from __future__ import annotations

import json
import re
import shutil

from rich.console import Console
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.config import EarlyStopConfig
from rollwise.early_stop import EarlyStop
from rollwise.metrics.console import summary_table
from rollwise.metrics.noise import accuracy_noise
from rollwise.train.checkpoint import best_checkpoint, is_complete, list_checkpoints, save_checkpoint

METRIC = "eval/greedy_balanced_accuracy"  # the default rule (rollwise.metrics.prior)


def _train(model_dir, run_dir, **extra):
    overrides = tiny_overrides(model_dir, **{"reward.fn": "toy_eval_plugins:peak_at_step_2", "eval.every_steps": 1,
                                             "run.keep_checkpoints": 1, **extra})
    result = CliRunner().invoke(app, ["train", *overrides, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    return result


def _evals(run_dir) -> dict[int, float]:
    return {r["step"]: r[METRIC] for r in read_rows(run_dir) if r["kind"] == "eval"}


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_run_that_ends_below_its_best_keeps_it_and_says_so(tmp_path, tiny_model_dir):
    """No train.early_stop: checkpoints/best names the highest evaluation (step 2) although run.save_every_steps
    = 0 and run.keep_checkpoints = 1; the final evaluation (step 4) is below it by more than the noise on 16
    prompts, which the run's last line, summary.json, the summary table and the report say, with the command
    that evaluates the best checkpoint; that command evaluates step-2."""
    run_dir = tmp_path / "run"
    result = _train(tiny_model_dir, run_dir, **{"train.steps": 4})
    evals = _evals(run_dir)
    best_step = max(evals, key=lambda step: (evals[step], -step))  # the highest; ties: the earliest
    assert best_step == 2 and evals[2] == 1.0 and evals[4] < 1.0
    assert best_checkpoint(run_dir).name == "step-2" and is_complete(run_dir / "checkpoints" / "step-2")
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-2", "step-4"]

    noise = accuracy_noise(1.0, 16)
    line = (f"rollwise: the final greedy balanced accuracy {evals[4]:.3f} (step 4) is below the best 1.000 (step 2) by more "
            f"than its noise (±{noise:.3f} on 16 prompts); the best checkpoint is {run_dir}/checkpoints/step-2 "
            f"(checkpoints/best): rollwise eval --model {run_dir} --best (serve it: rollwise serve --model "
            f"{run_dir}/checkpoints/best)")
    assert line in result.output.splitlines()[-3:]  # among the run's last lines
    best = _summary(run_dir)["best"]
    assert best == {"metric": METRIC, "step": 2, "value": 1.0, "plain_accuracy": 1.0, "final_step": 4, "final_value": evals[4],
                    "noise": noise, "n": 16, "below_best": True, "passed_over_steps": [], "checkpoint": str(run_dir / "checkpoints" / "step-2"),
                    "command": f"rollwise eval --model {run_dir} --best",
                    "serve_command": f"rollwise serve --model {run_dir}/checkpoints/best"}
    assert "early_stop" not in _summary(run_dir)
    assert "best greedy balanced accuracy" in result.output and f"rollwise eval --model {run_dir} --best" in result.output
    report = (run_dir / "report.html").read_text()
    assert "Best checkpoint" in report and f"rollwise eval --model {run_dir} --best" in report

    evaluated = CliRunner().invoke(app, ["eval", "--model", str(run_dir), "--best", "--n", "4",
                                         "--max-new-tokens", "4", "model.threads=1"])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["model"] == str(run_dir / "checkpoints" / "step-2")


def test_a_run_that_ends_at_its_best_names_it_in_one_line(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    result = _train(tiny_model_dir, run_dir, **{"train.steps": 2})
    line = f"rollwise: best {METRIC} 1 (greedy accuracy 1) at step 2: {run_dir}/checkpoints/step-2 (checkpoints/best)"
    assert line in result.output.splitlines()[-3:]
    best = _summary(run_dir)["best"]
    assert best["step"] == 2 and best["final_value"] == best["value"] == 1.0 and best["below_best"] is False
    assert "is below the best" not in result.output and "is below the best" not in (run_dir / "report.html").read_text()


def test_keep_best_false_keeps_only_the_newest_checkpoints(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    result = _train(tiny_model_dir, run_dir, **{"train.steps": 2, "train.keep_best": False})
    assert not (run_dir / "checkpoints" / "best").exists()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-2"]  # no step-0 or step-1 kept as a best
    assert "best" not in _summary(run_dir) and "checkpoints/best" not in result.output
    evaluated = CliRunner().invoke(app, ["eval", "--model", str(run_dir), "--best"])
    assert evaluated.exit_code == 2
    assert "the run had no evaluation (eval.n = 0, or none yet) or train.keep_best = false" in evaluated.output


def test_a_resumed_run_keeps_its_best(tmp_path, tiny_model_dir):
    """2 steps (best: step 2), resumed to 4: the best stays step 2 (folded from metrics.jsonl), and the resumed
    run's final evaluation is judged against it."""
    run_dir = tmp_path / "run"
    _train(tiny_model_dir, run_dir, **{"train.steps": 2})
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run_dir), "train.steps=4"])
    assert resumed.exit_code == 0, resumed.output
    assert sorted(_evals(run_dir)) == [0, 1, 2, 3, 4]
    assert best_checkpoint(run_dir).name == "step-2"
    best = _summary(run_dir)["best"]
    assert best["step"] == 2 and best["final_step"] == 4 and best["below_best"] is True
    assert "is below the best 1.000 (step 2)" in resumed.output


def test_a_run_resumed_from_its_step_0_checkpoint_evaluates_step_0_once(tmp_path, tiny_model_dir):
    """The starting evaluation is the first best, so step-0 is a checkpoint: a run killed during step 1 resumes
    from it without evaluating the starting model again, and points checkpoints/best at what it has."""
    run_dir = tmp_path / "run"
    _train(tiny_model_dir, run_dir, **{"train.steps": 2, "run.keep_checkpoints": 0})
    for name in ("step-1", "step-2"):  # as if killed during step 1
        shutil.rmtree(run_dir / "checkpoints" / name, ignore_errors=True)
    (run_dir / "checkpoints" / "latest").unlink()
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run_dir)])
    assert resumed.exit_code == 0, resumed.output
    assert "evaluating the starting model" not in resumed.output
    assert [r["step"] for r in read_rows(run_dir) if r["kind"] == "eval"] == [0, 1, 2]
    assert best_checkpoint(run_dir).name == "step-2"


def _saver(run_dir, model, tok, step):
    return lambda: save_checkpoint(run_dir, step, model, tok, {})


def test_within_noise_ties_and_the_summary_table(tmp_path, tiny_model_dir):
    """0.50, 0.60, 0.60, 0.55 on 200 prompts: the tie keeps step 5; 0.55 is within the noise of 0.60 (±0.069),
    so the run prints its best and no warning; 0.45 would be below it by more than the noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    early = EarlyStop(EarlyStopConfig(metric=METRIC, patience=0), tmp_path)
    for step, value in ((0, 0.5), (5, 0.6), (10, 0.6), (15, 0.55)):
        early.observe({"step": step, "kind": "eval", METRIC: value, "eval/n": 200.0},
                      save=_saver(tmp_path, model, tok, step))
    assert best_checkpoint(tmp_path).name == "step-5" and early.saved_step == 5
    best = early.best()
    assert best["noise"] == accuracy_noise(0.6, 200) and round(best["noise"], 3) == 0.069
    assert best["below_best"] is False and early.lines(15) == [early.line(15)]
    early.observe({"step": 20, "kind": "eval", METRIC: 0.45, "eval/n": 200.0}, save=lambda: None)
    best = early.best()
    assert best["below_best"] is True and early.lines(20)[0].startswith("rollwise: the final greedy balanced accuracy 0.450")

    console = Console(record=True, width=200)
    console.print(summary_table({"best": best, "run_dir": str(tmp_path)}))
    text = console.export_text()
    assert re.search(r"best greedy balanced accuracy\s+│\s+│\s+0\.600 at step 5", text)
    assert "-0.150 (±0.069)" in text
    assert f"rollwise eval --model {tmp_path} --best" in " ".join(text.split())  # the caption wraps at the table's width
