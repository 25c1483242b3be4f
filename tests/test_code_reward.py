"""`code_tests`: code extraction, pass counts from real sandbox runs, failures as 0 with their cause, and a
sandbox failure as an error (never a 0)."""

from __future__ import annotations

import pytest

import rollwise.sandbox as sandbox
from rollwise.rewards import REWARDS, score_sample
from rollwise.rewards.code import extract_code, run_tests, row_items
from rollwise.sandbox import bwrap as bw
from rollwise.types import Prompt, Sample, Status

DOUBLE_TESTS = ["assert f(2) == 4", "assert f(3) == 6", "assert f(0) == 0"]


def sample(text: str, tests=DOUBLE_TESTS, **info) -> Sample:
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "write f"}], answer=None, source="code:0",
                    info={"tests": tests, **info})
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                  status=Status.COMPLETED, group_id=0, response_text=text)


@pytest.mark.parametrize("text, code", [
    ("Here:\n```python\ndef f(x):\n    return 1\n```\nand better:\n```py\ndef f(x):\n    return 2\n```\n",
     "def f(x):\n    return 2\n"),
    ("```\nx = 1\n```", "x = 1\n"),
    ("```python\nx = 1\n```\n```\ny = 2\n```", "x = 1\n"),  # a python block wins over a bare one
    ("def f(x): return x", "def f(x): return x\n"),  # no fence, the whole text parses
    ("```python\ndef f(x):\n    return x", "def f(x):\n    return x\n"),  # cut off before the closing fence
    ("The answer is f(x) = 2x.", None),
    ("```bash\nls\n```", None),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_all_pass_partial_and_none():
    fn = REWARDS.get("code_tests")
    good = sample("```python\ndef f(x):\n    return 2 * x\n```")
    result = fn(good)
    assert (result.value, good.correct) == (1.0, True)
    assert result.parts == {"tests_passed": 3.0, "tests_total": 3.0, "pass_rate": 1.0, "all_passed": 1.0,
                            "format": 1.0, "timed_out": 0.0, "killed": 0.0}
    assert 0.0 < good.info["sandbox_s"] < 5.0
    partial = sample("def f(x):\n    return x + 2\n")  # right only for x = 2
    result = fn(partial)
    assert (result.value, result.parts["tests_passed"], partial.correct) == (pytest.approx(1 / 3), 1.0, False)
    no_code = sample("I do not know.")
    result = fn(no_code)
    assert (result.value, result.parts["format"], result.parts["tests_total"]) == (0.0, 0.0, 3.0)
    assert no_code.info["sandbox_s"] == 0.0


def test_failures_say_what_happened():
    outcome = run_tests("def f(x):\n    return x + 2\n", DOUBLE_TESTS)
    assert outcome.failures == ["`assert f(3) == 6`: got 5, expected 6", "`assert f(0) == 0`: got 2, expected 0"]
    crash = run_tests("def f(x):\n    return 1 // x\n", ["assert f(1) == 1", "assert f(0) == 0"])
    assert crash.passed == 1
    assert crash.failures == ["`assert f(0) == 0`: line 2 of your code: ZeroDivisionError: integer division or "
                              "modulo by zero"]
    broken = run_tests("def f(x):\n    return undefined_name\nf(1)\n", DOUBLE_TESTS)
    assert (broken.passed, broken.load_error) == (0, "line 2 of your code: NameError: name 'undefined_name' is "
                                                     "not defined")


def test_script_tests_with_setup_lines():
    script = "import math\nassert f(2) == 4\nhalf = math.floor(2.5)\nassert f(half) == 5\nassert f(-1) == -2\n"
    assert [i["kind"] for i in row_items(script, "row")] == ["setup", "test", "setup", "test", "test"]
    outcome = run_tests("def f(x):\n    return 2 * x\n", script)
    assert (outcome.passed, outcome.total) == (2, 3)
    assert outcome.failures == ["`assert f(half) == 5`: got 4, expected 5"]


def test_exiting_early_or_printing_a_fake_pass_scores_zero():
    fn = REWARDS.get("code_tests")
    for text in ("import os\nos._exit(0)\n",
                 "print('ROLLWISE-TEST 00 {\"i\": 0, \"ok\": true}')\nraise SystemExit(0)\n"):
        result = fn(sample(text))
        assert result.value == 0.0 and result.parts["tests_passed"] == 0.0, text


def test_a_time_out_is_a_zero_with_its_cause():
    fn = REWARDS.get("code_tests")
    looping = sample("def f(x):\n    while True:\n        pass\n", limits={"cpu_s": 1, "wall_s": 3})
    result = fn(looping)
    assert (result.value, result.parts["timed_out"], result.parts["killed"]) == (0.0, 1.0, 1.0)
    assert looping.info["sandbox_killed_by"] == "cpu"
    outcome = run_tests("def f(x):\n    while True:\n        pass\n", DOUBLE_TESTS,
                        sandbox.Limits(cpu_s=1, wall_s=3))
    assert outcome.failures == ["`assert f(2) == 4`: not run, the program used up its CPU time limit "
                                "(and 2 more tests not run)"]


def test_bad_rows_are_errors_not_zeros():
    fn = REWARDS.get("code_tests")
    no_tests = sample("def f(x): return x")
    del no_tests.prompt.info["tests"]
    with pytest.raises(ValueError, match="has no info\\['tests'\\]"):
        fn(no_tests)
    with pytest.raises(ValueError, match="at least one top-level assert"):
        fn(sample("def f(x): return x", tests="x = 1\n"))
    with pytest.raises(ValueError, match="unknown fields \\['cpu'\\]"):
        fn(sample("def f(x): return x", limits={"cpu": 1}))


def test_a_sandbox_failure_is_a_reward_error_not_a_zero(monkeypatch):
    monkeypatch.setattr(bw, "bwrap_path", lambda: "/bin/false")  # an install that cannot start
    monkeypatch.setattr(bw, "_PROBED", {})
    monkeypatch.setenv("ROLLWISE_SANDBOX", "bwrap")
    broken = sample("def f(x):\n    return 2 * x\n")
    assert not score_sample(broken, REWARDS.get("code_tests"))
    assert broken.status == Status.FAILED and broken.reward is None
    assert "bubblewrap cannot start here" in broken.reward_error
