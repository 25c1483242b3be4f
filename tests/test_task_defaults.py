"""Task-aware defaults (issue 31): a recipe's task-bound keys do not silently carry to another task."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from rollwise.config_load import load_config
from rollwise.config_tasks import ARITH_SYSTEM, LETTERS_SYSTEM, NEW_TASK_SETTINGS, switch_task

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.toml"
RG_RECIPE = REPO / "recipes" / "reasoning_gym.toml"


def test_the_recipes_own_task_is_read_as_written():
    cfg = load_config(QUICKSTART, ["data.task=arith", "train.steps=3"])
    assert cfg._load_notes == []
    assert cfg.data.system_prompt == tomllib.loads(QUICKSTART.read_text())["data"]["system_prompt"]
    assert cfg.train.lr == 2e-5 and cfg.algo.kl_coef == 0.0  # the recipe's tuned settings stay


def test_another_task_drops_the_recipes_prompt_and_takes_the_new_task_settings():
    cfg = load_config(QUICKSTART, ["data.task=letters"])
    assert cfg.data.system_prompt == LETTERS_SYSTEM  # the task's own prompt, not "Solve the arithmetic problem"
    assert cfg.train.lr == NEW_TASK_SETTINGS[("train", "lr")]
    assert cfg.algo.kl_coef == NEW_TASK_SETTINGS[("algo", "kl_coef")]
    (note,) = cfg._load_notes
    assert "'letters' is not the recipe's task ('arith')" in note and "data.system_prompt" in note
    assert "train.lr = 1e-05" in note and "algo.kl_coef = 0.02" in note


def test_keys_on_the_command_line_always_win():
    cfg = load_config(QUICKSTART, ["data.task=letters", "train.lr=3e-5", "algo.kl_coef=0.0"])
    assert cfg.train.lr == 3e-5 and cfg.algo.kl_coef == 0.0 and cfg.data.system_prompt == LETTERS_SYSTEM
    (note,) = cfg._load_notes
    assert "train.lr" not in note and "kl_coef" not in note  # nothing of the user's is reported as replaced


def test_a_reasoning_gym_recipe_switched_to_arith_leaves_its_options_and_stops_behind():
    cfg = load_config(RG_RECIPE, ["data.task=arith"])
    assert cfg.data.options == {} and cfg.rollout.stop == [] and cfg.data.system_prompt == ARITH_SYSTEM
    (note,) = cfg._load_notes
    assert "data.options" in note and "rollout.stop" in note


def test_a_reasoning_gym_task_from_the_default_recipe_brings_its_own_prompt():
    cfg = load_config(QUICKSTART, ["data.task=reasoning_gym:chain_sum"])
    assert cfg.data.system_prompt is None  # None: the task's prompts carry reasoning-gym's own system prompt


def test_a_file_named_on_the_command_line_is_another_task():
    merged, notes = switch_task({"data": {"task": "arith", "system_prompt": "S", "digits": 2}},
                                {"data": {"path": "my.jsonl"}})
    assert merged["data"] == {"path": "my.jsonl"} and len(notes) == 1
    assert "data.system_prompt, data.digits" in notes[0]


def test_switch_task_leaves_its_arguments_alone():
    recipe = {"data": {"task": "arith", "system_prompt": "S"}, "train": {"lr": 2e-5}}
    given = {"data": {"task": "letters"}}
    switch_task(recipe, given)
    assert recipe == {"data": {"task": "arith", "system_prompt": "S"}, "train": {"lr": 2e-5}}
    assert given == {"data": {"task": "letters"}}


def test_the_cli_says_which_keys_were_replaced(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rollwise.cli", "train", "data.task=letters", "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rollwise: data.task 'letters' is not the recipe's task ('arith')" in done.stderr
    resolved = tomllib.loads(done.stdout)  # the memory estimate follows as TOML comments
    assert resolved["data"]["system_prompt"] == LETTERS_SYSTEM and resolved["algo"]["kl_coef"] == 0.02


def test_nothing_is_said_when_the_command_line_sets_every_replaced_key():
    cfg = load_config(QUICKSTART, ["data.task=letters", "data.system_prompt=Count.", "train.lr=3e-5",
                                   "algo.kl_coef=0.0"])
    assert cfg._load_notes == []
