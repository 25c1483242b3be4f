"""Task mixtures (`[[data.mix]]`): the stratified order, per-source rewards, metrics and held-out prompts, exact
resume through `rollwise train --resume`, and one-line errors for bad tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.config_load import load_config
from rollwise.data import build_prompt_source
from rollwise.data.mix import MixtureSource
from rollwise.metrics import write_report
from rollwise.rewards import REWARDS, build_reward_fn, reward_metrics, score_batch
from rollwise.train.checkpoint import load_trainer_state
from rollwise.types import Sample, Status


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def recipe(tmp_path: Path, tables: str, name: str = "mix.toml") -> Path:
    path = tmp_path / name
    path.write_text("[data]\n" + tables)
    return path


TWO = """
[[data.mix]]
task = "arith"
weight = 3
eval_size = 40
reward = "toy_plugins:digit_fraction"

[[data.mix]]
task = "letters"
name = "words"
eval_size = 40
"""


def mixture(tmp_path: Path, seed: int = 0, tables: str = TWO) -> MixtureSource:
    return build_prompt_source(load_config(recipe(tmp_path, tables)).data, seed)


def sample_for(prompt, response: str) -> Sample:
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2, 3], behaviour_logprobs=[0.0, 0.0],
                  loss_mask=[1, 1], status=Status.COMPLETED, group_id=0, response_text=response)


# ------------------------------------------------------------------------------------- the order


def test_order_is_stratified_by_weight_and_seeded(tmp_path):
    """Weights 3:1: every prefix of the order holds each source within one of its share; a step of 8 prompts
    has 6 and 2. The seed changes the interleaving, not the shares."""
    mix = mixture(tmp_path)
    assert mix.names == ["arith", "words"] and mix.weights == [3.0, 1.0]
    origins = [mix.train_prompt(i).origin for i in range(400)]
    for n in range(1, 401):
        assert abs(origins[:n].count("arith") - 0.75 * n) <= 1, n
    for step in range(50):
        assert origins[8 * step: 8 * step + 8].count("words") == 2
    other = [mixture(tmp_path, seed=s).train_prompt(i).origin for s in (1, 2, 3) for i in range(8)]
    assert other != origins[:8] * 3
    assert [mixture(tmp_path).train_prompt(i).origin for i in range(40)] == origins[:40]  # deterministic


def test_each_source_reads_its_own_stream_in_order(tmp_path):
    """Source i's position is the count of earlier positions it was given: its prompts are its own
    train_prompt(0), (1), ... in order, tagged with the origin, a source-unique uid and its reward."""
    mix = mixture(tmp_path)
    arith, words = mix.sources
    got = [mix.train_prompt(i) for i in range(24)]
    mine = [p for p in got if p.origin == "arith"]
    assert [p.messages for p in mine] == [arith.train_prompt(i).messages for i in range(len(mine))]
    theirs = [p for p in got if p.origin == "words"]
    assert [p.messages for p in theirs] == [words.train_prompt(i).messages for i in range(len(theirs))]
    assert all(p.uid.startswith(p.origin + "/") for p in got)
    assert {p.info["mix_reward"] for p in mine} == {"toy_plugins:digit_fraction"}
    assert {p.info["mix_reward"] for p in theirs} == {"letters"}  # the letters task's own reward
    assert mix.train_prompt(3).uid == got[3].uid  # asked out of order: the assignment is replayed


def test_state_dict_resumes_the_cursor(tmp_path):
    mix = mixture(tmp_path)
    first = [mix.train_prompt(i).uid for i in range(30)]
    fresh = mixture(tmp_path)
    for i in range(12):
        fresh.train_prompt(i)
    resumed = mixture(tmp_path)
    resumed.load_state_dict(fresh.state_dict())
    assert resumed.state_dict()["counts"] == [9, 3]
    assert [resumed.train_prompt(i).uid for i in range(12, 30)] == first[12:]
    changed = mixture(tmp_path, tables=TWO.replace("weight = 3", "weight = 2"))
    with pytest.raises(ValueError, match="weights"):
        changed.load_state_dict(fresh.state_dict())


def test_held_out_prompts_split_eval_n_evenly_with_their_origin(tmp_path):
    mix = mixture(tmp_path)
    assert mix.num_eval == 80 and mix.eval_counts(9) == [5, 4] and mix.eval_counts(80) == [40, 40]
    small = mixture(tmp_path, tables=TWO.replace("eval_size = 40\nreward", "eval_size = 3\nreward"))
    assert small.eval_counts(10) == [3, 7]  # a source with fewer gives what it has, the other the rest
    held = mix.eval_prompts(9)
    assert [p.origin for p in held] == ["arith"] * 5 + ["words"] * 4
    assert [p.messages for p in held[:5]] == [p.messages for p in mix.sources[0].eval_prompts(5)]
    with pytest.raises(ValueError, match="eval.n"):
        mix.eval_prompts(81)


# ----------------------------------------------------------------------------------- rewards


def test_each_prompt_is_scored_by_its_sources_reward_with_per_source_metrics(tmp_path):
    """arith prompts by digit_fraction (digits per response token), letters prompts by the letters verifier;
    `reward/<source>/accuracy` and `/mean` over each source's samples."""
    mix = mixture(tmp_path)
    fn = build_reward_fn(load_config(None).reward, mix.default_reward)
    arith = next(p for p in map(mix.train_prompt, range(8)) if p.origin == "arith")
    words = next(p for p in map(mix.train_prompt, range(8)) if p.origin == "words")
    samples = [sample_for(arith, "12"), sample_for(arith, "x"),  # digit_fraction: 2 digits / 2 tokens = 1, then 0
               sample_for(words, f"It is {words.answer}."), sample_for(words, "It is 99.")]
    scored = score_batch(samples, fn)
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0, 0.0]
    assert [s.correct for s in scored] == [True, False, True, False]
    metrics = reward_metrics(scored, 4)
    assert metrics["reward/arith/mean"] == 0.5 and metrics["reward/arith/accuracy"] == 0.5
    assert metrics["reward/words/mean"] == 0.5 and metrics["reward/words/samples"] == 2.0
    assert metrics["reward/mean"] == 0.5 and "reward/part/digits" in metrics
    alone = reward_metrics(score_batch([sample_for(p, "1") for p in build_prompt_source(
        load_config(None).data, 0).eval_prompts(2)], REWARDS.get("arith")), 2)
    assert not [k for k in alone if k.count("/") == 2 and not k.startswith("reward/part/")]  # one source: none


