"""Verifiers on model-like answers, and scoring that marks and counts failures instead of scoring 0."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import types
from fractions import Fraction

import numpy as np
import pytest

from rollwise.config import RewardConfig
from rollwise.rewards import (
    REWARDS,
    IsolatedReward,
    RewardFailureGuard,
    RewardsFailingError,
    RewardWorkerError,
    build_reward_fn,
    final_integer,
    score_sample,
    score_samples,
)
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
        value=float(correct), parts={"correct": float(correct), "format": result.parts["format"]}, error=None,
        correct=correct, info=result.info,  # the extracted answer: tests/test_collapse_watch.py
    )
    assert s.correct is None  # the verifier reports; it does not write to the sample
    assert score_sample(s, REWARDS.get(name)) and s.correct is correct


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
        ("0.5", "TypeError: reward function returned str, expected a number, a bool or RewardResult"),
        (None, "TypeError: reward function returned NoneType, expected a number, a bool or RewardResult"),
        (RewardResult(value=math.nan), "ValueError: reward value nan is not a finite number"),
        (math.nan, "ValueError: reward value nan is not a finite number"),
        (np.float32("inf"), "ValueError: reward value inf is not a finite number"),
        (RewardResult(value="1"), "TypeError: reward value is str, expected a number"),
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
    assert weighted(sample("x")) == RewardResult(value=0.75, parts={"correct": 0.0, "format": 1.0}, correct=False)
    arith = build_reward_fn(RewardConfig(format_weight=0.1), "arith")
    assert arith(sample("11")).value == pytest.approx(0.1) and arith(sample("12")).value == pytest.approx(1.1)
    assert arith(sample("none")).value == 0.0


# ------------------------------------------------------------------------- plain values (TRL-style rewards)


@pytest.mark.parametrize(
    "returned, reward, parts, correct",
    [
        (0.75, 0.75, {}, True),
        (-0.5, -0.5, {}, False),
        (0.0, 0.0, {}, False),
        (3, 3.0, {}, True),
        (True, 1.0, {"correct": 1.0}, True),
        (False, 0.0, {"correct": 0.0}, False),
        (np.float32(0.25), 0.25, {}, True),
        (np.float64(-2.0), -2.0, {}, False),
        (np.int64(2), 2.0, {}, True),
        (np.bool_(True), 1.0, {"correct": 1.0}, True),
        (np.bool_(False), 0.0, {"correct": 0.0}, False),
        (np.array(0.5), 0.5, {}, True),  # a 0-d array
        (Fraction(1, 4), 0.25, {}, True),
        (RewardResult(value=np.float32(0.5), parts={"correct": np.bool_(True)}), 0.5, {"correct": 1.0}, True),
    ],
)
def test_plain_numbers_and_bools_score(returned, reward, parts, correct):
    s = sample("x")
    assert score_sample(s, lambda _: returned)
    assert s.status == Status.COMPLETED and s.reward_error is None and s.reward_traceback is None
    assert s.reward == reward and type(s.reward) is float
    assert s.reward_parts == parts and s.correct is correct


def test_bool_reward_metrics_hand_computed():
    samples = [sample("12"), sample("13"), sample("12 "), sample("twelve")]
    metrics = score_samples(samples, build_reward_fn(RewardConfig(fn="toy_plugins:answer_matches"), "arith"))
    # True, False, True (stripped), False -> mean 0.5, std 0.5, accuracy 0.5
    assert metrics == {"reward/errors": 0.0, "reward/error_frac": 0.0, "reward/mean": 0.5, "reward/std": 0.5,
                       "reward/accuracy": 0.5, "reward/part/correct": 0.5}


def test_format_weight_with_a_plain_float_reward(monkeypatch):
    plugin = types.ModuleType("fake_float_plugin")
    plugin.quarter = lambda s: 0.25
    plugin.flag = lambda s: np.bool_(True)
    plugin.bad = lambda s: "yes"
    monkeypatch.setitem(sys.modules, "fake_float_plugin", plugin)
    weighted = build_reward_fn(RewardConfig(fn="fake_float_plugin:quarter", format_weight=0.5), "arith")
    # no format part: no bonus, no error; correct decided on the reward's own value
    assert weighted(sample("x")) == RewardResult(value=0.25, parts={}, correct=True)
    flag = build_reward_fn(RewardConfig(fn="fake_float_plugin:flag", format_weight=0.5), "arith")
    s = sample("x")
    assert score_sample(s, flag) and s.reward == 1.0 and s.correct is True
    bad = build_reward_fn(RewardConfig(fn="fake_float_plugin:bad", format_weight=0.5), "arith")
    assert not score_sample(s, bad)
    assert s.reward_error == "TypeError: reward function returned str, expected a number, a bool or RewardResult"


# ------------------------------------------------------------------------------ time limits and tracebacks


def test_python_busy_loop_is_stopped_in_process():
    def spin(_sample):
        while True:
            pass

    s = sample("x")
    start = time.monotonic()
    assert not score_sample(s, spin, timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert s.reward_error == "RewardTimeout: reward function ran longer than 0.3 s"
    assert "in spin" in s.reward_traceback  # the traceback shows where it was stopped


def test_failure_keeps_the_full_traceback():
    s = sample("12", answer=None)
    assert not score_sample(s, REWARDS.get("arith"))
    assert s.reward_error == "ValueError: prompt 'test:0' has no reference answer"
    assert s.reward_traceback.startswith("Traceback (most recent call last):")
    assert "in reference" in s.reward_traceback and s.reward_traceback.rstrip().endswith(s.reward_error)
    assert score_sample(s, lambda _: 1.0) and s.reward_traceback is None  # cleared when rescored


def test_long_error_message_is_cut_but_traceback_is_not():
    def verbose(_sample):
        raise ValueError("x" * 1000)

    s = sample("x")
    score_sample(s, verbose)
    assert len(s.reward_error) == 200 and s.reward_error.endswith("...")
    assert "x" * 1000 in s.reward_traceback


# ---------------------------------------------------------------------------- isolated (worker processes)


def test_isolated_reward_kills_a_worker_stuck_in_c_and_starts_a_fresh_one():
    timeout_s = 1.0
    cfg = RewardConfig(fn="toy_plugins:hang_in_c", isolate=True, timeout_s=timeout_s)
    with build_reward_fn(cfg, "arith") as fn:
        assert isinstance(fn, IsolatedReward)
        warm = sample("warm")
        assert score_sample(warm, fn, timeout_s) and warm.reward == 4.0  # worker started and loaded the plugin
        first_pid = fn._workers[0].process.pid
        stuck, after = sample("hang"), sample("fine")
        start = time.monotonic()
        metrics = score_samples([stuck, after], fn, timeout_s)
        stuck_s = time.monotonic() - start
        assert stuck.status == Status.FAILED
        assert stuck.reward_error == "RewardTimeout: reward function ran longer than 1.0 s (worker killed)"
        assert after.status == Status.COMPLETED and after.reward == 4.0  # scored by the fresh worker
        assert metrics["reward/errors"] == 1.0 and metrics["reward/mean"] == 4.0
        assert fn.restarts == 1 and fn._workers[0].process.pid != first_pid
        # killed at timeout + grace; the fresh worker's start (a Python import) comes on top
        assert timeout_s <= stuck_s < timeout_s + 3.0
        fresh = fn._workers[0].process
    assert fn._workers == [] and fresh.poll() is not None  # closed: the worker process has exited
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)  # the stuck worker is gone, not left spinning


def test_c_loop_is_not_interruptible_in_process():
    """What isolate is for: in-process, the alarm fires but cannot run until the C call returns."""
    s = sample("x")
    start = time.monotonic()
    assert not score_sample(s, lambda _: sum(range(10**7)) and 1.0, timeout_s=0.01)
    assert time.monotonic() - start > 0.05  # ran to its end (~0.1-0.4 s), far past the 0.01 s limit
    assert s.reward_error.startswith("RewardTimeout: ")  # caught only after the C loop returned


def test_isolated_reward_python_timeout_keeps_the_worker_and_traceback():
    with IsolatedReward("toy_plugins:sleep_then_one", timeout_s=0.3) as fn:
        slow, ok = sample("x"), sample("y")
        slow.info["sleep_s"] = 30.0
        score_samples([slow, ok], fn, 0.3)
        assert slow.reward_error == "RewardTimeout: reward function ran longer than 0.3 s"
        assert "in sleep_then_one" in slow.reward_traceback  # the worker's own traceback came back
        assert ok.reward == 1.0 and fn.restarts == 0


def test_isolated_reward_errors_traceback_and_crash():
    with IsolatedReward("arith", timeout_s=5.0) as fn:
        samples = [sample("12"), sample("12", answer=None), sample("13")]
        assert score_samples(samples, fn, 5.0)["reward/mean"] == 0.5
        assert [s.reward for s in samples] == [1.0, None, 0.0] and samples[0].correct is True
        assert samples[1].reward_error == "ValueError: prompt 'test:0' has no reference answer"
        assert "in reference" in samples[1].reward_traceback
        assert fn(sample("12")) == RewardResult(value=1.0, parts={"correct": 1.0, "format": 1.0}, correct=True,
                                                info={"answer": "12"})  # info comes back from the worker
    with IsolatedReward("toy_plugins:crash_on_request", timeout_s=5.0) as fn:
        crash, after = sample("crash"), sample("fine")
        score_samples([crash, after], fn, 5.0)
        assert crash.reward_error == ("RewardFailure: reward worker process died (exit code 3) while scoring; "
                                      "a fresh one was started")
        assert after.reward == 1.0 and fn.restarts == 1


def test_isolated_reward_with_format_weight_and_bad_name():
    cfg = RewardConfig(fn="arith", isolate=True, format_weight=0.5)
    with build_reward_fn(cfg, "arith") as fn:
        assert fn(sample("13")).value == 0.5 and fn(sample("12")).value == 1.5
    with pytest.raises(KeyError, match="unknown reward 'arithh'"):  # resolved in the parent first
        build_reward_fn(RewardConfig(fn="arithh", isolate=True), "arith")


def test_isolated_reward_not_importable_in_the_worker_is_a_clear_error(monkeypatch):
    plugin = types.ModuleType("memory_only_plugin")  # importable here, not from sys.path in a fresh process
    plugin.one = lambda s: 1.0
    monkeypatch.setitem(sys.modules, "memory_only_plugin", plugin)
    with build_reward_fn(RewardConfig(fn="memory_only_plugin:one", isolate=True), "arith") as fn:
        with pytest.raises(RewardWorkerError, match="cannot load reward 'memory_only_plugin:one': ValueError: "
                                                    "cannot import module 'memory_only_plugin'"):
            score_samples([sample("x")], fn, 5.0)


@pytest.mark.slow
def test_isolated_reward_workers_score_in_parallel():
    with IsolatedReward("toy_plugins:sleep_then_one", timeout_s=5.0, workers=2) as fn:
        fn(sample("x"))
        fn._workers[1].wait_ready(fn.name)
        samples = [sample(str(i)) for i in range(4)]
        for s in samples:
            s.info["sleep_s"] = 0.5
        start = time.monotonic()
        assert score_samples(samples, fn, 5.0)["reward/mean"] == 1.0
        assert time.monotonic() - start < 1.6  # 4 x 0.5 s over 2 workers: about 1 s, not 2


# -------------------------------------------------------------------------------------- failure guard


def failed_sample(message: str) -> Sample:
    s = sample("x")
    score_sample(s, lambda _: (_ for _ in ()).throw(RuntimeError(message)))
    return s


def test_guard_raises_after_n_all_failed_steps_with_first_error():
    guard = RewardFailureGuard(max_failed_steps=2)
    first = failed_sample("judge down")
    guard.observe(5, samples_scored=0, samples_failed=8, first_failed_sample=first)
    with pytest.raises(RewardsFailingError) as info:
        guard.observe(6, samples_scored=0, samples_failed=8, first_failed_sample=failed_sample("later"))
    message = str(info.value)
    assert message.startswith("reward: every reward failed for 2 steps in a row (step 6): RuntimeError: judge down; "
                              "fix reward.fn")
    assert "\n" not in message
    assert info.value.traceback == first.reward_traceback and "judge down" in info.value.traceback
    assert isinstance(info.value, RuntimeError)


def test_guard_resets_when_one_sample_scored_and_keeps_state():
    guard = RewardFailureGuard(max_failed_steps=2)
    bad = failed_sample("nope")
    guard.observe(1, 0, 8, bad)
    guard.observe(2, 1, 7, bad)  # one reward worked: not a failing reward function
    guard.observe(3, 0, 8, bad)
    guard.observe(4, 0, 0, None)  # no samples this step: the streak neither grows nor resets
    restored = RewardFailureGuard(max_failed_steps=2)
    restored.load_state_dict(guard.state_dict())
    assert restored.streak == 1
    with pytest.raises(RewardsFailingError, match=r"for 2 steps in a row \(step 5\)"):
        restored.observe(5, 0, 8, bad)
    with pytest.raises(ValueError, match="max_failed_steps"):
        RewardFailureGuard(0)


# ------------------------------------------------------------------- correctness and extras are results


def says(value: float, correct, parts: dict | None = None, info: dict | None = None):
    """A reward returning `value` with RewardResult.correct = `correct`."""
    return lambda _: RewardResult(value=value, parts=parts or {}, correct=correct, info=info or {})


@pytest.mark.parametrize("reward, correct", [
    (says(0.6, False), False),  # partial credit that is not a right answer
    (says(0.0, True), True),
    (says(1.0, False, {"correct": 1.0}), False),  # the explicit field wins over the part
    (says(0.3, None), True),  # None: decided from the value, as before
    (says(0.3, None, {"correct": 0.0}), False),  # ... or from a `correct` part
    (says(0.3, np.bool_(False)), False),
])
def test_correct_is_the_results_when_it_says(reward, correct):
    s = sample("x")
    assert score_sample(s, reward)
    assert s.correct is correct


def test_accuracy_reads_the_explicit_correct():
    samples = [sample("a"), sample("b"), sample("c")]
    rewards = iter([says(1.0, True), says(0.5, False), says(0.5, False)])
    metrics = score_samples(samples, lambda s: next(rewards)(s))
    assert metrics["reward/accuracy"] == pytest.approx(1 / 3) and metrics["reward/mean"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("result, message", [
    (RewardResult(1.0, correct="yes"), "TypeError: RewardResult.correct is str, expected True, False or None"),
    (RewardResult(1.0, correct=1), "TypeError: RewardResult.correct is int, expected True, False or None"),
    (RewardResult(1.0, info=[("k", 1)]), "TypeError: RewardResult.info is list, expected a dict"),
])
def test_a_bad_correct_or_info_is_a_one_line_failure(result, message):
    s = sample("x")
    assert not score_sample(s, lambda _: result)
    assert s.status == Status.FAILED and s.reward_error == message and "\n" not in s.reward_error


def extras_reward(sample: Sample) -> RewardResult:
    """Reports extras in the result, and (wrongly) also writes to the sample: only the result must count."""
    sample.correct = True
    sample.info["written"] = True
    return RewardResult(value=0.5, parts={}, correct=False, info={"seen": sample.response_text, "cost_s": 0.25})


@pytest.mark.parametrize("isolate", [False, True])
def test_extras_travel_in_the_result_and_survive_isolation(isolate):
    fn = build_reward_fn(RewardConfig(fn="test_rewards:extras_reward", isolate=isolate), "arith")
    try:
        s = sample("the response")
        assert score_sample(s, fn)
    finally:
        if isolate:
            fn.close()
    assert s.info["seen"] == "the response" and s.info["cost_s"] == 0.25
    assert s.correct is False  # the result's, whatever the reward wrote on its copy
    assert ("written" in s.info) is (not isolate)  # a side effect is lost in a worker: why rewards must not rely on one


def formatted_but_wrong(sample: Sample) -> RewardResult:
    return RewardResult(value=0.0, parts={"format": 1.0})


def test_the_format_bonus_does_not_make_a_wrong_answer_correct():
    fn = build_reward_fn(RewardConfig(fn="test_rewards:formatted_but_wrong", format_weight=0.5), "arith")
    s = sample("x")
    assert score_sample(s, fn)
    assert (s.reward, s.correct) == (0.5, False)  # was True: correct was decided on the value with the bonus


def test_a_non_finite_environment_part_fails_the_sample():
    from rollwise.envs.episode import EpisodeState

    bad, good = sample("12"), sample("12")
    bad.episode = EpisodeState(env_state=None, messages=[], parts={"tool_calls": 1.0, "tool_errors": math.nan})
    good.episode = EpisodeState(env_state=None, messages=[], parts={"tool_calls": 1.0})
    metrics = score_samples([bad, good], REWARDS.get("arith"))
    assert bad.status == Status.FAILED and bad.reward is None
    assert bad.reward_error == ("EnvironmentFailure: the environment's reward parts ['tool_errors'] are not finite "
                                "numbers (tool_errors=nan)")
    assert good.reward_parts == {"correct": 1.0, "format": 1.0, "env/tool_calls": 1.0}
    assert metrics["reward/errors"] == 1.0
