"""SLAS (super-linear advantage shaping, `algo.advantage = "slas"`) and TrajVal (`rollwise trajval`): the
formulas by hand, each mechanism through a real tiny run, the errors at --dry-run / on the command line, and the
recipe (recipes/seed/slas.toml) at --dry-run and for two steps on the tiny model."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.algo.advantages import dr_grpo, grpo
from rollwise.algo.slas import SlasOptions, slas, slas_shape
from rollwise.cli import app
from rollwise.loop import train
from rollwise.trajval import (TrajValError, endpoint_accuracies, learnability_weights, mix_tables, probe_config,
                              weighted_config)
from rollwise.validate import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "seed"


def _dry_run(model_dir: Path, overrides: dict, recipe: Path | None = None):
    args = ["train", "--dry-run", *([str(recipe)] if recipe else []), *tiny_overrides(model_dir, **overrides)]
    return CliRunner().invoke(app, args)


# --- SLAS: by hand ---------------------------------------------------------------------------------------------

def test_slas_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # a = [.75, -.25, -.25, -.25 | .25, .25, -.75, .25]; a|a| = [.5625, -.0625 x3 | .0625 x2, -.5625, .0625]
    # batch std (unbiased, mean 0): sqrt((2 x .31640625 + 6 x .00390625) / 7) = sqrt(.09375) = .306186
    expected = [0.5625 / 0.306186, -0.0625 / 0.306186]
    out = slas(rewards, groups, power=2.0)
    assert out.dtype == torch.float32
    assert out[:2].tolist() == pytest.approx(expected, abs=1e-4)  # 1.8371, -0.2041
    assert out[6].item() == pytest.approx(-expected[0], abs=1e-4)
    assert float(out.std()) == pytest.approx(1.0, abs=1e-5)
    # super-linear: the best sample of group 0 outweighs the others 9:1 (GRPO and p = 1: 3:1)
    assert out[0] / -out[1] == pytest.approx(9.0, rel=1e-4)
    assert grpo(rewards, groups)[0] / -grpo(rewards, groups)[1] == pytest.approx(3.0, rel=1e-4)
    linear = slas(rewards, groups, power=1.0)
    drg = dr_grpo(rewards, groups)
    assert linear.tolist() == pytest.approx((drg / drg.std()).tolist(), abs=1e-5)
    # the batch normalisation makes it invariant to the reward scale and offset
    assert slas(rewards * 7.0 + 3.0, groups, power=2.0).tolist() == pytest.approx(out.tolist(), abs=1e-4)


def test_slas_shape_keeps_signs_and_amplifies_large_advantages():
    shaped = slas_shape(torch.tensor([-0.5, 0.0, 0.1, 0.2]), 3.0)
    assert shaped.tolist() == pytest.approx([-0.125, 0.0, 0.001, 0.008])
    with pytest.raises(ValueError, match="algo.slas.power = 0.5"):
        slas_shape(torch.tensor([0.1]), 0.5)


def test_slas_without_signal_gives_zero():
    assert slas(torch.ones(4), torch.tensor([0, 0, 1, 1])).tolist() == [0.0] * 4  # every group uniform
    assert slas(torch.tensor([0.7]), torch.tensor([0])).tolist() == [0.0]  # one sample: no batch std


# --- SLAS: a real run ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_slas_run_trains_on_the_shaped_batch_normalised_advantages(tmp_path, tiny_model_dir):
    # 3 samples per prompt: log_samples keeps every sample, so each step's whole batch is in the log
    cfg = load(None, tiny_overrides(tiny_model_dir, **{
        "algo.advantage": "slas", "algo.slas.power": 3.0, "reward.fn": "toy_plugins:digit_fraction",
        "rollout.samples_per_prompt": 3, "run.samples_logged_per_step": 99, "eval.n": 0, "run.report": False}))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / "slas")
    rows = [r for r in read_rows(tmp_path / "slas") if r["kind"] == "train"]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    checked = 0
    for step in (1, 2):
        log = tmp_path / "slas" / "samples" / f"step-{step}.jsonl"
        logged = [json.loads(x) for x in log.read_text().splitlines()]
        by_prompt = defaultdict(list)
        for s in logged:
            by_prompt[s["prompt"]].append(s)
        kept = [g for g in by_prompt.values() if len({s["reward"] for s in g}) > 1]  # zero-variance groups dropped
        assert all(s["advantage"] == 0 for g in by_prompt.values() if g not in kept for s in g)
        rewards = torch.tensor([s["reward"] for g in kept for s in g])
        groups = torch.tensor([i for i, g in enumerate(kept) for _ in g])
        logged_adv = [s["advantage"] for g in kept for s in g]
        assert logged_adv == pytest.approx(slas(rewards, groups, power=3.0).tolist(), abs=1e-4)
        if len(kept) > 1:  # the shaping acts: not the GRPO advantages
            assert logged_adv != pytest.approx(grpo(rewards, groups).tolist(), abs=1e-3)
            checked += 1
    assert checked


# --- errors at --dry-run, and the recipe -----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ({"algo.advantage": "slas", "algo.slas.power": 0.5}, "algo.slas.power"),
    ({"algo.slas.power": 3.0}, "[algo.slas] is set but algo.method = 'rl' and algo.advantage = 'grpo'"),
])
def test_bad_slas_settings_fail_at_dry_run_with_one_line(overrides, message, tiny_model_dir):
    result = _dry_run(tiny_model_dir, overrides)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_slas_recipe_passes_dry_run_and_runs_two_steps(tmp_path, tiny_model_dir):
    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 4, "run.report": False, "run.name": None}
    result = _dry_run(tiny_model_dir, overrides, RECIPES / "slas.toml")
    assert result.exit_code == 0, result.output
    cfg = load(RECIPES / "slas.toml", tiny_overrides(tiny_model_dir, **overrides))
    assert cfg.algo.advantage == "slas" and SlasOptions.of(cfg).power == 2.0
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / "slas")
    rows = [r for r in read_rows(tmp_path / "slas") if r["kind"] == "train"]
    assert len(rows) == 2 and any(r["train/loss"] is not None and math.isfinite(r["train/loss"]) for r in rows)


# --- TrajVal: by hand ------------------------------------------------------------------------------------------

def test_learnability_weights_by_hand():
    out = learnability_weights({"a": 0.2, "b": 0.5, "c": 0.4}, {"a": 0.5, "b": 0.4, "c": 0.45},
                               {"a": 1.0, "b": 1.0, "c": 2.0}, floor=0.05)
    # L = (.3, 0, .05); L + floor = (.35, .05, .10), mean 1/6; prior = (2.1, .3, .6); weight = prior x recipe
    assert {k: v["learnability"] for k, v in out.items()} == pytest.approx({"a": 0.3, "b": 0.0, "c": 0.05})
    assert {k: v["prior"] for k, v in out.items()} == pytest.approx({"a": 2.1, "b": 0.3, "c": 0.6})
    assert {k: v["weight"] for k, v in out.items()} == pytest.approx({"a": 2.1, "b": 0.3, "c": 1.2})
    assert out["b"]["gain"] == pytest.approx(-0.1)  # a source that got worse keeps the floor, not a negative weight
    with pytest.raises(TrajValError, match="--floor 0"):
        learnability_weights({"a": 0.0}, {"a": 0.0}, {"a": 1.0}, floor=0.0)


def test_endpoint_accuracies_read_the_first_and_last_evaluation():
    rows = [{"kind": "eval", "step": 0, "eval/x/sampled_accuracy": 0.25, "eval/y/sampled_accuracy": 0.5},
            {"kind": "train", "step": 1},
            {"kind": "eval", "step": 1, "eval/x/sampled_accuracy": 0.9, "eval/y/sampled_accuracy": 0.9},
            {"kind": "eval", "step": 2, "eval/x/sampled_accuracy": 0.5, "eval/y/sampled_accuracy": 0.375}]
    assert endpoint_accuracies(rows, ["x", "y"]) == (0, {"x": 0.25, "y": 0.5}, 2, {"x": 0.5, "y": 0.375})
    with pytest.raises(TrajValError, match="needs one at step 0 and one at the end"):
        endpoint_accuracies(rows[:2], ["x", "y"])
    with pytest.raises(TrajValError, match="no eval/z/sampled_accuracy"):
        endpoint_accuracies(rows, ["x", "z"])


MIX = """[data]
[[data.mix]]
task = "arith"
weight = 3
eval_size = 20
reward = "toy_plugins:digit_fraction"

