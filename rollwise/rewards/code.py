"""`code_tests`: run the response's code against the row's tests in the sandbox (`rollwise.sandbox`).

Row format (`Prompt.info`, e.g. the extra fields of a JSONL row):
- `tests`: a list of test snippets, each usually one assert (`"assert f(2) == 4"`), each counted as one test;
  or one test script (a string), where every top-level `assert` is a test and every other top-level statement
  (imports, helpers) is setup run in order before the asserts that follow it.
- `limits` (optional): overrides of `rollwise.sandbox.Limits` fields, e.g. `{"cpu_s": 2, "wall_s": 4}`.

The code is the response's last fenced ```python (or ```py) block; else its last bare ``` block; else the whole
response when it parses as Python (`extract_code`). It is saved as `solution.py`; a harness runs it, then each
test in its namespace, all in ONE sandbox run, and prints one line per test tagged with a random nonce passed on
stdin, so the code cannot end early and claim a pass by printing (it could still forge the line by inspecting
the harness's frames from inside the same interpreter: the tests are a reward, not a security boundary).

Value: the PASS RATE `tests_passed / tests_total` (partial credit: a denser signal for a weak policy);
`sample.correct` and part `all_passed` are 1 only when every test passed. Parts: `tests_passed`,
`tests_total`, `pass_rate`, `all_passed`, `format` (1 when code was found and parses), `timed_out` (the wall
clock or CPU limit stopped it), `killed` (any sandbox limit stopped it; the cause is `sample.info
["sandbox_killed_by"]`). `sample.info["sandbox_s"]` is the time in the sandbox. A failure of the sandbox itself
(`SandboxError`) propagates: the sample is an error, never a 0.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from rollwise.rewards.verifiers import REWARDS
from rollwise.sandbox import Limits, SandboxResult, run
from rollwise.types import Prompt, RewardResult, Sample

CODE_LIMITS = Limits(cpu_s=4, wall_s=8, memory_mb=512, max_processes=16, max_output_bytes=64 * 1024)
MARK = "ROLLWISE-TEST"
MAX_REPR_CHARS = 200
FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PYTHON_TAGS = ("python", "py", "python3")

HARNESS = r'''
import ast, json, os, sys, traceback
NONCE = sys.stdin.readline().strip()
OUT = os.fdopen(os.dup(1), "w")
MAX = %(max_repr)d

def report(record):
    OUT.write("\n%(mark)s " + NONCE + " " + json.dumps(record) + "\n")
    OUT.flush()

def short(value):
    text = repr(value)
    return text if len(text) <= MAX else text[:MAX] + "..."

def where(exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "solution.py"]
    line = "line %%d of your code: " %% frames[-1].lineno if frames else ""
    return line + "".join(traceback.format_exception_only(type(exc), exc)).strip()[:MAX * 2]

def explain(src, ns):
    """For `assert A == B` (and other single comparisons): what A was."""
    try:
        node = ast.parse(src).body[0]
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1:
            got = eval(compile(ast.Expression(node.test.left), "<test>", "eval"), ns)
            want = eval(compile(ast.Expression(node.test.comparators[0]), "<test>", "eval"), ns)
            return "got %%s, expected %%s" %% (short(got), short(want))
    except BaseException:
        pass
    return "assertion failed"

items = json.load(open("tests.json"))
ns = {"__name__": "__main__"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as exc:
    report({"load_error": where(exc)})
    sys.exit(0)
setup_error = None
for i, item in enumerate(items):
    if setup_error is not None:
        if item["kind"] == "test":
            report({"i": i, "ok": False, "error": "setup failed: " + setup_error})
        continue
    try:
        exec(compile(item["src"], "<test %%d>" %% i, "exec"), ns)
        if item["kind"] == "test":
            report({"i": i, "ok": True})
    except AssertionError as exc:
        report({"i": i, "ok": False, "error": str(exc) or explain(item["src"], ns)})
    except BaseException as exc:
        if item["kind"] == "setup":
            setup_error = where(exc)
        else:
            report({"i": i, "ok": False, "error": where(exc)})
report({"done": True})
''' % {"mark": MARK, "max_repr": MAX_REPR_CHARS}


def extract_code(text: str) -> str | None:
    """The last ```python block, else the last bare ``` block, else the whole text if it parses; None if none."""
    blocks = FENCE_RE.findall(text)
    for wanted in (PYTHON_TAGS, ("",)):
        chosen = [body for tag, body in blocks if tag.lower() in wanted]
        if chosen:
            return chosen[-1].strip("\n") + "\n"
    if blocks:
        return None  # only blocks of another language
    stripped = text.strip()
    if stripped and parses(stripped):
        return stripped + "\n"
    return None


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def row_items(tests: Any, where: str) -> list[dict[str, str]]:
    """The row's tests as harness items `{"kind": "test" | "setup", "src"}`; ValueError naming the row."""
    if isinstance(tests, list) and tests and all(isinstance(t, str) and t.strip() for t in tests):
        return [{"kind": "test", "src": t} for t in tests]
    if isinstance(tests, str) and tests.strip():
        try:
            tree = ast.parse(tests)
        except SyntaxError as exc:
            raise ValueError(f"{where}: info['tests'] does not parse as Python: {exc}") from None
        items = [{"kind": "test" if isinstance(node, ast.Assert) else "setup",
                  "src": ast.get_source_segment(tests, node)} for node in tree.body]
        if any(item["kind"] == "test" for item in items):
            return items
    raise ValueError(f"{where}: info['tests'] must be a non-empty list of assert snippets or a script with at least "
                     f"one top-level assert, got {type(tests).__name__}")


