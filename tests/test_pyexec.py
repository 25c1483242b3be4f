"""The `pyexec` task (problems, tests, the held-out split by problem) and its execution-feedback environment, with
real sandbox runs and one real multi-turn episode on the tiny model."""

from __future__ import annotations

import json
from itertools import count

import pytest

from rollwise.config import DataConfig, EnvConfig
from rollwise.data.sources import build_prompt_source
from rollwise.data.tasks import TASKS
from rollwise.envs import ENVS, EnvError, build_env
from rollwise.envs.pyexec import FAMILIES, NO_CODE_FEEDBACK, PyExecEnv, build_problems
from rollwise.rewards import REWARDS, score_samples
from rollwise.sandbox import run


def good_mul(k):
    return f"```python\ndef f(x):\n    return x * {k}\n```"


def wrong_mul(k):
    return f"```python\ndef f(x):\n    return x + {k}\n```"


@pytest.fixture(scope="module")
def task():
    return build_prompt_source(DataConfig(task="pyexec", eval_size=512), seed=0)


def mul_prompt(task):
    """A trained `x * k` problem (which k are held out is fixed by the split)."""
    for position in range(10_000):
        prompt = task.train_prompt(position)
        if prompt.info["family"] == "mul":
            return prompt
    raise AssertionError("no mul problem is trained")


def test_registered_with_its_env_and_reward(task):
    assert "pyexec" in TASKS and "pyexec" in ENVS
    assert (task.default_env, task.default_reward) == ("pyexec", "code_tests")
    env = build_env(EnvConfig(max_turns=3), task.default_env)
    assert isinstance(env, PyExecEnv) and env.max_turns == 3 and env.stop == ()


def test_problems_and_their_tests():
    problems = build_problems()
    assert len(problems) == 146 and len(FAMILIES) == 48
    assert len({p["id"] for p in problems}) == 146
    assert all(3 <= len(p["tests"]) <= 5 for p in problems)
    mul7 = next(p for p in problems if p["id"] == "mul-7")  # k = 7
    assert mul7["tests"] == ["assert f(0) == 0", "assert f(1) == 7", "assert f(3) == 21", "assert f(-2) == -14",
                             "assert f(10) == 70"]
    # every reference solution passes its own tests in the sandbox's interpreter (one run for all of them)
    checker = ("import json\nfailed = []\nfor p in json.load(open('problems.json')):\n"
               "    ns = {}\n    exec(p['reference'], ns)\n    for t in p['tests']:\n"
               "        try:\n            exec(t, ns)\n        except Exception as exc:\n"
               "            failed.append((p['id'], t, repr(exc)))\nprint(json.dumps(failed))\n")
    result = run(checker, files={"problems.json": json.dumps(problems)})
    assert result.ok and json.loads(result.stdout) == []


def test_split_by_problem_is_fixed_and_never_trained(task):
    other = build_prompt_source(DataConfig(task="pyexec", eval_size=512), seed=123)
    assert [p.messages for p in task.eval_prompts(task.num_eval)] == [p.messages for p in other.eval_prompts(other.num_eval)]
    assert task.num_eval == 44 == len(task.held_ids)  # 30% of 146, whatever data.eval_size above that
    eval_texts = {p.messages[0]["content"] for p in task.eval_prompts(task.num_eval)}
    for position in range(1500):
        prompt = task.train_prompt(position)
        assert prompt.info["problem"] not in task.held_ids
        assert prompt.messages[0]["content"] not in eval_texts
    assert task.train_prompt(5).messages == task.train_prompt(5).messages
    small = build_prompt_source(DataConfig(task="pyexec", eval_size=10), seed=0)
    assert small.eval_prompts(10) == task.eval_prompts(10)
    with pytest.raises(ValueError, match="held-out split has 10"):
        small.eval_prompts(11)


def test_right_code_ends_the_episode_with_a_recorded_run(task):
    env = PyExecEnv(max_turns=2)
    prompt = mul_prompt(task)
    state = env.reset(prompt)
    step = env.step(state, good_mul(prompt.info["k"]))
    assert step.done and step.messages == []
    assert step.reward_parts["tests_passed"] == step.reward_parts["tests_total"] == 2.0  # the visible tests
    [call] = step.tool_calls
    assert (call.name, call.turn, call.result, call.error) == ("run_tests", 0, "all tests passed", None)
    assert 0.0 < call.sandbox_s <= call.wall_s and step.reward_parts["sandbox_s"] == call.sandbox_s


