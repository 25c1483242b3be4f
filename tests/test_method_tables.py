"""A method's settings live with the method (issue 33): `[rollout.duet]`, `[algo.hargo]`, `[reward.cme]`.

Each rollout strategy, `algo.method` / `algo.advantage` and reward method declares its options as one
`MethodOptions` model in its own module; only the selected method's table is read and checked; an old flat key
(`rollout.duet_budget_tokens`) fails in one line naming its new place, in a recipe and on the command line; the
reference (`rollwise config`, docs/config.md) is generated from the same models.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows, subprocess_env, tiny_overrides
from rollwise.cli import app
from rollwise.config import ConfigError
from rollwise.config_load import load_config
from rollwise.config_methods import MOVED, OPTION_MODELS
from rollwise.config_tasks import switch_task
from rollwise.config_toml import to_toml
from rollwise.methods.duet import DuetOptions
from rollwise.validate import load
from test_rollout_strategies import eos_model_dir  # noqa: F401  (a fixture: a tiny model that ends responses)

ROOT = Path(__file__).resolve().parent.parent
DUET = ["rollout.strategy=duet", "algo.method=duet"]


def _dry_run(*args: str):
    return CliRunner().invoke(app, ["train", *args, "--dry-run"])


# --- old flat keys ----------------------------------------------------------------------------------------------

def test_an_old_flat_key_in_a_recipe_fails_at_dry_run_in_one_line_naming_its_new_place(tmp_path, tiny_model_dir):
    recipe = tmp_path / "old.toml"
    recipe.write_text('[rollout]\nstrategy = "duet"\nduet_budget_tokens = 1536\n\n[algo]\nmethod = "duet"\n')
    result = _dry_run(str(recipe), *tiny_overrides(tiny_model_dir))
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: {recipe}: rollout.duet_budget_tokens moved: write [rollout.duet] "
                                     "budget_tokens (or rollout.duet.budget_tokens=... on the command line)")


OLD_RUN_CONFIG = """[rollout]
strategy = "duet"
duet_budget_tokens = 1536
duet_min_samples = 2
rethink_fraction = 0.5
tree_simulations = 8

[algo]
method = "duet"
hargo_alpha = 1.0
moa_weights = {}
discrepancy_target = 0.01