@dataclass
class CodeOutcome:
    """One sandbox run of code + tests. `failures`: one line per failed test, for feedback."""

    passed: int
    total: int
    failures: list[str] = field(default_factory=list)
    load_error: str | None = None
    sandbox: SandboxResult | None = None

    @property
    def sandbox_s(self) -> float:
        return self.sandbox.wall_s if self.sandbox is not None else 0.0

    @property
    def killed_by(self) -> str | None:
        return self.sandbox.killed_by if self.sandbox is not None else None


def run_tests(code: str, tests: Any, limits: Limits = CODE_LIMITS, where: str = "prompt") -> CodeOutcome:
    """Run `code` and the tests (see the module docstring) in one sandbox run. SandboxError propagates."""
    items = row_items(tests, where)
    nonce = secrets.token_hex(16)
    result = run(HARNESS, files={"solution.py": code, "tests.json": json.dumps(items)}, stdin=nonce + "\n",
                 limits=limits)
    records = [json.loads(line.split(" ", 2)[2]) for line in result.stdout.splitlines()
               if line.startswith(f"{MARK} {nonce} ")]
    tests_src = {i: item["src"] for i, item in enumerate(items) if item["kind"] == "test"}
    outcome = CodeOutcome(passed=0, total=len(tests_src), sandbox=result)
    reported = set()
    for record in records:
        if "load_error" in record:
            outcome.load_error = record["load_error"]
        elif "i" in record and record["i"] in tests_src and record["i"] not in reported:
            reported.add(record["i"])
            if record["ok"]:
                outcome.passed += 1
            else:
                outcome.failures.append(f"`{tests_src[record['i']]}`: {record['error']}")
    unreported = [i for i in tests_src if i not in reported]
    if unreported and outcome.load_error is None:
        cause = stop_reason(result)
        more = f" (and {len(unreported) - 1} more tests not run)" if len(unreported) > 1 else ""
        outcome.failures.append(f"`{tests_src[unreported[0]]}`: not run, {cause}{more}")
    return outcome


def stop_reason(result: SandboxResult) -> str:
    """Why the tests did not all report, in words for the policy."""
    causes = {"timeout": f"the program ran past the {result.wall_s:.0f} s time limit",
              "cpu": "the program used up its CPU time limit", "memory": "the program ran out of memory",
              "output_limit": "the program printed too much output", "processes": "too many processes"}
    if result.killed_by in causes:
        return causes[result.killed_by]
    last = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
    return f"the program stopped early: {last[0][:MAX_REPR_CHARS]}"


def row_limits(prompt: Prompt) -> Limits:
    """CODE_LIMITS with the row's `info['limits']` overrides; ValueError naming an unknown field."""
    overrides = prompt.info.get("limits") or {}
    known = set(Limits.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{prompt.source or prompt.uid}: info['limits'] has unknown fields {unknown}; "
                         f"known: {sorted(known)}")
    return replace(CODE_LIMITS, **overrides)


def outcome_parts(outcome: CodeOutcome, found: bool) -> dict[str, float]:
    killed = outcome.killed_by
    return {
        "tests_passed": float(outcome.passed), "tests_total": float(outcome.total),
        "pass_rate": outcome.passed / outcome.total if outcome.total else 0.0,
        "all_passed": 1.0 if outcome.total and outcome.passed == outcome.total else 0.0,
        "format": 1.0 if found else 0.0,
        "timed_out": 1.0 if killed in ("timeout", "cpu") else 0.0,
        "killed": 1.0 if killed is not None else 0.0,
    }


@REWARDS.register("code_tests")
def code_tests_reward(sample: Sample) -> RewardResult:
    """Pass rate of the response's code on the row's tests (see the module docstring)."""
    prompt = sample.prompt
    where = prompt.source or prompt.uid
    if "tests" not in prompt.info:
        raise ValueError(f"prompt {where!r} has no info['tests'] (the code_tests reward needs them)")
    items = row_items(prompt.info["tests"], where)
    code = extract_code(sample.response_text)
    found = code is not None and parses(code)
    if not found:
        outcome = CodeOutcome(passed=0, total=sum(i["kind"] == "test" for i in items))
    else:
        outcome = run_tests(code, prompt.info["tests"], row_limits(prompt), where)
    sample.info["sandbox_s"] = outcome.sandbox_s
    sample.info["sandbox_killed_by"] = outcome.killed_by
    parts = outcome_parts(outcome, found)
    sample.correct = parts["all_passed"] == 1.0
    return RewardResult(value=parts["pass_rate"], parts=parts)
