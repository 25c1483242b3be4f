"""Attacks on the `code_tests` reward: code that tries to pass hidden tests without computing the answers.

Each program is scored through `score_batch` (the path a training run takes) on tests it cannot pass honestly
(`f` doubles its argument; the attacks return something else). It must score only what it genuinely passes,
never a forged pass, and never count as correct. Most of these passed every test under the old one-process
harness (tests run in the solution's interpreter, a nonce on stdin, results printed to stdout).
"""

from __future__ import annotations

import textwrap

import pytest

from rollwise.rewards import REWARDS, score_batch
from rollwise.types import Prompt, Sample, Status

TESTS = ["assert f(2) == 4", "assert f(3) == 6", "assert f(0) == 0"]

# What a stolen secret lets code forge: lines in the old format (`MARK NONCE JSON`) and in the new one
# (`MARK HMAC JSON`), written everywhere output can go: every inherited descriptor, and the stdout of every
# process of the sandbox that /proc lets it open.
FORGE = """
import hashlib as _hashlib, hmac as _hmac, json as _json, os as _os

def forge_everywhere(secrets, fds=range(1, 64)):
    lines = []
    for secret in secrets:
        for i in range(3):
            payload = _json.dumps({"i": i, "ok": True})
            lines.append("\\nROLLWISE-TEST %s %s\\n" % (secret, payload))
            try:
                mac = _hmac.new(bytes.fromhex(secret), payload.encode(), _hashlib.sha256).hexdigest()
                lines.append("\\nROLLWISE-TEST %s %s\\n" % (mac, payload))
            except ValueError:
                pass
    data = "".join(lines).encode()
    targets = list(fds)
    for pid in _os.listdir("/proc"):
        if pid.isdigit():
            try:
                targets.append(_os.open("/proc/%s/fd/1" % pid, _os.O_WRONLY))
            except OSError:
                pass
    for fd in targets:
        try:
            _os.write(fd, data)
        except OSError:
            pass
"""