[reward]
noise_fp = 0.0
noise_fn = 0.0
label_fraction = 1.0
"""


def test_a_run_directory_written_before_the_tables_still_loads(tmp_path, tiny_model_dir):
    """A run's own config.toml (beside its metrics.jsonl) holds every old flat key: the selected method's keys are
    read in its table, the others (no effect on that run) left out, with one note; `rollwise train --dry-run` of
    it runs. The same file as a recipe elsewhere still fails on the first old key."""
    run_dir = tmp_path / "old-run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(OLD_RUN_CONFIG)
    (run_dir / "metrics.jsonl").write_text("")
    cfg = load(run_dir / "config.toml", tiny_overrides(tiny_model_dir))
    assert DuetOptions.of(cfg).budget_tokens == 1536 and DuetOptions.of(cfg).min_samples == 2
    assert set(cfg.rollout.model_extra) == {"duet"} and not cfg.algo.model_extra and not cfg.reward.model_extra
    assert cfg._load_notes[0] == ("rollwise: this run's config.toml predates method tables: 2 key(s) read in their "
                                  "table (rollout.duet_budget_tokens -> [rollout.duet] budget_tokens, "
                                  "rollout.duet_min_samples -> [rollout.duet] min_samples), 8 of methods the run did "
                                  "not use left out")
    result = _dry_run(str(run_dir / "config.toml"), *tiny_overrides(tiny_model_dir))
    assert result.exit_code == 0, result.output
    recipe = tmp_path / "config.toml"  # not in a run directory
    recipe.write_text(OLD_RUN_CONFIG)
    with pytest.raises(ConfigError, match="rollout.duet_budget_tokens moved"):
        load(recipe)


@pytest.mark.parametrize("old, new", [("rollout.duet_budget_tokens=3", "[rollout.duet] budget_tokens"),
                                      ("algo.hargo_alpha=2", "[algo.hargo] alpha"),
                                      ("reward.cme_model=x", "[reward.cme] model"),
                                      ("reward.label_fraction=0.5", "[reward.memreward] label_fraction"),
                                      ("algo.moa_weights={a=1}", "[algo.moa] weights"),
                                      ("algo.discrepancy_target=0.1", "[algo.acrl] or [algo.dcmdp] target")])
def test_an_old_flat_key_on_the_command_line_fails_in_one_line(old, new, tiny_model_dir):
    result = _dry_run(*tiny_overrides(tiny_model_dir), old)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"{old.split('=')[0]} moved: write {new}" in result.output


def test_every_old_key_of_config_methods_has_a_place_that_exists():
    """Each MOVED entry names a registered table and one of its keys (nothing silently dropped)."""
    from rollwise.config_reference import discover

    tables = discover()
    for old, (table, key) in MOVED.items():
        for name in table.replace("] or [", " ").split():
            sec, _, method = name.partition(".")
            assert key in tables[(sec, method)].model_fields, (old, table, key)


# --- the new form ------------------------------------------------------------------------------------------------

def test_a_method_table_on_the_command_line_is_parsed_and_shown_by_dry_run(tiny_model_dir):
    result = _dry_run(*tiny_overrides(tiny_model_dir), *DUET, "rollout.duet.budget_tokens=123",
                      "rollout.duet.marker=The answer")
    assert result.exit_code == 0, result.output
    shown = tomllib.loads(result.output[result.output.index("[model]"):])
    assert shown["rollout"]["duet"] == {"budget_tokens": 123, "min_samples": 2, "abort_tokens": 0,
                                        "marker": "The answer", "momentum": 0.5}


def test_the_command_line_sets_one_key_of_a_recipes_table_and_keeps_the_others(tiny_model_dir):
    recipe = ROOT / "recipes" / "seed" / "duet.toml"
    cfg = load(recipe, tiny_overrides(tiny_model_dir, **{"rollout.duet.budget_tokens": 99,
                                                          "rollout.max_new_tokens": 48}))
    options = DuetOptions.of(cfg)
    assert (options.budget_tokens, options.min_samples, options.abort_tokens) == (99, 4, 40)


def test_the_resolved_table_is_written_to_config_toml_and_reads_back(tiny_model_dir, tmp_path):
    cfg = load(None, tiny_overrides(tiny_model_dir, **{"rollout.strategy": "duet", "algo.method": "duet",
                                                       "rollout.duet.min_samples": 3}))
    text = to_toml(cfg)
    assert "[rollout.duet]\nbudget_tokens = 0\nmin_samples = 3\n" in text
    (tmp_path / "config.toml").write_text(text)
    assert DuetOptions.of(load(tmp_path / "config.toml")).min_samples == 3


@pytest.mark.parametrize("overrides, message", [
    (["rollout.duet.budget_tokens=3"], "[rollout.duet] is set but rollout.strategy = 'plain': select 'duet' there, "
                                       "or remove [rollout.duet]"),
    ([*DUET, "rollout.duet.budget=3"], "unknown key 'rollout.duet.budget'; valid keys in [rollout.duet]: "
                                       "budget_tokens, min_samples, abort_tokens, marker, momentum"),
    ([*DUET, "rollout.duet.min_samples=1"], "rollout.duet.min_samples: Input should be greater than or equal to 2; "
                                            "got 1"),
    (["algo.hargo.alpha=1"], "[algo.hargo] is set but algo.method = 'rl' and algo.advantage = 'grpo'"),
    (["algo.rl.alpha=1"], "[algo.rl]: algo.method 'rl' takes no options; remove [algo.rl]"),
    (["reward.cme.model=x"], "[reward.cme] is set but reward.fn = None: select 'cme' there"),
])
def test_a_bad_or_unread_table_fails_at_dry_run_in_one_line(overrides, message, tiny_model_dir):
    result = _dry_run(*tiny_overrides(tiny_model_dir), *overrides)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert message in result.output


def test_a_reward_wrappers_table_is_read_whatever_reward_fn_is(tiny_model_dir):
    from rollwise.rewards.noise import NoiseOptions

    cfg = load(None, tiny_overrides(tiny_model_dir, **{"reward.noise.fp": 0.25}))
    assert NoiseOptions.of(cfg.reward).fp == 0.25 and NoiseOptions.of(cfg).fn == 0.0


def test_another_task_drops_the_recipes_reward_table_with_its_reward_fn():
    recipe = tomllib.loads((ROOT / "recipes" / "seed" / "cme.toml").read_text())
    assert "cme" in recipe["reward"]
    merged, notes = switch_task(recipe, {"data": {"task": "letters"}})
    assert "fn" not in merged["reward"] and "cme" not in merged["reward"]
    assert "reward.fn" in notes[0] and "[reward.cme]" in notes[0]
    assert "cme" in switch_task(recipe, {"data": {"task": "letters"}, "reward": {"fn": "cme"}})[0]["reward"]


def test_load_config_keeps_tables_as_written_and_validation_fills_them(tiny_model_dir):
    raw = load_config(None, tiny_overrides(tiny_model_dir, **{"rollout.strategy": "tree", "rollout.tree.branches": 3}))
    assert raw.rollout.model_extra == {"tree": {"branches": 3}}
    assert load(None, tiny_overrides(tiny_model_dir, **{"rollout.strategy": "tree", "rollout.tree.branches": 3})) \
        .rollout.model_extra["tree"]["simulations"] == 16
    with pytest.raises(ConfigError, match="rollout.duet_budget_tokens moved"):
        load_config(None, ["rollout.duet_budget_tokens=1"])


def test_every_method_declares_its_options_in_its_own_module():
    """A new method touches no shared config file: every options model lives outside rollwise/config*.py."""
    from rollwise.config_reference import discover

    tables = discover()
    assert len(tables) >= 20
    for (sec, name), model in tables.items():
        assert not model.__module__.startswith("rollwise.config"), (sec, name, model.__module__)
    from rollwise.config import AlgoConfig, RewardConfig, RolloutConfig

    old_prefixes = {key.split(".")[1] for key in MOVED}
    for section in (RolloutConfig, AlgoConfig, RewardConfig):
        assert not old_prefixes & set(section.model_fields)


# --- a tiny run through the CLI reads the table ---------------------------------------------------------------

@pytest.mark.slow
def test_a_tiny_cli_run_reads_the_strategys_table(tmp_path, eos_model_dir):
    """`rollwise train` with `[rollout.rethink] fraction = 1.0` in the recipe: every completed response is
    rethought (the strategy read the table); with fraction 0 none is."""
    rates = {}
    for fraction in (1.0, 0.0):
        recipe = tmp_path / f"rethink{fraction}.toml"
        recipe.write_text(f'[rollout]\nstrategy = "rethink"\n\n[rollout.rethink]\nfraction = {fraction}\n'
                          'max_new_tokens = 4\ntrigger = " Wait."\n')
        run_dir = tmp_path / f"run{fraction}"
        args = [str(recipe), *tiny_overrides(eos_model_dir, **{"train.steps": 1, "eval.n": 0, "run.report": False,
                                                                 "reward.fn": "toy_plugins:digit_fraction"})]
        done = subprocess.run([sys.executable, "-m", "rollwise.cli", "train", *args, "--run-dir", str(run_dir)],
                              capture_output=True, text=True, env=subprocess_env(), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        row = [r for r in read_rows(run_dir) if r["kind"] == "train"][0]
        rates[fraction] = row["rethink/samples_frac"]
        assert tomllib.loads((run_dir / "config.toml").read_text())["rollout"]["rethink"]["fraction"] == fraction
    assert rates[0.0] == 0.0 and rates[1.0] > 0.0


# --- the reference -------------------------------------------------------------------------------------------------

def test_rollwise_config_prints_a_methods_table_with_types_defaults_and_descriptions():
    result = CliRunner().invoke(app, ["config", "rollout.duet"])
    assert result.exit_code == 0, result.output
    assert "[rollout.duet]  (read when rollout.strategy = 'duet')" in result.output
    assert "  budget_tokens : int = 0\n      rollout tokens one generation round may spend" in result.output
    section = CliRunner().invoke(app, ["config", "rollout"]).output
    assert "  max_new_tokens : int = 64" in section and "[rollout.tree]" in section
    assert CliRunner().invoke(app, ["config", "algo.hargo.alpha"]).output.startswith("  alpha : float = 1.0")
    bad = CliRunner().invoke(app, ["config", "rollout.nope"])
    assert bad.exit_code == 2 and "unknown key or table 'rollout.nope'" in bad.output


def test_docs_config_md_is_the_generated_reference():
    from rollwise import config_reference

    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == config_reference.markdown(), (
        "docs/config.md is stale: run `rollwise config --markdown > docs/config.md`")
    assert "### [rollout.duet]" in committed and "| `budget_tokens` | `int` | `0` |" in committed


def test_a_stale_reference_is_told_apart(monkeypatch):
    """The staleness check sees a changed description: the generated text follows the models."""
    from rollwise import config_reference

    before = config_reference.markdown()
    monkeypatch.setattr(DuetOptions.model_fields["marker"], "description", "changed")
    assert config_reference.markdown() != before


def test_a_secret_in_a_method_table_keeps_its_value_and_is_never_written(tiny_model_dir):
    import json

    from rollwise.rewards.judge import JudgeOptions

    cfg = load(None, tiny_overrides(tiny_model_dir, **{"reward.fn": "judge", "reward.judge.url": "http://127.0.0.1:9/v1",
                                                       "reward.judge.api_key": "sk-KEEP"}))
    assert JudgeOptions.of(cfg).api_key.get_secret_value() == "sk-KEEP"  # the run's judge sends it
    text = to_toml(cfg)
    assert "sk-KEEP" not in text and "sk-KEEP" not in json.dumps(cfg.model_dump(mode="json"))
    assert ("# api_key = *** (a secret, never written: give it as $ROLLWISE_JUDGE_API_KEY or "
            "reward.judge.api_key=...)") in text
    with pytest.raises(ConfigError, match="reward.judge_api_key moved: write \\[reward.judge\\] api_key") as err:
        load_config(None, ["reward.judge_api_key=sk-OLD"])
    assert "sk-OLD" not in str(err.value)


def test_a_number_given_for_a_text_option_is_that_text(tiny_model_dir):
    cfg = load(None, tiny_overrides(tiny_model_dir) + [*DUET, "rollout.duet.marker=2024"])
    assert DuetOptions.of(cfg).marker == "2024"
