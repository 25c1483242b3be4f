"""`code_tests`: run the response's code against the row's tests in the sandbox (`rollwise.sandbox`).

Row format (`Prompt.info`, e.g. the extra fields of a JSONL row):
- `tests`: a list of test snippets, each usually one assert (`"assert f(2) == 4"`), each counted as one test;
  or one test script (a string), where every top-level `assert` is a test and every other top-level statement
  (imports, helpers) is setup run in order before the asserts that follow it.
- `limits` (optional): overrides of `rollwise.sandbox.Limits` fields, e.g. `{"cpu_s": 2, "wall_s": 4}`.

The code is the response's last fenced ```python (or ```py) block; else its last bare ``` block; else the whole
response when it parses as Python (`extract_code`). ONE sandbox run per scoring: the harness
(`rollwise.rewards.code_harness`) forks a process that runs the code as `solution.py` and answers requests
(call `f(2)`, read a global); the harness's own process runs every test with the code's values copied back
as fresh builtin objects (None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict,
range), so `==` in a test compares genuine values: an object whose `__eq__` always says True, or a `str`
subclass that lies, is never what the test compares. A value that is not plain data (an instance of the
code's own class) can be called, indexed, iterated and asked for attributes, but not compared: the test fails
and says so. The tests and the key that signs the harness's result lines (HMAC-SHA256; forged lines are
dropped) never reach the code's process: they arrive on stdin after it is forked and are erased, and the
harness makes itself non-dumpable (docs/sandbox.md).

Value: the PASS RATE `tests_passed / tests_total` (partial credit: a denser signal for a weak policy);
`RewardResult.correct` (hence `sample.correct`) and part `all_passed` are True / 1 only when every test passed.
Parts: `tests_passed`, `tests_total`, `pass_rate`, `all_passed`, `format` (1 when code was found and parses),
`timed_out` (the wall clock or CPU limit stopped it), `killed` (any sandbox limit stopped it). Info (merged
into `sample.info` by scoring): `sandbox_s` (time in the sandbox) and `sandbox_killed_by` (the cause). A
failure of the sandbox itself (`SandboxError`) propagates: the sample is an error, never a 0.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
import secrets
import subprocess
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollwise.rewards.verifiers import REWARDS
from rollwise.sandbox import SYSTEM_PYTHON, Limits, SandboxError, SandboxResult, run
from rollwise.types import Prompt, RewardResult, Sample

CODE_LIMITS = Limits(cpu_s=4, wall_s=8, memory_mb=512, max_processes=16, max_output_bytes=64 * 1024)
MARK = "ROLLWISE-TEST"  # rollwise.rewards.code_harness.MARK
MAX_REPR_CHARS = 200
FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PYTHON_TAGS = ("python", "py", "python3")


@lru_cache(maxsize=1)
def harness_source() -> str:
    """The source of the program the sandbox runs (`rollwise.rewards.code_harness`; read, never imported)."""
    return (Path(__file__).with_name("code_harness.py")).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def wire_source() -> str:
    """The source of the module the harness imports in the sandbox (`rollwise.rewards.code_wire`)."""
    return (Path(__file__).with_name("code_wire.py")).read_text(encoding="utf-8")


# Run by the sandbox's interpreter on the host, once per process: both modules as marshalled code objects.
COMPILE = """
import json, marshal, sys
wire, harness = json.loads(sys.stdin.buffer.read())
sys.stdout.buffer.write(marshal.dumps((compile(wire, "code_wire.py", "exec"), compile(harness, "main.py", "exec"))))
"""
# `main.py` in the sandbox when the harness is precompiled: load both code objects and run the harness.
LOADER = """import marshal, os, sys, types
with open("harness.bin", "rb") as handle:
    wire_code, main_code = marshal.loads(handle.read())
wire = types.ModuleType("code_wire")
exec(wire_code, wire.__dict__)
sys.modules["code_wire"] = wire
exec(main_code, {"__name__": "__main__", "__file__": os.path.abspath("main.py"), "__builtins__": __builtins__})
"""


@lru_cache(maxsize=4)
def compiled_harness(harness: str, wire: str) -> bytes | None:
    """The harness and its wire module compiled by the sandbox's interpreter (`marshal`, valid for that
    interpreter only), so a scoring does not compile about 700 lines (about 5 ms); None when that fails."""
    try:
        done = subprocess.run([SYSTEM_PYTHON, "-E", "-s", "-c", COMPILE], input=json.dumps([wire, harness]).encode(),
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout else None


def harness_program() -> tuple[str, dict[str, str | bytes]]:
    """(`main.py`, files beside it) for one sandbox run: the precompiled harness, else its source."""
    harness, wire = harness_source(), wire_source()
    compiled = compiled_harness(harness, wire)
    if compiled is None:
        return harness, {"code_wire.py": wire}
    return LOADER, {"harness.bin": compiled}


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
        for i, test in enumerate(tests):
            try:
                ast.parse(test)
            except SyntaxError as exc:
                raise ValueError(f"{where}: info['tests'][{i}] does not parse as Python: {exc}") from None
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
    key = secrets.token_bytes(32)
    main, files = harness_program()
    result = run(main, files={"solution.py": code, **files}, stdin=key.hex() + "\n" + json.dumps(items),
                 limits=limits)
    records = signed_records(result.stdout, key)
    broken = [r["harness_error"] for r in records if "harness_error" in r]
    if broken:
        raise SandboxError(f"the code_tests harness cannot keep its key from the code under test: {broken[0]}")
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


def signed_records(stdout: str, key: bytes) -> list[dict]:
    """The harness's records in `stdout`: lines `MARK HMAC JSON` whose HMAC-SHA256 under `key` checks."""
    records = []
    for line in stdout.splitlines():
        fields = line.split(" ", 2)
        if len(fields) != 3 or fields[0] != MARK:
            continue
        expected = hmac.new(key, fields[2].encode("utf-8"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(fields[1].encode("utf-8"), expected.encode("ascii")):
            continue
        record = json.loads(fields[2])
        if isinstance(record, dict):
            records.append(record)
    return records


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
    parts = outcome_parts(outcome, found)
    return RewardResult(value=parts["pass_rate"], parts=parts, correct=parts["all_passed"] == 1.0,
                        info={"sandbox_s": outcome.sandbox_s, "sandbox_killed_by": outcome.killed_by})