ATTACKS = {
    "always_equal_object": """
        class Same:
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = object.__hash__
        def f(x):
            return Same()
    """,
    "str_subclass_that_lies": """
        class Liar(str):
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = str.__hash__
            def __repr__(self):
                return "4"
        def f(x):
            return Liar("wrong")
    """,
    "int_subclass_that_lies": """
        class Liar(int):
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = int.__hash__
            def __repr__(self):
                return "4"
        def f(x):
            return Liar(-1)
    """,
    "raises_system_exit_in_eq": """
        class Bomb:
            def __eq__(self, other):
                raise SystemExit(0)
            __hash__ = object.__hash__
        def f(x):
            return Bomb()
    """,
    "import_main_and_call_report": """
        import __main__, os
        for i in range(3):
            __main__.report({"i": i, "ok": True})
        __main__.report({"done": True})
        os._exit(0)
    """,
    "sys_modules_main_and_frame_walk": """
        import sys
        def f(x):
            return -1
        secrets = set()
        frame = sys._getframe()
        while frame is not None:
            for space in (frame.f_locals, frame.f_globals):
                for name in ("NONCE", "nonce", "key", "KEY"):
                    if isinstance(space.get(name), (str, bytes)):
                        value = space[name]
                        secrets.add(value if isinstance(value, str) else value.hex())
                report = space.get("report")
                if callable(report):
                    for i in range(3):
                        try:
                            report({"i": i, "ok": True})
                        except Exception:
                            pass
            frame = frame.f_back
        main = sys.modules["__main__"]
        for name in ("NONCE", "key"):
            if isinstance(getattr(main, name, None), str):
                secrets.add(getattr(main, name))
        forge_everywhere(secrets)
    """,
    "gc_and_inspect_stack": """
        import gc, inspect, re
        def f(x):
            return -1
        secrets = set()
        for obj in gc.get_objects():
            for text in ([obj] if isinstance(obj, str) else [v for v in obj.values() if isinstance(v, str)]
                         if isinstance(obj, dict) else []):
                if re.fullmatch(r"[0-9a-f]{32}|[0-9a-f]{64}", text):
                    secrets.add(text)
        for info in inspect.stack():
            report = info.frame.f_globals.get("report")
            if callable(report):
                for i in range(3):
                    report({"i": i, "ok": True})
        forge_everywhere(secrets)
    """,
    "memory_and_stdin_of_every_process": """
        import os, re
        def f(x):
            return -1
        secrets = set()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == str(os.getpid()):
                continue
            for path in ("/proc/%s/fd/0" % pid, "/proc/%s/environ" % pid, "/proc/%s/cmdline" % pid):
                try:
                    with open(path, "rb") as handle:
                        secrets.update(m.decode() for m in re.findall(rb"[0-9a-f]{64}", handle.read()))
                except OSError:
                    pass
            try:
                regions = [line.split()[0] for line in open("/proc/%s/maps" % pid) if " rw" in line]
                with open("/proc/%s/mem" % pid, "rb", 0) as mem:
                    for region in regions:
                        start, end = (int(x, 16) for x in region.split("-"))
                        if end - start > 64 << 20:
                            continue
                        try:
                            mem.seek(start)
                            chunk = mem.read(end - start)
                        except (OSError, ValueError, OverflowError):
                            continue
                        secrets.update(m.decode() for m in re.findall(rb"[0-9a-f]{64}|[0-9a-f]{32}", chunk))
            except OSError:
                pass
        forge_everywhere(secrets)
    """,
    "reads_the_hidden_tests": """
        import ast, json, os
        sources = []
        for path in ["tests.json"] + ["/proc/%s/fd/0" % p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                with open(path, "rb") as handle:
                    text = handle.read().decode("utf-8", "replace")
                sources.append(json.loads(text[text.index("["):]))
            except (OSError, ValueError):
                pass
        answers = {}
        for items in sources:
            for item in items:
                test = ast.parse(item["src"]).body[0].test
                answers[ast.literal_eval(test.left.args[0])] = ast.literal_eval(test.comparators[0])
        def f(x):
            return answers.get(x, -1)
    """,
    "patches_json_dumps": """
        import json
        _dumps = json.dumps
        def dumps(obj, *args, **kwargs):
            if type(obj) is dict and "i" in obj:
                obj = {"i": obj["i"], "ok": True}
            return _dumps(obj, *args, **kwargs)
        json.dumps = dumps
        def f(x):
            return -1
    """,
    "patches_builtins_exec": """
        import builtins
        builtins.exec = lambda *args, **kwargs: None
        def f(x):
            return -1
    """,
    "patches_builtins_isinstance_and_type": """
        import builtins
        builtins.isinstance = lambda *args: True
        builtins.type = lambda *args: int
        def f(x):
            return -1
    """,
    "prints_forged_lines_and_exits_early": """
        import os, sys
        line = '\\nROLLWISE-TEST 00 {"i": 0, "ok": true}\\n'
        print(line)
        os.write(1, line.encode())
        os.write(2, line.encode())
        sys.stdout.flush()
        os._exit(0)
    """,
}


# Runs inside whatever process imports it: in the judge it would find the judge and sign passes with its key.
IN_THE_JUDGE = """
import gc, os
for obj in gc.get_objects():
    report = getattr(obj, "report", None)
    if callable(report) and hasattr(obj, "key"):
        for i in range(8):
            report({"i": i, "ok": True})
        report({"done": True})
        os._exit(0)
"""
# a test script that imports the standard library and the solution as a module (both ran solution code in the
# judge before the judge kept its imports to the standard library)
SCRIPT_TESTS = "import statistics\nfrom solution import f\nassert f(2) == 4\nassert f(3) == 6\nassert f(0) == 0\n"
MODULE_ATTACKS = {
    "shadows_the_stdlib_modules_a_test_imports": f"""
        for name in ("statistics", "base64", "fractions", "decimal", "random", "string"):
            with open(name + ".py", "w") as handle:
                handle.write({IN_THE_JUDGE!r})
        def f(x):
            return -1
    """,
    "runs_when_a_test_imports_the_solution": "def f(x):\n    return -1\n" + IN_THE_JUDGE,
}


def scored(code: str, tests=TESTS) -> Sample:
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "write f"}], answer=None, source="attack:0",
                    info={"tests": tests, "limits": {"cpu_s": 4, "wall_s": 10}})
    sample = Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                    status=Status.COMPLETED, group_id=0, response_text=f"```python\n{code}```")
    score_batch([sample], REWARDS.get("code_tests"), timeout_s=30.0)
    return sample


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_passes_no_test(name):
    code = FORGE + textwrap.dedent(ATTACKS[name])
    sample = scored(code)
    assert sample.status == Status.COMPLETED, sample.reward_error
    assert sample.reward_parts["tests_passed"] == 0.0, name
    assert (sample.reward, sample.correct) == (0.0, False)