def test_a_failure_gets_feedback_then_the_last_turn_ends(task):
    env = PyExecEnv(max_turns=2)
    prompt = mul_prompt(task)
    k = prompt.info["k"]
    state = env.reset(prompt)
    first = env.step(state, wrong_mul(k))
    assert not first.done and first.reward_parts["tests_passed"] == 0.0
    [message] = first.messages
    assert message["role"] == "user"
    assert message["content"].startswith(f"Your code passed 0 of 2 tests. Failed:\n- `assert f(0) == 0`: got {k}, "
                                         f"expected 0\n- `assert f(1) == {k}`: got {k + 1}, expected {k}\n")
    assert message["content"].endswith("reply with the complete corrected code in a ```python block.")
    last = env.step(state, wrong_mul(k))
    assert last.done and last.messages == [] and len(last.tool_calls) == 1


def test_no_code_and_cut_feedback(task):
    env = PyExecEnv(max_turns=3, feedback_chars=40)
    state = env.reset(mul_prompt(task))
    step = env.step(state, "I would multiply.")
    assert step.messages == [{"role": "user", "content": NO_CODE_FEEDBACK}] and step.tool_calls == []
    assert step.reward_parts["no_code"] == 1.0
    crash = env.step(state, "```python\ndef f(x):\n    return x / 0\n```")
    body = crash.messages[0]["content"]
    head, _, tail = body.partition(" ... [cut]\n")
    assert head.startswith("Your code passed 0 of 2 tests. Failed:\n") and len(head) == 40
    assert tail.startswith("Fix the function")


def test_feedback_shows_visible_tests_only_and_the_reward_scores_the_hidden_ones(task):
    """Code that hard-codes the expected values the feedback showed ends the episode but fails the hidden tests."""
    from rollwise.rewards.code import run_tests

    env = PyExecEnv(max_turns=2)
    prompt = mul_prompt(task)
    k, tests = prompt.info["k"], prompt.info["tests"]
    assert len(tests) == 5
    copied = f"```python\ndef f(x):\n    return {{0: 0, 1: {k}}}.get(x, -1)\n```"
    state = env.reset(prompt)
    step = env.step(state, copied)
    assert step.done and step.reward_parts["tests_passed"] == step.reward_parts["tests_total"] == 2.0
    hidden = run_tests(copied.split("```python\n")[1].split("```")[0], tests)
    assert hidden.total == 5 and hidden.passed == 2
    assert PyExecEnv(max_turns=2, feedback_tests=0).visible(tests) == tests


def test_env_options_are_checked():
    with pytest.raises(EnvError, match="env.options of 'pyexec': unknown \\['cpus'\\]"):
        build_env(EnvConfig(name="pyexec", options={"cpus": 1}))
    env = build_env(EnvConfig(name="pyexec", options={"cpu_s": 1, "feedback_chars": 100}))
    assert (env.limits.cpu_s, env.limits.wall_s, env.feedback_chars) == (1, 8, 100)


def test_an_episode_on_the_tiny_model_runs_turns_and_scores(task):
    """The plumbing with the real episode runner: the random model writes no working code (at best a stray name
    that parses, and fails to load), so its first turn gets feedback as a user message (loss mask 0), and the
    final message scores 0."""
    from helpers_model import tiny_llama
    from helpers_tokenizer import tiny_tokenizer

    from rollwise.data.prompts import encode_prompt
    from rollwise.envs.episode import EpisodeCodec, run_episodes
    from rollwise.generate.torch_engine import TorchEngine
    from rollwise.generate.groups import new_groups
    from rollwise.types import SamplingParams, Status

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompt = mul_prompt(task)
    ids = encode_prompt(prompt, tok, None)
    groups = new_groups([(prompt, list(ids))], 2, 0)
    env = PyExecEnv(max_turns=2)
    run_episodes(TorchEngine(model, tok), groups, SamplingParams(max_new_tokens=24, temperature=1.0, seed=0, stop=("e", "a", "o")),
                 count(), env, EpisodeCodec(tok), max_episode_tokens=400)
    metrics = score_samples(groups[0].samples, REWARDS.get(task.default_reward))
    for sample in groups[0].samples:
        assert sample.status == Status.COMPLETED
        roles = [role for _, _, role in sample.turns]
        assert roles.count("assistant") == 2 and "user" in roles
        assert [m["role"] for m in sample.episode.messages[-3:]] == ["assistant", "user", "assistant"]
        feedback = sample.episode.messages[-2]["content"]
        assert feedback == NO_CODE_FEEDBACK or feedback.startswith("Your code raised an error when it was loaded")
        for start, end, role in sample.turns:
            assert set(sample.loss_mask[start:end]) == ({1} if role == "assistant" else {0})
        assert (sample.reward, sample.correct) == (0.0, False)
    assert metrics["reward/mean"] == 0.0
