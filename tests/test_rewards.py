"""Verifiers on model-like answers, and scoring that marks and counts failures instead of scoring 0."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
import types

import pytest

from rollwise.config import RewardConfig
from rollwise.rewards import REWARDS, build_reward_fn, final_integer, score_samples
from rollwise.types import Prompt, RewardResult, Sample, Status


def sample(text: str, answer: str | None = "12") -> Sample:
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "q"}], answer=answer, source="test:0")
    return Sample(
        prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
        status=Status.COMPLETED, group_id=0, response_text=text,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6 + 6 = 12.", 12),
        ("The answer is 12", 12),
        ("\\boxed{12}", 12),
        ("So we get \\boxed{12}. Check: 6 + 6", 12),  # the boxed answer wins over later numbers
        ("I think it's 1,234.", 1234),
        ("12 apples... no wait, 13", 13),
        ("-5", -5),
        ("x = -5!", -5),
        ("10-3 is 7", 7),
        ("7 - 10 = -3", -3),
        ("It is 12.0", 12),
        ("It is 2.5", None),
        ("no number here", None),
        ("", None),
        ("1,2,3", 3),
        ("1,2345", 2345),
        ("Answer: 42!!", 42),
    ],
)
def test_final_integer_table(text, expected):
    assert final_integer(text) == expected


@pytest.mark.parametrize(
    "name, text, answer, correct",
    [
        ("arith", "6 + 6 = 12.", "12", True),
        ("arith", "The answer is 12", "12", True),
        ("arith", "\\boxed{12}", "12", True),
        ("arith", "I think it's 1,234.", "1234", True),
        ("arith", "12 apples... no wait, 13", "12", False),
        ("arith", "12 apples... no wait, 13", "13", True),
        ("arith", "-5", "-5", True),
        ("arith", "no number here", "12", False),
        ("letters", "There are 3 r's in strawberry.", "3", True),
        ("letters", "The word 'banana' has 6 letters", "6", True),
        ("letters", "'r' appears 2 times", "3", False),
        ("math", "\\frac{1}{2}", "0.5", True),
        ("math", "0.5", "\\frac{1}{2}", True),
        ("math", "$x=3$", "3", True),
        ("math", "The answer is $\\boxed{12}$.", "12", True),
        ("math", "The answer is 13", "12", False),
        ("math", "no number here", "12", False),
        ("math", "I think it's 1,234.", "1234", True),
        ("exact", "  Paris \n", "Paris", True),
        ("exact", "paris", "Paris", False),
    ],
)
def test_verifier_table(name, text, answer, correct):
    s = sample(text, answer)
    result = REWARDS.get(name)(s)
    assert result == RewardResult(
        value=float(correct), parts={"correct": float(correct), "format": result.parts["format"]}, error=None
    )
    assert s.correct is correct


def test_format_part_says_whether_an_answer_was_found():
    assert REWARDS.get("arith")(sample("no number here")).parts["format"] == 0.0
    assert REWARDS.get("arith")(sample("It is 7")).parts["format"] == 1.0


def test_math_numeric_fallback_when_math_verify_cannot_parse():
    # math-verify extracts nothing from a bare parenthesised number; the fallback compares last numbers
    from math_verify import parse

    assert parse("seventy (70)") == []
    assert REWARDS.get("math")(sample("seventy (70)", "70")).value == 1.0
    assert REWARDS.get("math")(sample("(7.0000001)", "7")).value == 1.0  # within 1e-6 relative
    assert REWARDS.get("math")(sample("(7.1)", "7")).value == 0.0
    assert REWARDS.get("math")(sample("(7)", "blue")).value == 0.0  # non-numeric gold: just wrong


def test_math_works_outside_the_main_thread():
    out = []
    worker = threading.Thread(target=lambda: out.append(REWARDS.get("math")(sample("\\frac{1}{2}", "0.5")).value))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_all_builtin_rewards_registered():
    assert {"arith", "letters", "math", "exact"} <= set(REWARDS.names())


# -------------------------------------------------------------------------------------------- scoring


def test_score_samples_metrics_hand_computed():
    samples = [sample("12"), sample("13"), sample("\\boxed{12}"), sample("none")]
    metrics = score_samples(samples, REWARDS.get("arith"))
    # rewards 1, 0, 1, 0 -> mean 0.5, population std 0.5; format found in 3 of 4
    assert metrics == {
        "reward/errors": 0.0, "reward/error_frac": 0.0, "reward/mean": 0.5, "reward/std": 0.5,
        "reward/accuracy": 0.5, "reward/part/correct": 0.5, "reward/part/format": 0.75,
    }
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert [s.correct for s in samples] == [True, False, True, False]
    assert samples[0].reward_parts == {"correct": 1.0, "format": 1.0}
    assert all(s.status == Status.COMPLETED for s in samples)


def failing(sample: Sample) -> RewardResult:
    if "boom" in sample.response_text:
        raise ZeroDivisionError("division by zero")
    return RewardResult(value=2.0, parts={"len": 1.0})


def test_raising_reward_marks_failed_and_counts_not_zero():
    samples = [sample("ok"), sample("boom"), sample("ok too")]
    metrics = score_samples(samples, failing)
    bad = samples[1]
    assert bad.status == Status.FAILED and bad.reward is None and bad.correct is None
    assert bad.reward_error == "ZeroDivisionError: division by zero"
    assert metrics["reward/errors"] == 1.0 and metrics["reward/error_frac"] == pytest.approx(1 / 3)
    assert metrics["reward/mean"] == 2.0 and metrics["reward/std"] == 0.0  # failures not averaged in as 0
    assert metrics["reward/accuracy"] == 1.0  # no "correct" part: correct = value > 0
    assert metrics["reward/part/len"] == 1.0


@pytest.mark.parametrize(
    "result, message",
    [
        (0.5, "TypeError: reward function returned float, expected RewardResult"),
        (RewardResult(value=math.nan), "ValueError: reward value nan is not a finite number"),
        (RewardResult(value=1.0, parts={"x": math.inf}), "ValueError: reward part 'x' = inf is not a finite number"),
        (RewardResult(value=0.0, error="judge unreachable"), "RewardFailure: judge unreachable"),
    ],
)
def test_unusable_results_are_failures(result, message):
    s = sample("x")
    metrics = score_samples([s], lambda _: result)
    assert s.status == Status.FAILED and s.reward is None and s.reward_error == message
    assert metrics == {"reward/errors": 1.0, "reward/error_frac": 1.0}


def test_slow_reward_times_out_and_outer_timer_survives():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        s = sample("x")
        score_samples([s], lambda _: time.sleep(3) or RewardResult(1.0), timeout_s=0.2)
        assert s.status == Status.FAILED and s.reward_error.startswith("RewardTimeout: ")
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 4.0 < remaining <= 5.0  # the caller's timer was re-armed, not lost
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


def test_empty_batch():
    assert score_samples([], REWARDS.get("exact")) == {"reward/errors": 0.0, "reward/error_frac": 0.0}


def test_missing_or_bad_reference_is_an_error_not_zero():
    no_answer, not_int = sample("12", answer=None), sample("12", answer="twelve")
    score_samples([no_answer, not_int], REWARDS.get("arith"))
    assert no_answer.reward_error == "ValueError: prompt 'test:0' has no reference answer"
    assert not_int.reward_error == "ValueError: reference answer 'twelve' of prompt 'test:0' is not an integer"


def test_build_reward_fn_default_plugin_and_format_weight(monkeypatch):
    fn = build_reward_fn(RewardConfig(), "letters")
    assert fn is REWARDS.get("letters")
    plugin = types.ModuleType("fake_reward_plugin")
    plugin.half = lambda s: RewardResult(value=0.5, parts={"correct": 0.0, "format": 1.0})
    monkeypatch.setitem(sys.modules, "fake_reward_plugin", plugin)
    weighted = build_reward_fn(RewardConfig(fn="fake_reward_plugin:half", format_weight=0.25), "arith")
    assert weighted(sample("x")) == RewardResult(value=0.75, parts={"correct": 0.0, "format": 1.0})
    arith = build_reward_fn(RewardConfig(format_weight=0.1), "arith")
    assert arith(sample("11")).value == pytest.approx(0.1) and arith(sample("12")).value == pytest.approx(1.1)
    assert arith(sample("none")).value == 0.0