def test_the_mixture_reward_refuses_a_prompt_without_a_source():
    from rollwise.types import Prompt

    s = sample_for(Prompt(uid="p", messages=[{"role": "user", "content": "hi"}], answer="1"), "1")
    assert not score_batch([s], REWARDS.get("mixture")) and "mix_reward" in s.reward_error


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("tables, expected", [
    ('[[data.mix]]\ntask = "arith"\nweight = 0\n', "data.mix.0.weight: Input should be greater than 0"),
    ('[[data.mix]]\ntask = "arith"\nwieght = 1\n', "data.mix.0.wieght: Extra inputs are not permitted"),
    ('[[data.mix]]\ntask = "arith"\n[[data.mix]]\ntask = "arith"\n',
     '[[data.mix]] number 2 ("arith"): name "arith" is also the name of [[data.mix]] number 1'),
    ('[[data.mix]]\ntask = "arithh"\n', '[[data.mix]] number 1 ("arithh"): task = \'arithh\' is not a known task'),
    ('[[data.mix]]\ntask = "arith"\nreward = "nope"\n', "reward = 'nope' is not a known reward"),
    ('[[data.mix]]\npath = "missing.jsonl"\n', '[[data.mix]] number 1 ("missing"): path'),
    ('[[data.mix]]\nweight = 2\n', "give task = ... (a task name or 'reasoning_gym:<dataset>') or path = ..."),
    ('[[data.mix]]\ntask = "arith"\nname = "a b"\n', "data.mix.0.name: String should match pattern"),
    ('[[data.mix]]\ntask = "arith"\nname = "part"\n', 'name "part" is taken by reward/part/<part> metrics'),
    ('task = "letters"\n[[data.mix]]\ntask = "arith"\n', "data.task = 'letters' is set beside [[data.mix]]"),
    ('digits = 2\n[[data.mix]]\ntask = "arith"\n', "data.digits = 2 is set beside [[data.mix]] tables"),
    ('[[data.mix]]\ntask = "arith"\nsplit = "fact"\n[[data.mix]]\ntask = "letters"\nsplit = "fact"\n',
     '[[data.mix]] number 2 ("letters"): data.split = "fact" is not available for task \'letters\''),
])
def test_bad_mixture_fails_at_dry_run_in_one_line(tmp_path, tables, expected):
    result = invoke("train", "--dry-run", str(recipe(tmp_path, tables)))
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], result.stderr


