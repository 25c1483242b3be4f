"""What a constant answer cannot buy (rollwise/metrics/prior.py): balanced accuracy, the answer shares, the
held-out answer-collapse warning, and the best checkpoint chosen by balanced accuracy through `rollwise train`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from rollwise.cli import app
from rollwise.metrics.collapse import CollapseWatch
from rollwise.metrics.prior import balanced_accuracy, prior_metrics, reference_class, reference_mode_frac
from rollwise.train.checkpoint import best_checkpoint
from rollwise.types import Prompt, Sample, Status


def prompt(uid: str, answer: str | None) -> Prompt:
    return Prompt(uid=uid, messages=[{"role": "user", "content": f"Q{uid}?"}], answer=answer)


def sample(p: Prompt, answer: str, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(prompt=p, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1], group_id=0,
               response_text=answer, status=status)
    s.correct = answer == p.answer
    s.info["answer"] = answer
    return s


REFS = [prompt(str(i), "1") for i in range(3)] + [prompt("3", "2")]  # references 1, 1, 1, 2


def test_balanced_accuracy_by_hand():
    """The module docstring's example: replies 1,1,1,1 -> plain 0.75, balanced (1 + 0)/2 = 0.5; replies 1,1,2,2
    -> balanced (2/3 + 1)/2 = 0.8333; the references' own mode share 0.75."""
    constant = [[sample(p, "1")] for p in REFS]
    assert balanced_accuracy(constant) == 0.5
    mixed = [[sample(p, a)] for p, a in zip(REFS, ["1", "1", "2", "2"])]
    assert balanced_accuracy(mixed) == pytest.approx((2 / 3 + 1) / 2)
    assert reference_mode_frac(REFS) == 0.75
    metrics = prior_metrics(constant, "greedy")
    assert metrics == {"eval/greedy_balanced_accuracy": 0.5, "eval/greedy_answer_mode_frac": 1.0,
                       "eval/greedy_answer_mode": "1"}


def test_balanced_accuracy_counts_samples_and_skips_failed_rewards():
    """k samples per prompt pool into their class; a FAILED reward is not a wrong answer; references are
    normalised ("Blue." and "blue" are one class); prompts without a reference are classes of their own."""
    blue = [prompt("a", "Blue."), prompt("b", "blue")]
    groups = [[sample(blue[0], "Blue."), sample(blue[0], "red")], [sample(blue[1], "x", Status.FAILED)]]
    assert reference_class(blue[0]) == reference_class(blue[1]) == "blue"
    assert balanced_accuracy(groups) == 0.5  # one class, 1 right of 2 scored
    assert balanced_accuracy([[sample(blue[1], "x", Status.FAILED)]]) is None
    free = [prompt("c", None), prompt("d", None), prompt("e", "7")]
    assert reference_mode_frac(free) == pytest.approx(1 / 3)  # no two share
    plain = [[sample(free[0], "")], [sample(free[1], "")], [sample(free[2], "7")]]
    for s in plain[:2]:
        s[0].correct = True  # a judge said so: no reference, the prompt is its own class
    assert balanced_accuracy(plain) == 1.0
    assert reference_mode_frac([]) is None and balanced_accuracy([]) is None


def eval_row(step, mode_frac, reference=0.56, answer="1"):
    return {"kind": "eval", "step": step, "eval/n": 100.0, "eval/greedy_accuracy": 0.5,
            "eval/greedy_balanced_accuracy": 0.3, "eval/greedy_answer_mode_frac": mode_frac,
            "eval/greedy_answer_mode": answer, "eval/reference_mode_frac": reference}


