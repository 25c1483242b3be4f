"""reasoning-gym tasks by name (`data.task = "reasoning_gym:<dataset>"`): the split, the dataset's own scoring,
`rollwise train` and `rollwise eval` on the tiny model, and one-line errors at --dry-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.config import DataConfig
from rollwise.data import build_prompt_source
from rollwise.types import Prompt, Sample, Status

reasoning_gym = pytest.importorskip("reasoning_gym")

from rollwise.data.reasoning_gym import EVAL_BASE, STREAM, ReasoningGymTask  # noqa: E402
from rollwise.rewards import REWARDS, score_sample  # noqa: E402
from rollwise.rewards.reasoning_gym import extract_answer  # noqa: E402

SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # 2 x 10 x 10 = 200 distinct questions


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def sample_for(prompt: Prompt, response: str) -> Sample:
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                  status=Status.COMPLETED, group_id=0, response_text=response)


def source(task: str, seed: int = 0, eval_size: int = 16, **options) -> ReasoningGymTask:
    return build_prompt_source(DataConfig(task=f"reasoning_gym:{task}", options=options, eval_size=eval_size), seed)


# ------------------------------------------------------------------------------------------ scoring


def test_chain_sum_scores_full_partial_zero_and_the_fallback():
    """chain_sum's own scorer (reasoning_gym.utils.compute_decimal_reward): equal as decimals -> 1; the oracle
    inside a longer answer -> len(oracle) / len(answer); else 0. A response without tags is scored on its
    last number and counted in `answer_fallback`."""
    task = source("chain_sum")
    prompt = next(p for p in map(task.train_prompt, range(50)) if not p.answer.startswith("-"))
    gold = prompt.answer
    assert prompt.info["metadata"]["source_dataset"] == "chain_sum" and prompt.messages[0]["role"] == "system"
    reward = REWARDS.get("rollwise.rewards.reasoning_gym:chain_sum")
    cases = [  # response, value, correct, format, fallback
        (f"think... <answer>{gold}</answer>", 1.0, True, 1.0, 0.0),
        (f"<answer>+{gold}.00</answer>", 1.0, True, 1.0, 0.0),  # the scorer tolerates sign and decimals
        (f"<answer>{gold}99</answer>", len(gold) / (len(gold) + 2), False, 1.0, 0.0),  # partial credit
        ("<answer>banana</answer>", 0.0, False, 1.0, 0.0),
        (f"The sum is {gold}.", 1.0, True, 0.0, 1.0),  # fallback: the last number
        (f"<answer>{gold}", 1.0, True, 0.0, 1.0),  # fallback: an unclosed tag
        ("no idea", 0.0, False, 0.0, 0.0),  # nothing to score: no fallback either
    ]
    for response, value, correct, fmt, fallback in cases:
        s = sample_for(prompt, response)
        assert score_sample(s, reward), s.reward_error
        assert s.reward == pytest.approx(value) and s.correct is correct, response
        assert s.reward_parts["format"] == fmt and s.reward_parts["answer_fallback"] == fallback, response
        assert s.reward_parts["score"] == pytest.approx(value)
    # the generic reward finds the dataset in the item's metadata and agrees
    s = sample_for(prompt, f"<answer>{gold}99</answer>")
    assert score_sample(s, REWARDS.get("reasoning_gym")) and s.reward == pytest.approx(len(gold) / (len(gold) + 2))


def test_spell_backward_partial_credit_by_position():
    """spell_backward's scorer: 1 for the reversed word (any case), else 1/len per position that matches."""
    prompt = source("spell_backward").train_prompt(3)
    gold = prompt.answer
    assert len(gold) >= 3
    wrong_last = gold[:-1] + ("x" if gold[-1] != "x" else "y")
    reward = REWARDS.get("reasoning_gym")
    for response, value in ((f"<answer>{gold.upper()}</answer>", 1.0),
                            (f"<answer>{wrong_last}</answer>", (len(gold) - 1) / len(gold)),
                            (f"Reversed, it reads:\nAnswer: {gold}.", 1.0)):  # fallback: the last line
        s = sample_for(prompt, response)
        assert score_sample(s, reward) and s.reward == pytest.approx(value), response
        assert s.correct is (value == 1.0)


def test_answer_extraction_follows_reasoning_gyms_tags():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>", "2") == ("2", False)  # the last one
    assert extract_answer("so 3 + 4 = 7", "7") == ("7", True)
    assert extract_answer('The letter "s" appears twice in the text.', "2") == ("2", True)  # a number word
    assert extract_answer("It appears once, not 3 times.", "1") == ("3", True)  # a digit wins over words
    assert extract_answer("Step 1\n**Final answer:** cat.", "cat") == ("cat", True)
    assert extract_answer("   ", "cat") == (None, False)


def test_a_scorer_that_raises_is_a_counted_failure_not_zero():
    prompt = source("chain_sum").train_prompt(0)
    broken = Prompt(uid="x", messages=prompt.messages, answer=prompt.answer, info={})  # no dataset anywhere
    s = sample_for(broken, "<answer>1</answer>")
    assert not score_sample(s, REWARDS.get("reasoning_gym"))
    assert s.status == Status.FAILED and "metadata.source_dataset" in s.reward_error


