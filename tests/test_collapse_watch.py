"""Collapse seen and named (rollwise.metrics.collapse): the answer metrics by hand, the answers rewards record, the
watch's two warnings on synthetic rows (fire once, re-arm, two evaluations in a row, the noise band, resume), and
`rollwise train` on the tiny model with answers that collapse, a held-out accuracy that drops, and neither."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.envs.lookup import lookup_reward
from rollwise.metrics.collapse import CollapseWatch, answer_metrics, sample_answer
from rollwise.metrics.sinks import MetricsWriter
from rollwise.rewards import REWARDS, score_sample
from rollwise.types import Prompt, Sample, Status


def sample(text: str, answer: str | None = "12", info: dict | None = None, status=Status.COMPLETED) -> Sample:
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "q"}], answer=answer, source="test:0")
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                  status=status, group_id=0, response_text=text, info=dict(info or {}))


# ------------------------------------------------------------------------------------------ the metrics


def test_the_answer_is_the_rewards_else_the_last_line_normalised():
    assert sample_answer(sample("whatever", info={"answer": "  Forty  Two. "})) == "forty two"
    assert sample_answer(sample("Let me think.\n\n  The  Answer is 3. \n\n")) == "the answer is 3"
    assert sample_answer(sample("")) == "" and sample_answer(sample("\n  \n")) == ""
    assert sample_answer(sample("one\ntwo", info={"answer": None})) == "two"  # None: nothing extracted


def test_answer_metrics_by_hand():
    # a, a, a, b: mode a at 3/4; entropy -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.2158 + 0.3466 = 0.5623 nats
    got = answer_metrics([sample("a"), sample("A."), sample("x", info={"answer": "a"}), sample("b")])
    assert got["rollout/answer_mode_frac"] == 0.75 and got["rollout/answer_distinct"] == 2.0
    assert got["rollout/answer_entropy"] == pytest.approx(0.5623, abs=1e-4) and got["rollout/answer_mode"] == "a"
    # four different answers: 1/4 each, entropy ln 4 = 1.3863; a FAILED sample does not count
    spread = answer_metrics([sample(t) for t in "abcd"] + [sample("a", status=Status.FAILED)])
    assert spread["rollout/answer_mode_frac"] == 0.25 and spread["rollout/answer_distinct"] == 4.0
    assert spread["rollout/answer_entropy"] == pytest.approx(math.log(4))
    # one answer: share 1, entropy exactly 0 (not -0.0); responses without text share the answer ""
    same = answer_metrics([sample(""), sample(" ")])
    assert same == {"rollout/answer_mode_frac": 1.0, "rollout/answer_entropy": 0.0, "rollout/answer_distinct": 1.0,
                    "rollout/answer_mode": ""}
    assert math.copysign(1.0, same["rollout/answer_entropy"]) == 1.0
    assert answer_metrics([]) == {} and answer_metrics([sample("a", status=Status.FAILED)]) == {}


@pytest.mark.parametrize("name, text, reference, answer", [
    ("arith", "6 + 6 = 12.0", "12", "12"),  # as an integer
    ("arith", "it is 2.5", "12", "2.5"),  # not an integer: wrong, the number still recorded
    ("arith", "no number here", "12", None),
    ("letters", "There are 3 r's", "3", "3"),
    ("math", "so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "\\frac{1}{2}"),
    ("math", "I think it's 1,234.", "1234", "1234"),
    ("gsm8k", "work...\n#### 1,080\nthanks", "steps #### 1,080", "1080"),
    ("exact", "  Paris \n  France ", "Paris", "Paris France"),
    ("exact", "   ", "Paris", None),
])
def test_rewards_record_the_answer_they_extracted(name, text, reference, answer):
    s = sample(text, reference)
    result = REWARDS.get(name)(s)
    assert result.info.get("answer") == answer
    assert score_sample(s, REWARDS.get(name)) and s.info.get("answer") == answer  # scoring merges it


def test_lookup_and_reasoning_gym_record_their_answers():
    assert lookup_reward(sample("The answer is Blue.", "blue")).info == {"answer": "blue"}
    pytest.importorskip("reasoning_gym")
    reward = REWARDS.get("rollwise.rewards.reasoning_gym:chain_sum")
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "2 + 3 = ?"}], answer="5",
                    info={"metadata": {"source_dataset": "chain_sum"}})
    tagged = Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                    status=Status.COMPLETED, group_id=0, response_text="hmm <answer> 5 </answer>")
    assert reward(tagged).info == {"answer": "5"}
    tagged.response_text = "no idea"
    assert reward(tagged).info == {}


# ------------------------------------------------------------------------------------------ the watch


def train_row(step: int, share: float | None, accuracy: float = 0.1, answer: str = "1", entropy=None) -> dict:
    row = {"step": step, "kind": "train", "reward/accuracy": accuracy, "train/entropy": entropy}
    if share is not None:
        row.update({"rollout/answer_mode_frac": share, "rollout/answer_mode": answer})
    return row


def eval_row(step: int, accuracy: float | None, n: int = 100, greedy: bool = True) -> dict:
    key = "eval/greedy_accuracy" if greedy else "eval/sampled_accuracy"
    return {"step": step, "kind": "eval", key: accuracy, "eval/n": float(n)}


def test_answer_collapse_fires_once_and_again_after_it_clears(capsys):
    watch = CollapseWatch()
    alarms = [watch.observe(r)["collapse/answer_alarm"] for r in (
        train_row(1, 0.95), train_row(2, 1.0), train_row(3, 0.5), train_row(4, 0.9, accuracy=0.8),
        train_row(5, 0.99, accuracy=0.85), train_row(6, None))]
    assert alarms == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # both bounds inclusive; right 85% of the time: no collapse
    lines = capsys.readouterr().out.splitlines()
    assert lines == watch.summary() and len(lines) == 2
    assert lines[0].startswith("rollwise: step 1: answer collapse: 95% of this step's responses answer '1' while "
                               "10% are correct; likely cause: the policy collapsed onto the task's majority answer")
    assert lines[1].startswith("rollwise: step 4: answer collapse: 90%")
    for knob in ("train.lr", "algo.kl_coef", "0.02", "algo.clip_high", "0.28", "control.dynamic_sampling = true",
                 "train.early_stop"):
        assert knob in lines[0], knob


def test_entropy_ratio_over_the_first_three_steps():
    watch = CollapseWatch()
    entropies = [1.0, None, 2.0, 3.0, 0.5]  # a step without training has no entropy: not part of the baseline
    ratios = [watch.observe(train_row(i + 1, 0.1, entropy=e)).get("train/entropy_ratio")
              for i, e in enumerate(entropies)]
    # baselines: 1 | - | (1+2)/2 = 1.5 | (1+2+3)/3 = 2 (full) | 2
    assert ratios == [1.0, None, pytest.approx(2 / 1.5), 1.5, 0.25]


def test_held_out_drop_needs_two_evaluations_below_the_noise_band(capsys):
    """n = 100 prompts, best 0.5: noise 2 sqrt(0.25 / 100) = 0.1."""
    watch = CollapseWatch()
    values = [0.40, 0.50, 0.45, 0.41, 0.35, 0.38, 0.30, 0.45, 0.30, 0.30]
    #         best  best  in band (0.05, 0.09)  below 1  below 2: fires  still  clears  1  2: fires again
    alarms = [watch.observe(eval_row(step, v))["collapse/eval_drop_alarm"] for step, v in enumerate(values)]
    assert alarms == [0, 0, 0, 0, 0, 1, 1, 0, 0, 1]
    assert (watch.best_value, watch.best_step) == (0.5, 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines == watch.summary() and len(lines) == 2
    assert lines[0].startswith("rollwise: step 5: held-out drop: eval/greedy_accuracy 0.380 is below its best 0.500 "
                               "(step 1) by more than its noise (±0.100 on 100 prompts) for 2 evaluations in a row; "
                               "likely cause: the policy drifted. Try: lower train.lr")
    assert lines[0].endswith("The best checkpoint: rollwise eval --model RUN_DIR --best")
    assert lines[1].startswith("rollwise: step 9: held-out drop")


def test_held_out_drop_reads_sampled_accuracy_and_names_the_cause(tmp_path, capsys):
    """Without a greedy accuracy the sampled one counts; an unusable evaluation changes nothing. The cause is the
    last train row's: answer collapse, else entropy collapse (ratio < 0.5), else a drift."""
    watch = CollapseWatch(tmp_path)
    watch.observe(eval_row(0, 1.0, n=16, greedy=False))  # noise at 1.0 on 16 prompts: 1/16
    watch.observe(train_row(1, 0.95, answer="yes"))
    watch.observe(eval_row(1, 0.5, n=16, greedy=False))
    assert watch.observe(eval_row(2, None, greedy=False)) == {"collapse/eval_drop_alarm": 0.0, "collapse/eval_answer_alarm": 0.0} and watch.below == 1
    assert watch.observe(eval_row(3, 0.5, n=16, greedy=False)) == {"collapse/eval_drop_alarm": 1.0, "collapse/eval_answer_alarm": 0.0}
    line = watch.summary()[-1]
    assert "eval/sampled_accuracy 0.500 is below its best 1.000 (step 0)" in line and "±0.062 on 16" in line
    assert "likely cause: answer collapse (the last step gave 'yes' as 95% of its answers)" in line
    assert line.endswith(f"rollwise eval --model {tmp_path} --best")
    entropy = CollapseWatch()
    for row in (train_row(1, 0.1, entropy=2.0), eval_row(1, 0.9), train_row(2, 0.1, entropy=0.5), eval_row(2, 0.5),
                eval_row(3, 0.5)):
        entropy.observe(row)
    # 0.5 over the baseline (2.0 + 0.5) / 2 = 1.25 (the first steps' entropies include the step's own): 0.40
    assert "likely cause: entropy collapse (policy entropy at 0.40 x its first steps')" in entropy.summary()[-1]