def test_held_out_answer_collapse_rule():
    """Fires at >= 0.9 of the replies on one answer and >= 0.2 above the references' share; once per onset;
    not for the empty answer, nor when the references are that skewed themselves."""
    watch = CollapseWatch()
    flags = [watch.observe(eval_row(s, f), echo=False)["collapse/eval_answer_alarm"]
             for s, f in ((0, 0.44), (5, 0.92), (10, 0.98), (15, 0.6), (20, 0.95))]
    assert flags == [0.0, 1.0, 1.0, 0.0, 1.0] and len(watch.warnings) == 2
    assert watch.warnings[0].startswith("rollwise: step 5: held-out answer collapse: 92% of the held-out greedy "
                                        "replies answer '1', while only 56% of the references share")
    assert CollapseWatch().observe(eval_row(0, 0.95, reference=0.8), echo=False)["collapse/eval_answer_alarm"] == 0.0
    assert CollapseWatch().observe(eval_row(0, 1.0, answer=""), echo=False)["collapse/eval_answer_alarm"] == 0.0


def test_the_start_stays_eligible_when_it_answers_one_thing_too(tmp_path):
    """A starting model that already answers one thing (course_schedule: "True" to every prompt) is the best until
    a later evaluation beats it without collapsing; later collapsed evaluations are passed over whatever they score."""
    from rollwise.config import EarlyStopConfig
    from rollwise.early_stop import EarlyStop

    early = EarlyStop(EarlyStopConfig(metric="eval/greedy_balanced_accuracy", patience=0), tmp_path)
    rows = [(0, 0.50, 1.0), (5, 0.60, 1.0), (10, 0.55, 0.7), (15, 0.52, 0.8)]
    for step, balanced, share in rows:
        row = {**eval_row(step, share, reference=0.53, answer="true"), "eval/greedy_balanced_accuracy": balanced}
        early.count(row)
    assert early.best_step == 10 and early.best_value == 0.55 and early.collapsed_steps == [5]


@pytest.fixture
def skewed_data(tmp_path):
    """40 questions, references "1" (3 of 4) and "2"; held-out split of 8."""
    path = tmp_path / "skewed.jsonl"
    rows = [{"prompt": f"What is item {i}?", "answer": "2" if i % 4 == 3 else "1"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_never_points_at_the_prior(tmp_path, tiny_model_dir, skewed_data):
    """Through `rollwise train`: from step 1 the policy answers the majority "1" to everything, which raises plain
    held-out accuracy (to the references' share) and balanced accuracy too (a weak start is below a constant
    answer's 1/2), but its replies collapsed onto one answer: checkpoints/best stays at step 0, summary.json's best
    names the steps passed over, and the run says the held-out replies collapsed."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, **{"reward.fn": "toy_collapse_plugins:majority_from_version_1",
                                                  "data.path": str(skewed_data), "data.eval_size": 8, "eval.n": 8,
                                                  "eval.every_steps": 1, "train.steps": 2})
    result = CliRunner().invoke(app, ["train", *overrides, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    evals = {r["step"]: r for r in read_rows(run_dir) if r["kind"] == "eval"}
    refs = evals[0]["eval/reference_mode_frac"]
    assert 0.5 <= refs < 0.8 and evals[0]["eval/greedy_answer_mode_frac"] < 0.9
    for step in (1, 2):  # the prior: every reply "1", plain accuracy = the references' share, balanced 1/2
        row = evals[step]
        assert row["eval/greedy_answer_mode_frac"] == 1.0 and row["eval/greedy_answer_mode"] == "1"
        assert row["eval/greedy_accuracy"] == pytest.approx(refs) and row["eval/greedy_balanced_accuracy"] == 0.5
        assert row["eval/greedy_balanced_accuracy"] > evals[0]["eval/greedy_balanced_accuracy"]
        assert row["collapse/eval_answer_alarm"] == 1.0
    assert best_checkpoint(run_dir).name == "step-0"
    best = json.loads((run_dir / "summary.json").read_text())["best"]
    assert best["metric"] == "eval/greedy_balanced_accuracy" and best["step"] == 0
    assert best["plain_accuracy"] == evals[0]["eval/greedy_accuracy"] and best["passed_over_steps"] == [1, 2]
    [line] = [ln for ln in result.output.splitlines() if "held-out answer collapse" in ln]
    assert line.startswith("rollwise: step 1: held-out answer collapse: 100% of the held-out greedy replies answer '1'")
    assert "steps 1, 2 passed over: their held-out replies answer one thing" in result.output
