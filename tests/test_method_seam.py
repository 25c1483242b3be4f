"""The method seam: a method enters as one file plus a registry entry (`rollwise.methods.METHODS` or a plugin
path in `[[stage]] kind`) and trains through the real loop, with no change to the loop, session or trainer."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import read_rows
from rollwise.cli import app
from rollwise.loop import train
from rollwise.methods import METHODS
from rollwise.validate import load
from test_distill_state import _recipe

STAGES = '\n[[stage]]\nkind = "{kind}"\nsteps = 2\n'
SETTINGS = {"train.steps": 2, "eval.n": 0, "reward.fn": "toy_plugins:digit_fraction", "train.lr": 1e-2,
            "algo.filter_zero_variance": False, "run.save_every_steps": 0}


def _run(tmp_path, tiny_model_dir, kind: str, name: str):
    cfg = load(_recipe(tmp_path, tiny_model_dir, STAGES.format(kind=kind), **SETTINGS))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    weights = load_file(tmp_path / name / "checkpoints" / "step-2" / "model.safetensors")
    return rows, weights


def test_a_toy_method_from_one_file_trains_through_the_loop(tmp_path, tiny_model_dir):
    """`kind = "toy_method:Sharpen"`: its metrics reach the rows, its loss term moves the weights away from what
    the plain rl step gives from the same seed and samples (the first step samples the same responses)."""
    toy_rows, toy = _run(tmp_path, tiny_model_dir, "toy_method:Sharpen", "toy")
    rl_rows, plain = _run(tmp_path, tiny_model_dir, "rl", "rl")
    assert [r["step"] for r in toy_rows] == [1, 2]
    assert all("toy/correct_samples" in r for r in toy_rows) and "toy/correct_samples" not in rl_rows[0]
    sampled = [r for r in toy_rows if r["toy/correct_samples"] > 0]
    assert sampled and all(r["toy/correct_nll"] > 0 for r in sampled)  # the term saw the correct responses
    assert toy_rows[0]["reward/mean"] == rl_rows[0]["reward/mean"]  # same first batch
    assert max(float((toy[k] - plain[k]).abs().max()) for k in toy) > 1e-6  # the extra term changed the update


def test_a_method_registered_by_name_is_a_stage_kind(tmp_path, tiny_model_dir, monkeypatch):
    """A registry entry (`METHODS`) makes the name valid in `[[stage]] kind`; an unknown name fails --dry-run."""
    monkeypatch.setitem(METHODS._lazy, "sharpen", "toy_method:Sharpen")
    assert "sharpen" in METHODS.names()
    recipe = _recipe(tmp_path, tiny_model_dir, STAGES.format(kind="sharpen"), **SETTINGS)
    assert CliRunner().invoke(app, ["train", str(recipe), "--dry-run"]).exit_code == 0
    bad = _recipe(tmp_path, tiny_model_dir, STAGES.format(kind="sharpn"), **SETTINGS)
    result = CliRunner().invoke(app, ["train", str(bad), "--dry-run"])
    assert result.exit_code == 2 and "kind = 'sharpn' is not a known method" in result.output
    assert "sharpen" in result.output  # the valid names are listed


def test_a_kind_that_is_not_a_method_class_is_refused_at_dry_run(tmp_path, tiny_model_dir):
    recipe = _recipe(tmp_path, tiny_model_dir, STAGES.format(kind="toy_plugins:answer_matches"), **SETTINGS)
    result = CliRunner().invoke(app, ["train", str(recipe), "--dry-run"])
    assert result.exit_code == 2 and "is not a rollwise.methods.Method subclass" in result.output
