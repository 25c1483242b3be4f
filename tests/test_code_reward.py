"""`code_tests`: code extraction, pass counts from real sandbox runs, failures as 0 with their cause, and a
sandbox failure as an error (never a 0)."""

from __future__ import annotations

import pytest

import rollwise.sandbox as sandbox
from rollwise.rewards import REWARDS, IsolatedReward, score_sample, score_samples
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


@pytest.fixture(scope="module")
def isolated_code_tests():
    fn = IsolatedReward("code_tests", timeout_s=30.0)
    yield fn
    fn.close()


@pytest.mark.parametrize("where", ["in_process", "isolated"])
def test_correct_only_when_every_test_passes_through_scoring(where, request):
    """A program passing 1 of 3 tests scores 1/3 and is NOT correct (it was: apply_result used reward > 0)."""
    fn = REWARDS.get("code_tests") if where == "in_process" else request.getfixturevalue("isolated_code_tests")
    good = sample("```python\ndef f(x):\n    return 2 * x\n```")
    partial = sample("def f(x):\n    return x + 2\n")  # right only for x = 2
    no_code = sample("I do not know.")
    metrics = score_samples([good, partial, no_code], fn, timeout_s=30.0)
    assert [s.reward for s in (good, partial, no_code)] == [1.0, pytest.approx(1 / 3), 0.0]
    assert [s.correct for s in (good, partial, no_code)] == [True, False, False]
    assert metrics["reward/accuracy"] == pytest.approx(1 / 3)  # 2/3 before: the partial program counted
    assert metrics["reward/mean"] == pytest.approx(4 / 9)
    assert good.reward_parts == {"tests_passed": 3.0, "tests_total": 3.0, "pass_rate": 1.0, "all_passed": 1.0,
                                 "format": 1.0, "timed_out": 0.0, "killed": 0.0}
    assert partial.reward_parts["tests_passed"] == 1.0 and partial.reward_parts["all_passed"] == 0.0
    # the reward's extras reach the sample through the result, in a worker process too
    assert 0.0 < good.info["sandbox_s"] < 5.0 and good.info["sandbox_killed_by"] is None
    assert no_code.info["sandbox_s"] == 0.0 and no_code.reward_parts["format"] == 0.0


def test_the_reward_leaves_the_sample_alone():
    good = sample("def f(x):\n    return 2 * x\n")
    result = REWARDS.get("code_tests")(good)
    assert (result.value, result.correct) == (1.0, True) and result.info["sandbox_killed_by"] is None
    assert good.correct is None and good.info == {}  # scoring applies the result; the reward writes nothing


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
    assert score_sample(looping, fn)
    assert (looping.reward, looping.correct) == (0.0, False)
    assert (looping.reward_parts["timed_out"], looping.reward_parts["killed"]) == (1.0, 1.0)
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
    with pytest.raises(ValueError, match=r"code:0: info\['tests'\]\[1\] does not parse as Python"):
        fn(sample("def f(x): return x", tests=["assert f(1) == 1", "assert f(2) =="]))
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


# ------------------------------------------------------------------ honest code under the two-process harness

NOT_PLAIN = "is not plain data (None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict, range)"
STACK = ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
         "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
         "    def __len__(self):\n        return len(self.items)\n")


@pytest.mark.parametrize("code, tests, failures", [
    ("def f(x):\n    return x > 1\n",  # truthiness, identity, isinstance on the copied value
     ["assert f(2)", "assert not f(0)", "assert f(2) is True", "assert isinstance(f(2), bool)"], []),
    ("def f(x):\n    return x * 3\n",  # arithmetic, generator expressions (global lookups), membership
     ["assert abs(f(0.1) - 0.3) < 1e-9", "assert all(f(x) == 3 * x for x in range(5))",
      "assert sorted([f(2), f(1)]) == [3, 6]", "assert f(2) != 5", "assert f(1) in (3, 4)"], []),
    ("from collections import Counter, namedtuple\nP = namedtuple('P', 'a b')\ndef f(s):\n    return Counter(s)\n"
     "def g():\n    return P(1, 2)\ndef h():\n    return {1: [1.5, None, (True, b'x')], 'k': {3, 4}, 'c': 1j}\n",
     ["assert f('aab') == {'a': 2, 'b': 1}", "assert g() == (1, 2) and g().b == 2",
      "assert h() == {1: [1.5, None, (True, b'x')], 'k': {3, 4}, 'c': 1j}"], []),
    (STACK,  # the code's own objects: methods, len and attributes work; comparing one cannot be checked
     "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert len(s) == 1 and s.items == [1]\nassert s == s\n",
     [f"`assert s == s`: the solution's value of type Stack {NOT_PLAIN}, so the test cannot compare or hash it"]),
    ("def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",  # the code's builtin exceptions
     "try:\n    f(-1)\n    raised = False\nexcept ValueError:\n    raised = True\nassert raised\n"
     "assert f(3) == 3\n", []),
    ("print('loading')\nimport math\ndef f(g, x):\n    print('debug', x)\n    return g(x)\n",
     ["assert f(abs, -2) == 2", "assert math.floor(f(math.sqrt, 10)) == 3", "assert f(lambda x: x + 1, 2) == 3"],
     ["`assert f(lambda x: x + 1, 2) == 3`: the test passes a function to the solution; only plain data (None, "
      "bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict, range) or the solution's own "
      "values can be passed"]),
    ("def f(n):\n    return (i for i in range(n))\n", ["assert list(f(3)) == [0, 1, 2]", "assert f(3) == [0, 1, 2]"],
     [f"`assert f(3) == [0, 1, 2]`: the solution's value of type generator {NOT_PLAIN}, so the test cannot compare "
      "or hash it"]),
])
def test_honest_code_and_asserts_that_are_not_plain_equality(code, tests, failures):
    outcome = run_tests(code, tests)
    total = sum(item["kind"] == "test" for item in row_items(tests, "row"))
    assert (outcome.load_error, outcome.total, outcome.passed) == (None, total, total - len(failures))
    assert outcome.failures == failures


def test_failure_messages_of_other_comparisons():
    outcome = run_tests("def f(x):\n    return x\n", ["assert f(5) < 3", "assert f(1) == 2, 'one is not two'"])
    assert outcome.failures == ["`assert f(5) < 3`: 5 < 3 is false",
                                "`assert f(1) == 2, 'one is not two'`: one is not two"]


def test_the_harness_runs_from_source_when_it_cannot_be_precompiled(monkeypatch):
    import rollwise.rewards.code as code_reward

    monkeypatch.setattr(code_reward, "compiled_harness", lambda harness, wire: None)
    main, files = code_reward.harness_program()
    assert main == code_reward.harness_source() and set(files) == {"code_wire.py"}
    outcome = run_tests("def f(x):\n    return x + 2\n", DOUBLE_TESTS)
    assert (outcome.passed, outcome.failures[0]) == (1, "`assert f(3) == 6`: got 5, expected 6")