# -------------------------------------------------------------------------------------------- split


@pytest.mark.parametrize("task, options", [("chain_sum", SMALL_SUMS), ("gcd", {"max_value": 12})])
def test_held_out_questions_are_never_trained(task, options):
    """A small item space, so training streams do meet held-out questions: every one is redrawn. The held-out
    split is the same for every training seed; the training streams differ."""
    a, b = source(task, 0, 32, **options), source(task, 1, 32, **options)
    held = {p.messages[-1]["content"] for p in a.eval_prompts(32)}
    assert len(held) == 32 and held == {p.messages[-1]["content"] for p in b.eval_prompts(32)}
    met = sum(a._stream_item(j)["question"] in held for j in range(2000))
    assert met > 0  # the raw stream does hold held-out questions: the dedup is what keeps them out
    trained = [a.train_prompt(i).messages[-1]["content"] for i in range(2000)]
    assert not held & set(trained)
    assert trained[:50] != [b.train_prompt(i).messages[-1]["content"] for i in range(50)]
    assert [a.train_prompt(i).uid for i in range(20)] == [a.train_prompt(i).uid for i in range(20)]


def test_held_out_and_training_rng_seeds_never_meet():
    """For generators seeded `Random(seed + idx)` the streams are disjoint by construction: training rng seeds
    lie below 2^31, held-out ones from EVAL_BASE up."""
    for seed in (0, 1, 127, 10**9, -3):
        task = source("chain_sum", seed, 4)
        assert 0 <= task._train_base and task._train_base + STREAM <= 2**31 < EVAL_BASE


def test_too_small_an_item_space_fails_naming_eval_size():
    with pytest.raises(ValueError, match="data.eval_size"):
        source("chain_sum", 0, 300, min_terms=2, max_terms=2, max_digits=1)


# ---------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("override, expected", [
    ("data.task=reasoning_gym:chain_summ", "has no dataset 'chain_summ'; valid: reasoning_gym:ab"),
    ("data.options={min_termz=2}", "unknown data.options min_termz; the fields of its config are: min_terms"),
    ("data.options={min_terms=5, max_terms=2}", "AssertionError: max_terms must be >= min_terms"),
    ("data.options={seed=3}", "may not set seed"),
])
def test_bad_dataset_or_option_fails_at_dry_run_in_one_line(override, expected):
    result = invoke("train", "--dry-run", "data.task=reasoning_gym:chain_sum", override)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], result.stderr


def test_trains_two_steps_through_rollwise_train_scored_by_the_dataset(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    result = invoke("train", "--run-dir", str(run_dir), *tiny_overrides(tiny_model_dir, **{
        "data.task": "reasoning_gym:chain_sum", "data.options": SMALL_SUMS, "data.eval_size": 16, "eval.n": 8,
        "rollout.samples_per_prompt": 8, "data.system_prompt": "Answer with a number."}))
    assert result.exit_code == 0, result.output
    train_rows = [r for r in read_rows(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    for row in train_rows:
        assert row["reward/errors"] == 0 and 0 <= row["reward/part/answer_fallback"] <= 1
        assert row["reward/mean"] == pytest.approx(row["reward/part/score"])
    assert sum(r.get("train/tokens", 0) for r in train_rows) > 0  # seed 0: some group had reward variance and trained
    scorer = reasoning_gym.create_dataset("chain_sum", **SMALL_SUMS).score_answer
    logged = [json.loads(line) for step in (1, 2) for line in (run_dir / f"samples/step-{step}.jsonl").open()]
    for row in logged:  # every logged reward is chain_sum's own score of the answer extracted from the response
        answer, _ = extract_answer(row["response"], row["answer"])
        assert row["reward"] == pytest.approx(scorer(answer, {"answer": row["answer"], "metadata": {}}))


def test_eval_cli_on_the_task_and_on_a_file(tmp_path, tiny_model_dir):
    """`rollwise eval --task reasoning_gym:NAME [--data FILE] --out FILE` prints one JSON object and writes one
    line per response, scored by the dataset (file rows without metadata too)."""
    out = tmp_path / "out.jsonl"
    common = ("--model", str(tiny_model_dir), "--task", "reasoning_gym:spell_backward", "--max-new-tokens", "4",
              "model.threads=1", "data.eval_size=8", "data.max_prompt_tokens=1024")
    result = invoke("eval", *common, "--n", "4", "--out", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["task"] == "reasoning_gym:spell_backward" and summary["n"] == 4
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 8 and all(line["error"] is None and line["reward"] is not None for line in lines)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Spell this word backward: cat", "answer": "tac"}) + "\n")
    result = invoke("eval", *common, "--data", str(data), "--out", str(out))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["answer"] for line in lines] == ["tac", "tac"] and all(line["error"] is None for line in lines)


def test_eval_reports_the_extra_when_reasoning_gym_is_missing(monkeypatch):
    """Without the package: one line with the pip command."""
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    result = invoke("train", "--dry-run", "data.task=reasoning_gym:chain_sum")
    assert result.exit_code == 2 and "pip install 'rollwise[reasoning-gym]'" in result.stderr, result.output