[[data.mix]]
task = "letters"
name = "words"
eval_size = 20
reward = "toy_plugins:digit_fraction"
"""
NO_EVAL_SIZE = {"data.eval_size": None}  # a mixture's eval_size lives in its tables


def test_probe_gives_every_source_weight_one_and_the_result_its_weights(tmp_path, tiny_model_dir):
    (tmp_path / "mix.toml").write_text(MIX)
    cfg = load(tmp_path / "mix.toml", tiny_overrides(tiny_model_dir, **NO_EVAL_SIZE))
    probe = probe_config(cfg, 3)
    assert [e.weight for e in probe.data.mix] == [1.0, 1.0] and probe.train.steps == 3
    assert probe.eval.at_start and probe.eval.every_steps == 0
    weighted = weighted_config(cfg, {"arith": 0.123456, "words": 2.0})
    assert [e.weight for e in weighted.data.mix] == [0.1235, 2.0] and [e.weight for e in cfg.data.mix] == [3.0, 1.0]
    assert 'name = "words"\nweight = 2.0\ntask = "letters"' in mix_tables(weighted)
    assert "mix =" not in mix_tables(weighted)


# --- TrajVal: a real probe through the command line ------------------------------------------------------------

@pytest.mark.slow
def test_trajval_probe_writes_weights_from_the_two_evaluations(tmp_path, tiny_model_dir):
    (tmp_path / "mix.toml").write_text(MIX)
    run_dir = tmp_path / "probe"
    overrides = tiny_overrides(tiny_model_dir, **{"data.eval_size": None, "eval.n": 16, "run.report": False})
    result = CliRunner().invoke(app, ["trajval", str(tmp_path / "mix.toml"), *overrides, "--probe-steps", "2",
                                      "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "[[data.mix]]" in result.output and "trajval.toml" in result.output
    record = json.loads((run_dir / "trajval.json").read_text())
    evals = [r for r in read_rows(run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and record["eval_steps"] == [0, 2]
    # the probe trained both sources equally (weights 1:1, not the recipe's 3:1): 2 of 4 prompts each per step
    trains = [r for r in read_rows(run_dir) if r["kind"] == "train"]
    assert len(trains) == 2 and all(r["reward/arith/samples"] == r["reward/words/samples"] for r in trains)
    start = {n: evals[0][f"eval/{n}/sampled_accuracy"] for n in ("arith", "words")}
    end = {n: evals[1][f"eval/{n}/sampled_accuracy"] for n in ("arith", "words")}
    expected = learnability_weights(start, end, {"arith": 3.0, "words": 1.0})
    for name in ("arith", "words"):
        assert record["sources"][name] == pytest.approx(expected[name])
    if start["arith"] - end["arith"] != start["words"] - end["words"]:  # the more learnable source gets more prior
        better = max(("arith", "words"), key=lambda n: end[n] - start[n])
        assert record["sources"][better]["prior"] > 1.0
    recommended = load(record["toml"], [f"model.name={tiny_model_dir}"])
    assert [e.weight for e in recommended.data.mix] == pytest.approx(
        [expected["arith"]["weight"], expected["words"]["weight"]], abs=1e-4)


@pytest.mark.parametrize("recipe, extra, message", [
    ("[data]\ntask = \"arith\"\n", [], "at least two [[data.mix]] tables"),
    (MIX, ["eval.n=2"], "eval.n = 2: TrajVal reads each source's held-out accuracy"),
    (MIX, ["--floor", "-1"], "--floor -1"),
])
def test_trajval_refuses_what_it_cannot_value_in_one_line(recipe, extra, message, tmp_path, tiny_model_dir):
    (tmp_path / "r.toml").write_text(recipe)
    overrides = tiny_overrides(tiny_model_dir, **NO_EVAL_SIZE)
    result = CliRunner().invoke(app, ["trajval", str(tmp_path / "r.toml"), *overrides, "--probe-steps", "1",
                                      "--run-dir", str(tmp_path / "run"), *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the probe ran
