"""Config: unknown keys and bad values fail early with helpful messages; overrides parse as TOML values;
`to_toml` round-trips; every shipped recipe loads."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from rollwise.validate import load
from rollwise.config import Config, ConfigError
from rollwise.config_load import load_config, valid_keys
from rollwise.config_toml import to_toml

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.toml"))


# ------------------------------------------------------------------------------------ unknown keys


def test_unknown_key_in_override_lists_the_sections_valid_keys():
    with pytest.raises(ConfigError) as info:
        load(None, ["train.stpes=3"])
    msg = str(info.value)
    assert "train.stpes" in msg
    for key in ("steps", "lr", "seed", "warmup_steps", "micro_batch_tokens"):
        assert key in msg, f"valid key {key!r} missing from: {msg}"


def test_unknown_section_in_override_lists_valid_sections():
    with pytest.raises(ConfigError) as info:
        load(None, ["trainer.steps=3"])
    msg = str(info.value)
    assert "trainer" in msg
    for section in ("model", "data", "rollout", "reward", "algo", "train", "eval", "run"):
        assert section in msg


def test_override_without_section_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        load(None, ["steps=3"])
    msg = str(info.value)
    assert "section.key" in msg and "train.steps" in msg and "rollout.max_new_tokens" in msg


def test_unknown_key_in_recipe_file_names_file_and_valid_keys(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[rollout]\nprompts_per_step = 4\ntemprature = 0.5\n')
    with pytest.raises(ConfigError) as info:
        load(recipe)
    msg = str(info.value)
    assert str(recipe) in msg and "rollout.temprature" in msg and "temperature" in msg and "max_new_tokens" in msg


def test_unknown_section_in_recipe_file(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[optimizer]\nlr = 1e-3\n')
    with pytest.raises(ConfigError) as info:
        load(recipe)
    msg = str(info.value)
    assert str(recipe) in msg and "'optimizer'" in msg and "train" in msg


def test_section_that_is_not_a_table(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('train = 3\n')
    with pytest.raises(ConfigError, match="table"):
        load(recipe)


def test_valid_keys_covers_every_section():
    keys = valid_keys()
    assert "train.steps" in keys and "run.console" in keys and "reward.fn" in keys
    assert valid_keys("eval") == [k for k in keys if k.startswith("eval.")]


# --------------------------------------------------------------------------------------- bad values


def test_bad_value_type_names_key_and_expectation():
    with pytest.raises(ConfigError) as info:
        load(None, ["rollout.prompts_per_step=many"])
    msg = str(info.value)
    assert "rollout.prompts_per_step" in msg and "integer" in msg and "'many'" in msg


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as info:
        load(None, ["model.dtype=float16"])
    msg = str(info.value)
    assert "model.dtype" in msg and "float32" in msg and "bfloat16" in msg and "float16" in msg


def test_out_of_range_value_names_key_and_bound():
    with pytest.raises(ConfigError) as info:
        load(None, ["rollout.top_p=1.5"])
    msg = str(info.value)
    assert "rollout.top_p" in msg and "1" in msg


def test_bad_value_in_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError) as info:
        load(recipe)
    msg = str(info.value)
    assert str(recipe) in msg and "train.steps" in msg


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load(None, ["train.steps=-1", "train.lr=0"])
    msg = str(info.value)
    assert "train.steps" in msg and "train.lr" in msg


def test_empty_ops_rejected():
    with pytest.raises(ConfigError, match="data.ops"):
        load(None, ["data.ops=[]"])


# ------------------------------------------------------------------------------------- recipe files


def test_toml_syntax_error_names_the_file(tmp_path):
    recipe = tmp_path / "broken.toml"
    recipe.write_text("[train]\nsteps = = 3\n")
    with pytest.raises(ConfigError) as info:
        load(recipe)
    msg = str(info.value)
    assert str(recipe) in msg and "TOML" in msg and "line 2" in msg


def test_missing_recipe_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load(missing)
    assert str(missing) in str(info.value) and "not found" in str(info.value)


def test_overrides_apply_on_top_of_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nsteps = 5\nlr = 1e-4\n[run]\nname = "x"\n')
    cfg = load(recipe, ["train.steps=7"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-4 and cfg.run.name == "x"
    # untouched sections keep their defaults (rollout.engine's "auto" is made concrete by validation)
    assert cfg.rollout == Config().rollout.model_copy(update={"engine": cfg.rollout.engine})


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_loads(recipe, tmp_path):
    # opd.toml distils a run the user trains first (runs/teacher): any existing directory stands in for it here
    overrides = [f"teacher.weights={tmp_path}"] if recipe.name == "opd.toml" else []
    cfg = load(recipe, overrides)
    assert isinstance(cfg, Config)
    assert cfg.train.steps > 0 and cfg.rollout.prompts_per_step > 0


def test_a_missing_teacher_run_is_named_with_how_to_make_it(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher.weights = '.*nope': no such directory.*rollwise train "
                                          r"recipes/quickstart.toml --run-dir"):
        load(RECIPES[0].parent / "opd.toml", [f"teacher.weights={tmp_path / 'nope'}"])


def test_there_is_at_least_one_recipe():
    assert any(p.name == "quickstart.toml" for p in RECIPES)


# ---------------------------------------------------------------------------------- override values


def test_overrides_parse_numbers_bools_lists_and_strings():
    cfg = load(None, [
        "train.steps=12",
        "train.lr=3e-4",
        "rollout.temperature=0.5",
        "algo.filter_zero_variance=false",
        "run.console=true",
        'data.ops=["+", "*"]',
        "train.betas=[0.8, 0.95]",
        'rollout.stop=["\\n\\n", "###"]',
        "data.system_prompt=You are terse.",  # bare words stay a string
        'run.name="quoted name"',
        "model.name=/some/local/dir",
        "reward.fn=toy_plugins:digit_fraction",
    ])
    assert cfg.train.steps == 12 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.rollout.temperature == 0.5
    assert cfg.algo.filter_zero_variance is False
    assert cfg.run.console is True
    assert cfg.data.ops == ["+", "*"]
    assert cfg.train.betas == (0.8, 0.95)
    assert cfg.rollout.stop == ["\n\n", "###"]
    assert cfg.data.system_prompt == "You are terse."
    assert cfg.run.name == "quoted name"
    assert cfg.model.name == "/some/local/dir"
    assert cfg.reward.fn == "toy_plugins:digit_fraction"


def test_override_whitespace_around_key_and_value_is_ignored():
    cfg = load(None, [" train.steps = 4 "])
    assert cfg.train.steps == 4


def test_later_override_wins():
    cfg = load(None, ["train.steps=4", "train.steps=9"])
    assert cfg.train.steps == 9


def test_override_value_may_contain_equals_sign():
    cfg = load(None, ["data.system_prompt=a=b"])
    assert cfg.data.system_prompt == "a=b"


def test_numeric_looking_override_for_a_string_field_stays_a_string():
    cfg = load(None, ["run.name=2024", "data.system_prompt=42"])
    assert cfg.run.name == "2024" and cfg.data.system_prompt == "42"


# ------------------------------------------------------------------------------------------ to_toml


def _roundtrip(cfg: Config) -> Config:
    text = to_toml(cfg)
    tomllib.loads(text)  # valid TOML
    return load_config_from_text(text)


def load_config_from_text(text: str) -> Config:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.toml"
        path.write_text(text)
        return load_config(path)


def test_to_toml_round_trips_defaults():
    cfg = Config()
    assert _roundtrip(cfg) == cfg


def test_to_toml_round_trips_a_customised_config(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    cfg = load(None, [
        "model.name=/tmp/some model",
        "data.system_prompt=Say \"hi\"\\n then\ttab, back\\\\slash and caf\u00e9",
        "data.ops=[\"*\"]",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
        "rollout.stop=[\"</answer>\", \"\\n\"]",
        "rollout.temperature=0.7",
        "train.lr=1e-05",
        "train.betas=[0.9, 0.999]",
        "train.schedule=cosine",
        "algo.kl_coef=0.05",
        "eval.max_new_tokens=16",
        "run.name=my-run",
        "run.console=false",
        "reward.fn=toy_plugins:digit_fraction",
    ])
    again = _roundtrip(cfg)
    assert again == cfg
    assert again.data.system_prompt == cfg.data.system_prompt
    assert again.train.betas == (0.9, 0.999)


def test_to_toml_writes_unset_values_as_comments_and_they_load_as_none():
    cfg = Config()
    text = to_toml(cfg)
    assert "# path = (unset)" in text
    assert _roundtrip(cfg).data.path is None


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_to_toml_round_trips_every_recipe(recipe):
    cfg = load_config(recipe)  # the TOML round trip, not the names (opd.toml's teacher is made later)
    assert _roundtrip(cfg) == cfg


def test_to_toml_round_trips_non_bmp_characters():
    cfg = load(None, ["data.system_prompt=Be nice \U0001F600"])
    assert _roundtrip(cfg) == cfg