def test_resume_from_metrics_jsonl_gives_the_same_state(tmp_path, capsys):
    rows = [eval_row(0, 0.5), train_row(1, 0.95, entropy=1.0), eval_row(1, 0.3), train_row(2, 0.3, entropy=0.4),
            eval_row(2, 0.3), train_row(3, 0.92, entropy=0.2)]
    live = CollapseWatch(tmp_path)
    with MetricsWriter(tmp_path) as writer:
        for row in rows:
            writer.write({**row, **live.observe(row)})  # what the loop writes
    capsys.readouterr()
    resumed = CollapseWatch.for_run(tmp_path)
    assert capsys.readouterr().out == ""  # folding the past prints nothing
    assert resumed == live and len(resumed.summary()) == 3
    for row in (train_row(4, 0.95, entropy=0.1), eval_row(4, 0.2)):  # and goes on alike
        assert resumed.observe(row) == live.observe(row)
    assert CollapseWatch.for_run(tmp_path / "fresh") == CollapseWatch(tmp_path / "fresh")


# ------------------------------------------------------------------------------------------ rollwise train


@pytest.fixture
def train(tmp_path, tiny_model_dir):
    """`train(**overrides)` -> (output, metrics rows, summary) of `rollwise train` on the tiny model."""
    def run(**overrides):
        run_dir = tmp_path / "run"
        args = tiny_overrides(tiny_model_dir, **{"eval.n": 8, **overrides})
        result = CliRunner().invoke(app, ["train", *args, "--run-dir", str(run_dir)])
        assert result.exit_code == 0, result.output
        return result.output, read_rows(run_dir), json.loads((run_dir / "summary.json").read_text())
    return run