@pytest.mark.parametrize("name", sorted(MODULE_ATTACKS))
def test_no_code_of_the_solution_runs_where_the_tests_run(name):
    sample = scored(textwrap.dedent(MODULE_ATTACKS[name]), SCRIPT_TESTS)
    assert sample.status == Status.COMPLETED, sample.reward_error
    assert (sample.reward_parts["tests_passed"], sample.correct) == (0.0, False)
    honest = scored("def f(x):\n    return 2 * x\n", SCRIPT_TESTS)
    assert (honest.reward_parts["tests_passed"], honest.correct) == (3.0, True)


def test_an_attack_keeps_only_what_it_genuinely_passes():
    """Right for f(2) only, and trying every trick for the rest (forging on stdout and stderr only: scribbling
    on every descriptor would break its own pipe to the harness): exactly one test passes."""
    tricks = "\n".join(textwrap.dedent(ATTACKS[name]) for name in ("sys_modules_main_and_frame_walk",
                                                                   "memory_and_stdin_of_every_process"))
    tricks = tricks.replace("forge_everywhere(secrets)", "forge_everywhere(secrets, fds=(1, 2))")
    code = FORGE + tricks + "\ndef f(x):\n    return 4 if x == 2 else -1\n"
    sample = scored(code)
    assert sample.reward_parts["tests_passed"] == 1.0
    assert (sample.reward, sample.correct) == (pytest.approx(1 / 3), False)


def test_honest_code_with_the_same_tests_passes():
    sample = scored("def f(x):\n    return 2 * x\n")
    assert (sample.reward, sample.correct, sample.reward_parts["tests_passed"]) == (1.0, True, 3.0)


@pytest.mark.parametrize("name", ["memory_and_stdin_of_every_process", "reads_the_hidden_tests",
                                  "gc_and_inspect_stack"])
def test_the_secret_stealing_attacks_fail_in_the_fallback_too(name, monkeypatch, recwarn):
    """Under the rlimits fallback (as root: a pool uid, the host's /proc visible) the harness holds as well."""
    monkeypatch.setenv("ROLLWISE_SANDBOX", "rlimits")
    sample = scored(FORGE + textwrap.dedent(ATTACKS[name]))
    assert sample.status == Status.COMPLETED, sample.reward_error
    assert (sample.reward_parts["tests_passed"], sample.correct) == (0.0, False)


def test_a_harness_that_cannot_protect_its_key_is_an_error_not_a_score(monkeypatch):
    import rollwise.rewards.code as code_reward

    source = code_reward.harness_source()
    weak = source.replace("def make_undumpable():", "def make_undumpable():\n    return False\n\n\ndef _unused():")
    assert weak != source
    monkeypatch.setattr(code_reward, "harness_source", lambda: weak)
    sample = scored("def f(x):\n    return 2 * x\n")
    assert sample.status == Status.FAILED and sample.reward is None
    assert sample.reward_error == ("SandboxError: the code_tests harness cannot keep its key from the code under test: "
                                   "cannot make the judge non-dumpable (prctl via ctypes)")


def test_the_wire_format_builds_only_builtin_values():
    import json

    from rollwise.rewards import code_wire as wire

    class Liar(str):
        def __eq__(self, other):
            return True
        __hash__ = str.__hash__

    value = {"k": [Liar("x"), (1, 2.5, None)], 3: frozenset({b"a"}), "r": range(2, 9, 3), "c": 1 - 2j}
    data = json.loads(json.dumps(wire.encode(value, on_other=None)))
    decoded = wire.decode(data, on_handle=None)
    assert decoded == {"k": ["x", (1, 2.5, None)], 3: frozenset({b"a"}), "r": range(2, 9, 3), "c": 1 - 2j}
    assert type(decoded["k"][0]) is str and decoded["k"][0] != "y"
    nested = ["none"]
    for _ in range(wire.MAX_DEPTH + 2):
        nested = ["list", [nested]]
    for bad in (["int", "12x"], ["int", 12], ["bool", 1], ["str", 5], ["list", "abc"], ["dict", [["int", "1"]]],
                ["builtin", "eval"], ["float", "1e5; import os"], ["object", []], [], "str", nested):
        with pytest.raises(wire.Malformed):
            wire.decode(bad, on_handle=None)
    with pytest.raises(wire.NotPlainData, match="cannot be hashed"):
        wire.decode(["set", [["list", []]]], on_handle=None)
