"""The `pyexec` task and environment: write a small Python function; the code runs against asserts in the sandbox;
a failure comes back as execution feedback and the policy may fix its code (MURPHY: Ekbote et al. 2025,
"MURPHY: Multi-Turn GRPO for Self Correcting Code Generation", here as plain multi-turn episodes).

Problems: `FAMILIES` below, most with a parameter k ("returns x multiplied by 7"), 146 problems in all, each
checked by 3-5 asserts computed from its reference solution, asked in two phrasings. Held-out split BY PROBLEM
(family, k): a fixed 30% of the problems (by a hash of their id, whatever the seed), never trained under any
phrasing; evaluation asks them in the first phrasing, capped at `data.eval_size`. A held-out problem's family
can be trained with another k.

Episode (`env.name = "pyexec"`, the task's default): the assistant answers with code; the env runs it against
the row's first `feedback_tests` asserts (default 2; `rollwise.rewards.code.run_tests`, one sandbox run,
recorded as a ToolCall "run_tests" with its `sandbox_s`). They pass: done. The reward scores the final code on ALL
the row's asserts, so the others are hidden tests: expected values copied from the feedback do not pass them. Otherwise, with turns left, a `user` message lists the failures (cut to
`feedback_chars`) and asks for a fix; else done. Per-turn parts: `runs`, `tests_passed`, `tests_total`,
`sandbox_s`. The task's reward is `code_tests` on the final message. A sandbox failure raises (the episode is
marked failed, never scored 0).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import replace
from typing import Any, Callable

from rollwise.config import DataConfig, EnvConfig
from rollwise.data.tasks import EVAL_SEED, first_held_out, text_uid
from rollwise.envs.base import EnvError, StepResult
from rollwise.rewards.code import CODE_LIMITS, CodeOutcome, extract_code, parses, run_tests
from rollwise.types import Prompt, ToolCall

HOLDOUT_FRACTION = 0.3
MAX_TESTS = 5
PHRASINGS = (
    "Write a Python function `{sig}` that {desc}. Reply with the code in a ```python block.",
    "Implement `{sig}` in Python: it {desc}. Give only the code, in a ```python block.",
)
DIGITS = range(2, 10)
NUMS = [[3, 1, 2], [5], [-4, 8, 0, 8], [7, 7, 2, 9, 1]]
WORDS = ["hello", "racecar", "banana split", "a", "python is fun"]

# (name, signature, description with {k}, reference body with {k}, test inputs (argument tuples), k values or None)
Family = tuple[str, str, str, str, list[tuple], Any]
FAMILIES: list[Family] = [
    ("mul", "f(x)", "returns x multiplied by {k}", "return x * {k}", [(0,), (1,), (3,), (-2,), (10,)], DIGITS),
    ("add", "f(x)", "returns x plus {k}", "return x + {k}", [(0,), (5,), (-3,), (12,)], range(1, 10)),
    ("square_plus", "f(x)", "returns the square of x plus {k}", "return x * x + {k}", [(0,), (2,), (-3,), (5,)],
     range(1, 10)),
    ("mod", "f(x)", "returns the remainder of x divided by {k}", "return x % {k}", [(0,), (7,), (23,), (100,)], DIGITS),
    ("minus", "f(x)", "returns {k} minus x", "return {k} - x", [(0,), (4,), (-6,), (20,)], range(1, 10)),
    ("clamp", "f(x)", "returns x limited to the range 0 to {k}: 0 if x is below 0, {k} if x is above {k}",
     "return max(0, min({k}, x))", [(-5,), (3,), (0,), (50,)], range(5, 10)),
    ("divisible", "f(n)", "returns True if n is divisible by {k}, else False", "return n % {k} == 0",
     [(0,), (6,), (7,), (12,), (35,)], DIGITS),
    ("count_letter", "f(s)", "returns how many times the letter '{k}' appears in the string s",
     "return s.count('{k}')", [("banana",),("",), ("a tiny test",), ("oooo",), ("success",)], "aeiost"),
    ("greater", "f(xs)", "returns a list of the numbers in xs that are greater than {k}, in their order",
     "return [x for x in xs if x > {k}]", [([1, 5, 9, 3],), ([],), ([10, 0, 7],), ([4, 4, 8],)], range(0, 10)),
    ("scale", "f(xs)", "returns a new list with every number of xs multiplied by {k}", "return [x * {k} for x in xs]",
     [([1, 2, 3],), ([],), ([-1, 0],)], DIGITS),
    ("last_chars", "f(s)", "returns the last {k} characters of the string s (s has at least {k} characters)",
     "return s[-{k}:]", [("abcdefgh",), ("python",), ("12345",)], range(1, 6)),
    ("count_number", "f(xs)", "returns how many times the number {k} appears in the list xs",
     "return xs.count({k})", [([1, 2, 3, 2],), ([],), ([5, 5, 5],), ([0, 9, 4, 7, 8, 6, 3],)], range(0, 10)),
    ("repeat", "f(s)", "returns the string s repeated {k} times", "return s * {k}", [("ab",), ("",), ("x",)],
     range(2, 6)),
    ("index_of", "f(xs)", "returns the index of the first {k} in the list xs, or -1 if {k} is not in xs",
     "return xs.index({k}) if {k} in xs else -1", [([1, 2, 3, 4, 5, 6, 7, 8, 9, 0],), ([],), ([5, 5, 3],)],
     range(0, 10)),
    ("join", "f(words)", "returns the strings of the list words joined with '{k}' between them",
     "return '{k}'.join(words)", [(["a", "b", "c"],), (["solo"],), ([],)], "-+/,"),
    ("sum", "f(xs)", "returns the sum of the numbers in the list xs", "return sum(xs)", [(x,) for x in NUMS], None),
    ("max", "f(xs)", "returns the largest number in the non-empty list xs", "return max(xs)", [(x,) for x in NUMS], None),
    ("min", "f(xs)", "returns the smallest number in the non-empty list xs", "return min(xs)", [(x,) for x in NUMS], None),
    ("reverse", "f(s)", "returns the string s reversed", "return s[::-1]", [(w,) for w in WORDS], None),
    ("upper", "f(s)", "returns the string s in upper case", "return s.upper()", [(w,) for w in WORDS[:4]], None),
    ("even", "f(n)", "returns True if the integer n is even, else False", "return n % 2 == 0",
     [(0,), (3,), (10,), (-7,)], None),
    ("factorial", "f(n)", "returns the factorial of the non-negative integer n (f(0) is 1)",
     "import math\n    return math.factorial(n)", [(0,), (1,), (5,), (7,)], None),
    ("fibonacci", "f(n)", "returns the n-th Fibonacci number, where f(0) = 0 and f(1) = 1",
     "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", [(0,), (1,), (2,), (10,)], None),
    ("vowels", "f(s)", "returns the number of vowels (a, e, i, o, u) in the lower-case string s",
     "return sum(c in 'aeiou' for c in s)", [(w,) for w in WORDS[:4]], None),
    ("palindrome", "f(s)", "returns True if the string s reads the same forwards and backwards, else False",
     "return s == s[::-1]", [("racecar",), ("ab",), ("",), ("abba",)], None),
    ("larger", "f(a, b)", "returns the larger of the two numbers a and b", "return max(a, b)",
     [(1, 2), (5, -5), (3, 3), (-1, -2)], None),
    ("sort_up", "f(xs)", "returns the numbers of the list xs sorted from smallest to largest", "return sorted(xs)",
     [(x,) for x in NUMS], None),
    ("sort_down", "f(xs)", "returns the numbers of the list xs sorted from largest to smallest",
     "return sorted(xs, reverse=True)", [(x,) for x in NUMS], None),
    ("sum_to", "f(n)", "returns the sum 1 + 2 + ... + n of the non-negative integer n (0 when n is 0)",
     "return n * (n + 1) // 2", [(0,), (1,), (4,), (100,)], None),
    ("length", "f(s)", "returns the number of characters in the string s", "return len(s)", [(w,) for w in WORDS[:4]],
     None),
    ("dedupe", "f(xs)", "returns the list xs without duplicates, keeping the first occurrence of each item in order",
     "return list(dict.fromkeys(xs))", [([1, 2, 1, 3, 2],), ([],), ([4, 4, 4],)], None),
    ("word_count", "f(s)", "returns the number of words in the string s, where words are separated by spaces",
     "return len(s.split())", [("hello world",), ("",), ("one",), ("a b c d",)], None),
    ("digit_sum", "f(n)", "returns the sum of the decimal digits of the non-negative integer n",
     "return sum(int(c) for c in str(n))", [(0,), (7,), (123,), (9999,)], None),
    ("num_digits", "f(n)", "returns the number of decimal digits of the non-negative integer n",
     "return len(str(n))", [(0,), (7,), (123,), (100000,)], None),
    ("absolute", "f(x)", "returns the absolute value of the number x", "return abs(x)", [(0,), (-3,), (8,), (-12,)],
     None),
    ("squares", "f(n)", "returns the list of the squares of 0, 1, ..., n - 1", "return [i * i for i in range(n)]",
     [(0,), (1,), (4,)], None),
    ("product", "f(xs)", "returns the product of the numbers in the list xs (1 for an empty list)",
     "p = 1\n    for x in xs:\n        p *= x\n    return p", [([2, 3, 4],), ([],), ([5],), ([-1, 2],)], None),
    ("capitalize", "f(s)", "returns the string s of lower-case words with the first letter of every word in upper case",
     "return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))", [(w,) for w in WORDS], None),
    ("prime", "f(n)", "returns True if the integer n is a prime number, else False",
     "return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))", [(1,), (2,), (9,), (13,), (0,)], None),
    ("gcd", "f(a, b)", "returns the greatest common divisor of the positive integers a and b",
     "import math\n    return math.gcd(a, b)", [(12, 18), (7, 5), (10, 10), (100, 75)], None),
    ("second_largest", "f(xs)", "returns the second largest distinct number in the list xs (it has at least two)",
     "return sorted(set(xs))[-2]", [([1, 2, 3],), ([5, 5, 4],), ([-1, -2, 10, 10],)], None),
    ("binary", "f(n)", "returns the binary digits of the non-negative integer n as a string, e.g. '101' for 5",
     "return bin(n)[2:]", [(0,), (5,), (8,), (255,)], None),
    ("dict_sum", "f(d)", "returns the sum of the values of the dictionary d", "return sum(d.values())",
     [({"a": 1, "b": 2},), ({},), ({"x": -5},)], None),
    ("all_positive", "f(xs)", "returns True if every number in the list xs is greater than 0, else False",
     "return all(x > 0 for x in xs)", [([1, 2],), ([],), ([3, 0],), ([-1],)], None),
    ("last", "f(xs)", "returns the last element of the non-empty list xs", "return xs[-1]", [(x,) for x in NUMS], None),
    ("no_vowels", "f(s)", "returns the string s with every vowel (a, e, i, o, u) removed",
     "return ''.join(c for c in s if c not in 'aeiou')", [(w,) for w in WORDS[:4]], None),
    ("countdown", "f(n)", "returns the list [n, n - 1, ..., 1] for a non-negative integer n (empty for 0)",
     "return list(range(n, 0, -1))", [(3,), (0,), (1,)], None),
    ("evens", "f(xs)", "returns the even numbers of the list xs, in their order", "return [x for x in xs if x % 2 == 0]",
     [([1, 2, 3, 4],), ([],), ([7, 9],)], None),
]


def reference_code(sig: str, body: str) -> str:
    return f"def {sig}:\n    {body}\n"


def make_tests(sig: str, code: str, inputs: list[tuple]) -> list[str]:
    """`assert f(ARGS) == EXPECTED` for each input, EXPECTED from the reference solution (run here: it is ours)."""
    namespace: dict[str, Any] = {}
    exec(compile(code, f"<reference {sig}>", "exec"), namespace)
    fn: Callable = namespace["f"]
    tests = []
    for args in inputs[:MAX_TESTS]:
        call = f"f({', '.join(repr(a) for a in args)})"
        tests.append(f"assert {call} == {fn(*args)!r}")
    return tests


def build_problems() -> list[dict[str, Any]]:
    """Every problem: id, family, k, signature, description, reference code, tests."""
    problems = []
    for name, sig, desc, body, inputs, ks in FAMILIES:
        for k in (ks if ks is not None else [None]):
            code = reference_code(sig, body.format(k=k))
            problems.append({"id": name if k is None else f"{name}-{k}", "family": name, "k": k, "sig": sig,
                             "desc": desc.format(k=k), "reference": code, "tests": make_tests(sig, code, inputs)})
    return problems


def problem_score(problem_id: str) -> float:
    """A fixed pseudo-random number in [0, 1) per problem (EVAL_SEED only): the held-out split."""
    digest = hashlib.sha1(f"pyexec-{EVAL_SEED}-{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class PyExecTask:
    """Prompt source of `pyexec` (see the module docstring)."""

    name = "pyexec"
    default_reward = "code_tests"
    default_env = "pyexec"
    splits = ("prompt", "fact")  # held out by problem, which implies by prompt text

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        self.seed = seed
        self.problems = build_problems()
        ranked = sorted(self.problems, key=lambda p: problem_score(p["id"]))
        held = ranked[: round(HOLDOUT_FRACTION * len(ranked))]
        self.held_ids = {p["id"] for p in held}
        self.train_pool = [p for p in self.problems if p["id"] not in self.held_ids]
        self._eval = [self.prompt(p, 0, f"pyexec:eval {i}") for i, p in enumerate(held[: cfg.eval_size])]

    def prompt(self, problem: dict[str, Any], phrasing: int, source: str) -> Prompt:
        text = PHRASINGS[phrasing].format(sig=problem["sig"], desc=problem["desc"])
        info = {"problem": problem["id"], "family": problem["family"], "k": problem["k"], "phrasing": phrasing,
                "tests": list(problem["tests"])}
        return Prompt(uid=text_uid(self.name, text), messages=[{"role": "user", "content": text}],
                      answer=problem["reference"], source=source, info=info)

    def train_prompt(self, position: int) -> Prompt:
        if position < 0:
            raise ValueError(f"task 'pyexec': position must be >= 0, got {position}")
        rng = random.Random(f"pyexec-train-{self.seed}-{position}")
        return self.prompt(rng.choice(self.train_pool), rng.randrange(len(PHRASINGS)), f"pyexec:train {position}")

    def is_held_out(self, problem_id: str) -> bool:
        return problem_id in self.held_ids

    @property
    def num_eval(self) -> int:
        return len(self._eval)

    def split_summary(self) -> str:
        return (f"task pyexec ({len(self.problems)} small Python functions checked by asserts) -> {len(self._eval)} "
                f"held-out prompts, split by problem ({len(self.held_ids)} problems never trained in any phrasing)")

    def eval_prompts(self, n: int) -> list[Prompt]:
        return first_held_out(self.name, self._eval, n,
                              f"its {len(self.held_ids)} held-out problems, capped by data.eval_size")


def pyexec_task(cfg: DataConfig, seed: int) -> PyExecTask:
    """Built-in pyexec task (see the module docstring)."""
    return PyExecTask(cfg, seed)


# ------------------------------------------------------------------------------------------------ env

NO_CODE_FEEDBACK = ("I could not find Python code in your answer. Reply with the complete function in a "
                    "```python block.")


def feedback_text(outcome: CodeOutcome, max_chars: int) -> str:
    """The user message after a failed run: what failed, cut to `max_chars`, and the request for a fix."""
    head = (f"Your code raised an error when it was loaded: {outcome.load_error}" if outcome.load_error else
            f"Your code passed {outcome.passed} of {outcome.total} tests. Failed:")
    lines = [head] + ([] if outcome.load_error else [f"- {f}" for f in outcome.failures])
    body = "\n".join(lines)
    if len(body) > max_chars:
        body = body[:max_chars] + " ... [cut]"
    return body + "\nFix the function and reply with the complete corrected code in a ```python block."


class PyExecEnv:
    """Execution feedback over turns (see the module docstring). State: {"prompt", "turn"} (pickles)."""

    stop: tuple[str, ...] = ()  # a turn ends at the end of the message

    def __init__(self, max_turns: int = 2, feedback_chars: int = 800, name: str = "pyexec",
                 feedback_tests: int = 2, **limits: float) -> None:
        """`limits`: overrides of `rollwise.sandbox.Limits` fields (`env.options.cpu_s = 2`, ...).
        `feedback_tests`: the episode runs (and shows the failures of) only the first that many of a row's asserts;
        the reward scores all of them, so copying expected values from the feedback cannot pass the hidden ones
        (0 = every test is visible)."""
        self.name = name
        self.max_turns = int(max_turns)
        self.feedback_chars = int(feedback_chars)
        self.feedback_tests = int(feedback_tests)
        unknown = sorted(set(limits) - set(CODE_LIMITS.__dataclass_fields__))
        if unknown:
            raise EnvError(f"env.options of 'pyexec': unknown {unknown}; it takes feedback_chars, "
                           f"feedback_tests and the sandbox limits {sorted(CODE_LIMITS.__dataclass_fields__)}")
        self.limits = replace(CODE_LIMITS, **limits)

    def reset(self, prompt: Prompt) -> dict[str, Any]:
        if "tests" not in prompt.info:
            raise EnvError(f"prompt {prompt.source or prompt.uid!r} has no info['tests'] (the pyexec env needs them)")
        return {"prompt": prompt, "turn": 0}

    def step(self, state: dict[str, Any], assistant_text: str) -> StepResult:
        prompt, turn = state["prompt"], state["turn"]
        state["turn"] = turn + 1
        last_turn = state["turn"] >= self.max_turns
        code = extract_code(assistant_text)
        if code is None or not parses(code):
            parts = {"runs": 0.0, "tests_passed": 0.0, "tests_total": 0.0, "sandbox_s": 0.0, "no_code": 1.0}
            messages = [] if last_turn else [{"role": "user", "content": NO_CODE_FEEDBACK}]
            return StepResult(messages=messages, done=last_turn, reward_parts=parts)
        start = time.perf_counter()
        outcome = run_tests(code, self.visible(prompt.info["tests"]), self.limits, prompt.source or prompt.uid)
        all_passed = outcome.total > 0 and outcome.passed == outcome.total
        feedback = "all tests passed" if all_passed else feedback_text(outcome, self.feedback_chars)
        call = ToolCall(name="run_tests", args={"code": code}, turn=turn, result=feedback,
                        wall_s=time.perf_counter() - start, sandbox_s=outcome.sandbox_s)
        parts = {"runs": 1.0, "tests_passed": float(outcome.passed), "tests_total": float(outcome.total),
                 "sandbox_s": outcome.sandbox_s, "no_code": 0.0}
        done = all_passed or last_turn
        messages = [] if done else [{"role": "user", "content": feedback}]
        return StepResult(messages=messages, done=done, reward_parts=parts, tool_calls=[call])


    def visible(self, tests: Any) -> Any:
        """The tests the episode runs and reports: the first `feedback_tests` of a list (a script: all)."""
        if self.feedback_tests > 0 and isinstance(tests, list) and len(tests) > self.feedback_tests:
            return tests[:self.feedback_tests]
        return tests


def pyexec_env(cfg: EnvConfig) -> PyExecEnv:
    """Code with execution feedback (the `pyexec` task); `env.options`: feedback_chars and sandbox limits."""
    return PyExecEnv(max_turns=cfg.max_turns, **cfg.options)
