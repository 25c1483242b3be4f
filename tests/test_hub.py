"""Hub ids for models and datasets, read through a real Hugging Face cache layout under a temporary HF_HOME
(tests/helpers_hub.py), offline: resolution by branch, tag and commit, the one-line errors for what is not
cached (at --dry-run too), the hub unreachable, and a user's run: `rollwise train model.name=org/name
data.path=org/dataset` and `rollwise eval --model org/name@tag`."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROLLWISE, read_rows, subprocess_env, tiny_overrides
from helpers_hub import TEST, TRAIN, commit_hash, gsm8k_folder, place_in_hub_cache, write_parquet
from rollwise.cli import app
from rollwise.config import ConfigError, DataConfig
from rollwise.data import DatasetError, build_prompt_source
from rollwise.models import ModelNotFoundError, load_model, resolve_model_dir
from rollwise.validate import load

MODEL_ID, DATASET_ID = "tiny-org/tiny-llama", "tiny-org/gsm8k-mini"
@pytest.fixture
def hf_home(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A fresh HF_HOME holding the tiny model (main, and tag v1 at another commit) and the GSM8K-shaped dataset,
    offline. Returns the hub cache folder."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE",
                 "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    place_in_hub_cache(cache, MODEL_ID, tiny_model_dir)
    place_in_hub_cache(cache, MODEL_ID, tiny_model_dir, branch="v1", commit=commit_hash("v1"))
    place_in_hub_cache(cache, DATASET_ID, gsm8k_folder(tmp_path / "gsm8k-mini"), repo_type="dataset")
    return cache


# ------------------------------------------------------------------------------------------------ models


def test_the_layout_is_a_real_hub_cache(hf_home):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    info = scan_cache_dir(hf_home)
    assert not info.warnings
    repos = {(r.repo_id, r.repo_type): r for r in info.repos}
    model = repos[(MODEL_ID, "model")]
    assert {rev.commit_hash: set(rev.refs) for rev in model.revisions} == {
        commit_hash(f"{MODEL_ID}@main"): {"main"}, commit_hash("v1"): {"v1"}}
    assert (DATASET_ID, "dataset") in repos
    found = try_to_load_from_cache(MODEL_ID, "config.json", cache_dir=hf_home)
    main = commit_hash(f"{MODEL_ID}@main")
    assert found == str(hf_home / f"models--tiny-org--tiny-llama/snapshots/{main}/config.json")


def test_hub_id_resolves_by_branch_tag_and_commit(hf_home):
    snapshots = hf_home / "models--tiny-org--tiny-llama" / "snapshots"
    main, v1 = snapshots / commit_hash(f"{MODEL_ID}@main"), snapshots / commit_hash("v1")
    assert resolve_model_dir(MODEL_ID) == main
    assert resolve_model_dir(f"{MODEL_ID}@main") == main
    assert resolve_model_dir(f"{MODEL_ID}@v1") == v1
    assert resolve_model_dir(f"{MODEL_ID}@{commit_hash('v1')}") == v1
    model, tokenizer = load_model(f"{MODEL_ID}@v1")
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name, revision", [("tiny-org/absent", None), (MODEL_ID, "v9")])
def test_a_model_missing_offline_fails_in_one_line_naming_the_id_and_the_fix(hf_home, name, revision):
    full = name if revision is None else f"{name}@{revision}"
    with pytest.raises(ModelNotFoundError) as err:
        load_model(full)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model {name!r}")
    assert f"hf download {name}" + (f" --revision {revision}" if revision else "") in message
    assert str(hf_home) in message and "HF_HUB_OFFLINE" in message and "model.name to a local directory" in message
    with pytest.raises(ConfigError) as dry:  # what --dry-run checks, before anything loads
        load(None, [f'model.name="{full}"'])
    assert str(dry.value) == message


def test_an_unreachable_hub_falls_back_to_the_cache(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    assert resolve_model_dir(MODEL_ID) == hf_home / "models--tiny-org--tiny-llama/snapshots" / commit_hash(
        f"{MODEL_ID}@main")
    with pytest.raises(ModelNotFoundError, match=r"^model 'tiny-org/absent' is not a local directory and not in the "
                                                 r"Hugging Face cache .*, and the hub cannot be reached \("):
        resolve_model_dir("tiny-org/absent")
    load(None, ['model.name="tiny-org/absent"'])  # online, --dry-run leaves the download to the start
    start = time.perf_counter()
    assert build_prompt_source(gsm8k_config(eval_split_name="test"), seed=0).num_eval == 5
    with pytest.raises(DatasetError, match=r"^dataset 'tiny-org/absent' is not a local file or dataset folder and not "
                                           r"in the Hugging Face cache .*, and the hub cannot be reached \("):
        build_prompt_source(gsm8k_config(path="tiny-org/absent"), seed=0)
    assert time.perf_counter() - start < 10  # one quick failed call, not datasets' retries (about 20 s)


def test_a_local_directory_wins_over_a_hub_id(hf_home, tmp_path, monkeypatch, tiny_model_dir):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-org" / "tiny-llama")
    assert resolve_model_dir(MODEL_ID) == (tmp_path / MODEL_ID).resolve()
    (tmp_path / "tiny-org" / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):  # an existing folder is never an id
        resolve_model_dir("tiny-org/empty")


# ---------------------------------------------------------------------------------------------- datasets


def gsm8k_config(**overrides) -> DataConfig:
    return DataConfig(**{"path": DATASET_ID, "config": "main", "prompt_field": "question", **overrides})


def test_a_hub_dataset_reads_its_configuration_and_splits_offline(hf_home):
    source = build_prompt_source(gsm8k_config(eval_split_name="test"), seed=0)
    assert source.num_train == 12 and source.num_eval == 5
    assert source.split_summary() == ("12 rows in tiny-org/gsm8k-mini[main] -> 12 train, 5 held-out = all of "
                                      "tiny-org/gsm8k-mini[main/test] (data.eval_split_name)")
    held_out = source.eval_prompts(5)
    assert [p.messages for p in held_out] == [[{"role": "user", "content": r["question"]}] for r in TEST]
    assert [p.answer for p in held_out] == [r["answer"] for r in TEST]
    assert held_out[0].source == "tiny-org/gsm8k-mini[main/test]:row 0"
    trained = {source.train_prompt(i).uid for i in range(12)}
    assert trained == {f"{DATASET_ID}[main]#{n}" for n in range(12)}  # train and test uids never collide
    socratic = build_prompt_source(gsm8k_config(config="socratic", eval_size=1), seed=0)
    assert socratic.num_train + socratic.num_eval == 4  # no eval split: a quarter of the 4 rows held out


def test_a_dataset_revision_after_the_at_sign(hf_home, tmp_path):
    other = tmp_path / "other"
    write_parquet(other / "data" / "train-00000-of-00001.parquet", TRAIN[:8])
    place_in_hub_cache(hf_home, DATASET_ID, other, repo_type="dataset", branch=None, commit=commit_hash("old"))
    source = build_prompt_source(gsm8k_config(path=f"{DATASET_ID}@{commit_hash('old')}", config=None), seed=0)
    assert source.num_train + source.num_eval == 8


@pytest.mark.parametrize("overrides, message", [
    ({"config": None}, "tiny-org/gsm8k-mini has several configurations (main, socratic): set data.config to one of "
                       "them"),
    ({"config": "mian"}, "data.config = 'mian' is not a configuration of tiny-org/gsm8k-mini; valid: main, socratic"),
    ({"split_name": "validation"}, "data.split_name = 'validation' is not a split of tiny-org/gsm8k-mini "
                                   "(configuration main); splits: train, test"),
    ({"config": "socratic", "eval_split_name": "test"}, "data.eval_split_name = 'test' is not a split of "
                                                        "tiny-org/gsm8k-mini (configuration socratic); splits: train"),
])
def test_a_wrong_configuration_or_split_names_the_key_and_the_valid_names(hf_home, overrides, message):
    with pytest.raises(DatasetError) as err:
        build_prompt_source(gsm8k_config(**overrides), seed=0)
    assert str(err.value) == message


def test_a_dataset_missing_offline_fails_in_one_line_at_dry_run_and_at_start(hf_home):
    with pytest.raises(ConfigError) as dry:
        load(None, ['data.path="tiny-org/absent"'])
    message = str(dry.value)
    assert "\n" not in message and message.startswith("dataset 'tiny-org/absent' is not a local file or dataset folder")
    assert "hf download tiny-org/absent --repo-type dataset" in message and "data.path to a local file" in message
    with pytest.raises(DatasetError) as start:
        build_prompt_source(gsm8k_config(path="tiny-org/absent"), seed=0)
    assert str(start.value) == message
    with pytest.raises(ConfigError, match=r"^data.path = 'data/typo.jsonl': no such file or directory"):
        load(None, ['data.path="data/typo.jsonl"'])  # a file name is never taken for a hub id


def test_a_local_dataset_folder_with_a_card_and_jsonl_files(hf_home, tmp_path):
    folder = tmp_path / "my_math"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: data/train.jsonl\n  - split: test\n    path: data/test.jsonl\n---\n")
    for split, rows in (("train", TRAIN), ("test", TEST)):
        (folder / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load(None, [f'data.path="{folder}"', 'data.prompt_field="question"', 'data.eval_split_name="test"'])
    source = build_prompt_source(cfg.data, seed=0)
    assert (source.num_train, source.num_eval) == (12, 5)
    assert source.eval_prompts(1)[0].source == "my_math[test]:row 0"
    (folder / "my_math.py").write_text("import datasets\n")
    with pytest.raises(DatasetError, match=r"a dataset script; datasets .* no longer runs dataset scripts"):
        build_prompt_source(cfg.data, seed=0)


def test_a_single_file_has_no_configurations_or_splits(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    with pytest.raises(DatasetError, match=r"^data.config = 'main' names a configuration .*: remove data.config$"):
        build_prompt_source(DataConfig(path=str(path), config="main", prompt_field="question"), seed=0)
    with pytest.raises(DatasetError, match=r"^data.eval_split_name = 'test': .*rows.jsonl is a single file, one split"):
        build_prompt_source(DataConfig(path=str(path), eval_split_name="test", prompt_field="question"), seed=0)


# ------------------------------------------------------------------------------------------- a user's run


@pytest.mark.slow
def test_train_and_eval_a_hub_model_on_a_hub_dataset_offline(hf_home, tmp_path):
    """`rollwise train model.name=org/name data.path=org/dataset` (2 steps) and `rollwise eval --model org/name@v1`
    as subprocesses: the environment (HF_HOME, HF_HUB_OFFLINE) is read by a fresh interpreter."""
    env = subprocess_env()  # conftest's, plus this test's HF_HOME and HF_HUB_OFFLINE (monkeypatched into os.environ)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(MODEL_ID, **{"data.path": DATASET_ID, "data.config": "main",
                                            "data.prompt_field": "question", "data.eval_split_name": "test",
                                            "reward.fn": "gsm8k", "eval.n": 4, "run.report": False,
                                            "run.save_every_steps": 2})
    proc = subprocess.run([ROLLWISE, "train", "--run-dir", str(run_dir), *overrides], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "rollwise: data: 12 rows in tiny-org/gsm8k-mini[main] -> 12 train, 5 held-out" in proc.stdout
    rows = read_rows(run_dir)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 2 and all(r["reward/errors"] == 0 for r in train_rows)  # every reference parsed
    assert [r["eval/n"] for r in rows if r["kind"] == "eval"] == [4.0, 4.0]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-2").config.model_type == "llama"
    proc = subprocess.run([ROLLWISE, "eval", "--model", f"{MODEL_ID}@v1", "--n", "3", "--max-new-tokens", "4",
                           f'data.path="{DATASET_ID}"', 'data.config="main"', 'data.prompt_field="question"',
                           'data.eval_split_name="test"', "model.threads=1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"] == f"{MODEL_ID}@v1" and result["task"] == DATASET_ID and result["n"] == 3


def test_a_dry_run_with_hub_ids_prints_them(hf_home):
    result = CliRunner().invoke(app, ["train", "--dry-run", f"model.name={json.dumps(MODEL_ID)}",
                                      f"data.path={json.dumps(DATASET_ID)}", 'data.config="main"'])
    assert result.exit_code == 0, result.output
    assert f'name = "{MODEL_ID}"' in result.output and 'config = "main"' in result.output