def test_train_names_an_answer_collapse(train):
    """Every response's answer is "1" and wrong: the warning at step 1 only (it never clears), in summary.json."""
    output, rows, summary = train(**{"reward.fn": "toy_collapse_plugins:always_one", "train.steps": 2})
    steps = [r for r in rows if r["kind"] == "train"]
    assert [(r["rollout/answer_mode_frac"], r["rollout/answer_mode"], r["collapse/answer_alarm"]) for r in steps] \
        == [(1.0, "1", 1.0), (1.0, "1", 1.0)]
    [held_out, line] = [ln for ln in output.splitlines() if "answer collapse" in ln]
    assert line.startswith("rollwise: step 1: answer collapse: 100% of this step's responses answer '1' while 0%")
    # the held-out replies answer "1" too, at step 0 already, while the arithmetic references are spread out
    assert held_out.startswith("rollwise: step 0: held-out answer collapse: 100% of the held-out greedy replies "
                               "answer '1', while only ") and "the starting model already gives one answer" in held_out
    assert summary["warnings"] == [held_out, line]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert all(r["collapse/eval_drop_alarm"] == 0.0 and r["collapse/eval_answer_alarm"] == 1.0 for r in evals)
    assert all(r["eval/greedy_answer_mode_frac"] == 1.0 and r["eval/reference_mode_frac"] < 0.8 for r in evals)


def test_train_names_a_held_out_drop(train, tmp_path):
    """Held-out accuracy 1, 1, 0, 0 at steps 0..3: the warning after the second evaluation below the best."""
    output, rows, summary = train(**{"reward.fn": "toy_collapse_plugins:right_then_wrong", "train.steps": 3,
                                     "eval.every_steps": 1})
    evals = [(r["step"], r["collapse/eval_drop_alarm"]) for r in rows if r["kind"] == "eval"]
    assert evals == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0)]
    [line] = [ln for ln in output.splitlines() if "held-out drop" in ln]
    assert line.startswith("rollwise: step 3: held-out drop: eval/") and "best 1.000 (step 0)" in line
    assert line.endswith(f"rollwise eval --model {tmp_path / 'run'} --best") and summary["warnings"] == [line]


def test_train_without_collapse_warns_of_nothing(train):
    output, rows, summary = train()
    steps = [r for r in rows if r["kind"] == "train"]
    assert all(r["rollout/answer_mode_frac"] < 0.9 and r["collapse/answer_alarm"] == 0.0 for r in steps)
    assert all(r["rollout/answer_distinct"] > 1 for r in steps)
    assert "answer collapse" not in output and "held-out drop" not in output and "warnings" not in summary


def test_resumed_train_does_not_repeat_a_warning_that_still_holds(train, tmp_path):
    """The watch is rebuilt from metrics.jsonl: the collapse of step 1 still holds at step 2, so the resumed run
    prints nothing new, and summary.json still lists the warning of step 1."""
    first, _, _ = train(**{"reward.fn": "toy_collapse_plugins:always_one", "train.steps": 1})
    lines = [ln for ln in first.splitlines() if "answer collapse" in ln]
    resumed = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "run"), "train.steps=2"])
    assert resumed.exit_code == 0, resumed.output
    assert "answer collapse" not in resumed.output
    assert [r["collapse/answer_alarm"] for r in read_rows(tmp_path / "run") if r["kind"] == "train"] == [1.0, 1.0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"] == lines
