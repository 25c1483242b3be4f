"""Every recipe in recipes/ runs two RL steps end to end on the tiny model, with its objective's metrics."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest

from conftest import read_rows, tiny_overrides
from rollwise.config import load_config
from rollwise.loop import train

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# metrics that show the recipe's objective actually ran
EXPECTED = {
    "grpo": ["train/kl", "train/clip_frac"],
    "dr_grpo": ["train/clip_frac"],
    "dapo": ["reward/shaped_mean"],
    "gspo": ["train/clip_frac"],
    "rloo": ["train/loss"],
    "reinforce_pp": ["reward/kl_penalty_mean"],
    "ppo": ["value/error_abs_mean", "value/values_mean"],
    "sao": ["value/error_abs_mean"],
    "quickstart": ["train/clip_frac"],
}


def test_every_recipe_is_covered():
    assert sorted(p.stem for p in RECIPES.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_runs_two_steps(name, tmp_path, tiny_model_dir):
    overrides = {
        "reward.fn": "toy_plugins:digit_fraction",  # dense reward: every group has variance on a random model
        "eval.n": 4,
        "run.report": False,
        "run.name": None,
    }
    if name == "sao":
        overrides["rollout.samples_per_prompt"] = None  # keep the recipe's single sample per prompt
        overrides["rollout.prompts_per_step"] = 8
    if name == "dapo":  # the tiny run generates 8 tokens at most: the overlong buffer must fit inside
        overrides["algo.shaping"] = None
    cfg = load_config(RECIPES / f"{name}.toml", tiny_overrides(tiny_model_dir, **overrides))
    if name == "dapo":
        cfg.algo.shaping = {"overlong_soft": {"cache_len": 4}}
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["train/loss"]), (name, row)
        for key in EXPECTED[name]:
            assert row.get(key) is not None and math.isfinite(row[key]), (name, key, row)


def test_value_head_is_checkpointed_and_restored(tmp_path, tiny_model_dir):
    import torch

    from rollwise.session import open_run

    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 0, "run.report": False,
                 "run.save_every_steps": 1, "run.name": None}
    cfg = load_config(RECIPES / "ppo.toml", tiny_overrides(tiny_model_dir, **overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "ppo")
    state = torch.load(tmp_path / "ppo" / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=False)
    saved = state["value_head"]
    assert any(float(t.abs().sum()) > 0 for t in saved.values())  # the head learned from zero
    run = open_run(cfg, tmp_path / "ppo", resume=True)
    for name, tensor in run.trainer.value_head.state_dict().items():
        assert torch.equal(tensor, saved[name])
    assert run.trainer.updates == state["updates"] == 2