def test_reward_fn_beside_a_mixture_fails(tmp_path):
    result = invoke("train", "--dry-run", str(recipe(tmp_path, TWO)), "reward.fn=math")
    assert result.exit_code == 2 and "give reward = ... in the [[data.mix]] tables" in result.stderr


def test_a_source_with_its_own_environment_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r'\[\[data.mix\]\] number 2 \("calc"\).*single-turn'):
        mixture(tmp_path, tables='[[data.mix]]\ntask = "arith"\n[[data.mix]]\ntask = "calc"\n')


# ------------------------------------------------------------------------------------ a real run


STEPS = {"data.eval_size": None, "rollout.prompts_per_step": 4, "run.save_every_steps": 2, "run.samples_logged_per_step": 16,
         "eval.n": 10, "eval.every_steps": 2, "train.lr": 1e-3}


def train_cli(run_dir: Path, model_dir: Path, path: Path, steps: int):
    result = invoke("train", str(path), "--run-dir", str(run_dir),
                    *tiny_overrides(model_dir, **STEPS, **{"train.steps": steps}))
    assert result.exit_code == 0, result.output
    return read_rows(run_dir)


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory, tiny_model_dir):
    """A: 4 steps of the two-source mixture. B: 2 steps, then `rollwise train --resume B train.steps=4`."""
    root = tmp_path_factory.mktemp("mix")
    path = recipe(root, TWO)
    a, b = root / "A", root / "B"
    rows_a = train_cli(a, tiny_model_dir, path, 4)
    train_cli(b, tiny_model_dir, path, 2)
    result = invoke("train", "--resume", str(b), "train.steps=4")
    assert result.exit_code == 0, result.output
    return a, b, rows_a, read_rows(b)


@pytest.mark.slow
def test_mixture_trains_with_per_source_metrics_every_step(straight_and_resumed):
    a, _, rows, _ = straight_and_resumed
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for row in train:  # weights 3:1 with 4 prompts x 4 samples a step: 3 arith prompts, 1 letters prompt
        assert row["reward/arith/samples"] == 12.0 and row["reward/words/samples"] == 4.0
        for source in ("arith", "words"):
            assert 0.0 <= row[f"reward/{source}/accuracy"] <= 1.0 and f"reward/{source}/mean" in row
    assert any(r.get("train/tokens", 0) > 0 for r in train)  # digit_fraction is dense: arith groups train
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for row in evals:  # eval.n = 10 split evenly; each source's held-out prompts carry their origin
        assert row["eval/n"] == 10 and row["eval/arith/n"] == 5 and row["eval/words/n"] == 5
        assert 0 <= row["eval/words/sampled_accuracy"] <= 1
    logged = [json.loads(line) for line in (a / "samples" / "step-1.jsonl").read_text().splitlines()]
    assert len(logged) == 8
    html = write_report(a).read_text()
    assert "<h2>Sources</h2>" in html and "Accuracy: arith" in html and "Accuracy: words" in html
    assert "reward/words/accuracy" in html and "Reward by source" in html
    config = (a / "config.toml").read_text()
    assert 'mix = [{name = "arith", weight = 3.0, task = "arith"' in config


@pytest.mark.slow
def test_mixture_resumes_exactly(straight_and_resumed):
    a, b, rows_a, rows_b = straight_and_resumed
    for step in (1, 2, 3, 4):
        name = f"samples/step-{step}.jsonl"
        assert (a / name).read_text() == (b / name).read_text(), name
    per_source = [k for k in rows_a[-2] if k.startswith(("reward/arith/", "reward/words/"))]
    train_a = {r["step"]: r for r in rows_a if r["kind"] == "train"}
    train_b = {r["step"]: r for r in rows_b if r["kind"] == "train"}
    for step in (3, 4):
        assert {k: train_a[step][k] for k in per_source} == {k: train_b[step][k] for k in per_source}
    state_a = load_trainer_state(a / "checkpoints" / "step-4")["source"]
    state_b = load_trainer_state(b / "checkpoints" / "step-4")["source"]
    assert state_a == state_b and state_a["position"] == 16 and state_a["counts"] == [12, 4]
    wa = AutoModelForCausalLM.from_pretrained(a / "checkpoints" / "step-4").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b / "checkpoints" / "step-4").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
