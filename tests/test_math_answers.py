"""GSM8K and MATH answers verified with math-verify, on rows written to look like the real datasets: GSM8K's
worked solutions ending in '#### <answer>' (thousands separators, negatives, dollars, decimals), MATH's
solutions with a final `\\boxed{}` (fractions, radicals, units, tuples); responses that answer in words, with
`\\boxed{}` or with '####', and wrong answers that share the right answer's digits. Scored through
`rollwise.rewards.scoring.score_batch`, and through a 2-step run on a JSONL file of such rows."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from conftest import read_rows, tiny_config
from rollwise.loop import train
from rollwise.rewards import REWARDS, RewardsFailingError, score_batch, score_samples
from rollwise.types import Prompt, Sample, Status

# GSM8K-style rows: "answer" is the worked solution with calculator annotations and the final "#### <answer>".
GSM8K = [
    {"question": "A bakery sells muffins for $3 each. It sold 48 muffins on Monday and half as many on Tuesday. "
                 "How much money did it make on the two days?",
     "answer": "On Tuesday it sold 48 / 2 = <<48/2=24>>24 muffins.\nIn all it sold 48 + 24 = <<48+24=72>>72 "
               "muffins.\nIt made 72 * 3 = $<<72*3=216>>216.\n#### 216"},
    {"question": "A school buys 45 tablets at $24 each. How much does it pay?",
     "answer": "It pays 45 * 24 = $<<45*24=1080>>1,080.\n#### 1,080"},
    {"question": "At 6 pm the temperature was 5 degrees. By midnight it had dropped 8 degrees. What was the "
                 "temperature at midnight?",
     "answer": "The temperature was 5 - 8 = <<5-8=-3>>-3 degrees.\n#### -3"},
    {"question": "Maria buys 3 notebooks for $2.50 each. How much does she spend?",
     "answer": "She spends 3 * 2.50 = $<<3*2.5=7.5>>7.5.\n#### 7.5"},
    {"question": "Of the 40 students in a class, 3/8 walk to school. How many students walk?",
     "answer": "3/8 of 40 is 40 * 3 / 8 = <<40*3/8=15>>15 students.\n#### 15"},
    {"question": "A farmer has 12 rows of 15 apple trees. He plants 20 more trees. How many trees does he have?",
     "answer": "He had 12 * 15 = <<12*15=180>>180 trees.\nNow he has 180 + 20 = <<180+20=200>>200 trees.\n#### 200"},
    {"question": "Sam reads 14 pages a day. How many pages does he read in 3 weeks?",
     "answer": "3 weeks are 3 * 7 = <<3*7=21>>21 days.\nHe reads 21 * 14 = <<21*14=294>>294 pages.\n#### 294"},
    {"question": "A car travels 150 miles on 6 gallons of gas. How many miles does it travel per gallon?",
     "answer": "It travels 150 / 6 = <<150/6=25>>25 miles per gallon.\n#### 25"},
]
# MATH-style rows: "solution" ends with the answer in \boxed{}.
MATH = [
    {"problem": "A fair six-sided die is rolled. What is the probability of rolling an even number or a 1? Express "
                "your answer as a common fraction.",
     "solution": "The favorable outcomes are 1, 2, 4 and 6, so the probability is $\\frac{4}{6} = "
                 "\\boxed{\\frac{2}{3}}$."},
    {"problem": "Solve for $x$: $4x + 2 = 0$.",
     "solution": "Subtracting 2 and dividing by 4, $x = \\boxed{-\\frac{1}{2}}$."},
    {"problem": "Simplify $\\sqrt{72}$.", "solution": "$\\sqrt{72} = \\sqrt{36 \\cdot 2} = \\boxed{6\\sqrt{2}}$."},
    {"problem": "A shirt costs $\\$21$ and is on sale for 10% off. What is the sale price?",
     "solution": "The discount is $0.1 \\cdot 21 = 2.10$, so the price is $\\boxed{\\$18.90}$."},
    {"problem": "A square has area 144 square centimeters. How long is a side?",
     "solution": "The side is $\\sqrt{144} = \\boxed{12\\text{ cm}}$."},
    {"problem": "Where do the lines $y = x - 3$ and $y = -2x$ meet?",
     "solution": "Setting $x - 3 = -2x$ gives $x = 1$ and $y = -2$, so they meet at $\\boxed{(1,-2)}$."},
]

# (row, response, correct) for GSM8K rows; the wrong ones share digits with the right answer.
GSM8K_CASES = [
    (0, "Tuesday: 48 / 2 = 24 muffins. Total 72 muffins, and 72 * 3 = 216.\n#### 216", True),
    (0, "The bakery made $216 in total.", True),
    (0, "The answer is \\boxed{216}.", True),
    (0, "#### 216\nI hope this helps with your 2 questions!", True),   # the answer is the line after ####
    (0, "The bakery made $2,160 in total.", False),
    (0, "The bakery made $126.", False),
    (1, "45 * 24 = 1,080, so the school pays $1,080.", True),          # thousands separator
    (1, "It pays \\$1080.", True),
    (1, "It pays $1,800.", False),
    (1, "It pays $108.", False),
    (2, "5 - 8 = -3, so it was -3 degrees at midnight.", True),          # negative
    (2, "It was 3 degrees below zero, so 3 degrees.", False),
    (3, "Maria spends $7.50.", True),                                   # trailing zero of a price
    (3, "She spends 15/2 dollars.", True),                              # a fraction
    (3, "She spends $75.", False),
    (3, "She spends $7.05.", False),
    (4, "40 * 3/8 = 15 students walk.", True),
    (4, "So 3/8 of the students walk.", False),                        # the last expression is not the count
    (5, "I am not sure how many.", False),                              # no number at all
]
MATH_CASES = [
    (0, "There are 4 favorable outcomes out of 6, so $\\boxed{\\dfrac{2}{3}}$.", True),
    (0, "The probability is \\boxed{4/6}.", True),
    (0, "The probability is \\boxed{\\frac{3}{2}}.", False),
    (1, "So $x = -0.5$, i.e. \\boxed{-0.5}.", True),                     # a decimal for a latex \frac
    (1, "\\boxed{\\frac{1}{2}}", False),                                 # the sign matters
    (2, "\\boxed{\\sqrt{72}}", True),
    (2, "\\boxed{2\\sqrt{6}}", False),
    (3, "The sale price is \\boxed{18.9}.", True),                      # the dollar sign of the reference
    (3, "The sale price is \\boxed{\\$19.80}.", False),
    (4, "Each side is 12 cm, so the answer is \\boxed{12}.", True),      # units of the reference
    (5, "They meet at \\boxed{(1, -2)}.", True),
    (5, "They meet at \\boxed{(-2, 1)}.", False),
]


def sample(question: str, reference: str, response: str) -> Sample:
    prompt = Prompt(uid=question[:20], messages=[{"role": "user", "content": question}], answer=reference,
                    source="rows:0")
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                  status=Status.COMPLETED, group_id=0, response_text=response)


@pytest.mark.parametrize("name", ["gsm8k", "math"])
def test_gsm8k_rows_through_score_batch(name):
    samples = [sample(GSM8K[i]["question"], GSM8K[i]["answer"], text) for i, text, _ in GSM8K_CASES]
    scored = score_batch(samples, REWARDS.get(name))
    assert len(scored) == len(samples)  # no reward failed: every reference's '#### <answer>' was read
    assert [s.correct for s in samples] == [correct for _, _, correct in GSM8K_CASES]
    assert [s.reward for s in samples] == [float(correct) for _, _, correct in GSM8K_CASES]
    assert [s.reward_parts["format"] for s in samples][-1] == 0.0  # "I am not sure": no answer found


def test_math_rows_through_score_batch():
    samples = [sample(MATH[i]["problem"], MATH[i]["solution"], text) for i, text, _ in MATH_CASES]
    metrics = score_samples(samples, REWARDS.get("math"))
    assert [s.correct for s in samples] == [correct for _, _, correct in MATH_CASES]
    right = sum(correct for _, _, correct in MATH_CASES)  # 7 of 12
    assert metrics["reward/errors"] == 0.0 and metrics["reward/mean"] == pytest.approx(right / len(MATH_CASES))


def test_gsm8k_reward_needs_the_answer_mark():
    """A reference without '#### <answer>' (e.g. data.answer_field naming the question) is a counted error."""
    bad = sample("q", GSM8K[0]["question"], "#### 216")
    assert score_batch([bad], REWARDS.get("gsm8k")) == [] and bad.status == Status.FAILED
    assert "has no '#### <answer>' line (GSM8K's format)" in bad.reward_error
    assert "data.answer_field" in bad.reward_error


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K))
    return path


def run(cfg, run_dir):
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir)


def test_two_steps_on_a_jsonl_of_gsm8k_rows(tmp_path, tiny_model_dir, gsm8k_file):
    cfg = tiny_config(tiny_model_dir, **{"data.path": str(gsm8k_file), "data.prompt_field": "question",
                                         "reward.fn": "gsm8k", "eval.n": 2, "run.report": False,
                                         "data.max_prompt_tokens": 512})
    run(cfg, tmp_path / "run")
    train_rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert len(train_rows) == 2 and [r["reward/errors"] for r in train_rows] == [0.0, 0.0]
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-1.jsonl").read_text().splitlines()]
    assert logged and {row["answer"] for row in logged} <= {row["answer"] for row in GSM8K}
    for row in logged:  # the loop scored each response as the gsm8k verifier does
        again = sample(row["prompt"], row["answer"], row["response"])
        assert REWARDS.get("gsm8k")(again).value == row["reward"]


def test_a_run_whose_answer_field_is_not_gsm8k_stops_with_the_reason(tmp_path, tiny_model_dir, gsm8k_file):
    cfg = tiny_config(tiny_model_dir, **{"data.path": str(gsm8k_file), "data.prompt_field": "question",
                                         "data.answer_field": "question", "reward.fn": "gsm8k", "eval.n": 0,
                                         "run.report": False, "data.max_prompt_tokens": 512})
    with pytest.raises(RewardsFailingError, match=r"every reward failed for 2 steps in a row .*has no '#### "
                                                  r"<answer>' line"):
        run(cfg, tmp_path / "bad")
