"""The calc task (split by fact, curriculum), the calculator tool, and hard-sample substitution."""

from __future__ import annotations

from itertools import count

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import DataConfig, EnvConfig
from rollwise.data import PromptEncoder
from rollwise.data.sources import build_prompt_source
from rollwise.envs import build_env
from rollwise.envs.calc import CalcTask, fact
from rollwise.envs.episode import EpisodeCodec
from rollwise.envs.substitution import HardSampleSubstitution
from rollwise.envs.tool_env import calculate
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.rewards import score_sample
from rollwise.rollout import Episodes
from rollwise.types import RewardResult, SamplingParams


def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert calculate("123*45") == "5535"
    assert calculate(" (2 + 3) ** 2 - 7 // 2 ") == "22"
    assert calculate("7/2") == "3.5" and calculate("1,000 x 3") == "3000"
    for bad, why in [("__import__('os')", "not Call"), ("a + 1", "not Name"), ("2 ** 1000", "exponent"),
                     ("1/0", "division by zero"), ("", "empty"), ("2 +", "cannot parse"), ("9" * 40, "too large")]:
        with pytest.raises(ValueError, match=why):
            calculate(bad)


def test_calc_env_runs_the_tool_and_reports_errors():
    env = build_env(EnvConfig(), "calc")
    state = env.reset(None)
    step = env.step(state, "Let me use it: <calc>123*45</calc>")
    assert step.messages == [{"role": "tool", "content": "5535"}] and not step.done
    assert step.reward_parts == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_failures": 0.0}
    bad = env.step(state, "<calc>foo(3)</calc>")
    assert bad.tool_calls[0].error.startswith("ValueError") and bad.reward_parts["tool_errors"] == 1.0
    assert bad.messages[0]["content"].startswith("error: ")
    unclosed = env.step(state, "<calc>12*")
    assert unclosed.parse_failures == 1 and "never closed" in unclosed.messages[0]["content"]
    assert env.step(state, "The answer is 5535.").done
    assert env.stop == ("</calc>",)


def test_calc_split_is_by_fact_and_eval_has_no_example():
    task = build_prompt_source(DataConfig(task="calc", eval_size=200), seed=3)
    held = {fact(p.info["a"], p.info["b"]) for p in task.eval_prompts(200)}
    assert len(held) == 200 and all(p.info["example"] is None for p in task.eval_prompts(200))
    for i in range(400):
        p = task.train_prompt(i)
        assert fact(p.info["a"], p.info["b"]) not in held
        if p.info["example"]:
            assert fact(*p.info["example"]) not in held
        assert p.answer == str(p.info["a"] * p.info["b"])
    again = build_prompt_source(DataConfig(task="calc", eval_size=200), seed=3)
    assert [again.train_prompt(i).messages for i in range(5)] == [task.train_prompt(i).messages for i in range(5)]
    other_seed = build_prompt_source(DataConfig(task="calc", eval_size=200), seed=4)
    assert [p.messages for p in other_seed.eval_prompts(200)] == [p.messages for p in task.eval_prompts(200)]


def test_curriculum_withdraws_the_example_and_resumes():
    task = CalcTask(DataConfig(eval_size=16), seed=0, example_prob=1.0, withdraw_at=0.5, withdraw_step=0.25)
    assert all(task.train_prompt(i).info["example"] for i in range(20))
    groups = new_groups([(task.train_prompt(i), [1]) for i in range(2)], 2, 0)
    for g in groups:
        for s in g.samples:
            s.correct = True
    assert task.observe(groups)["curriculum/example_prob"] == 0.75
    state = task.state_dict()
    fresh = CalcTask(DataConfig(eval_size=16), seed=0)
    fresh.load_state_dict(state)
    assert fresh.example_prob == 0.75
    with_example = sum(bool(fresh.train_prompt(i).info["example"]) for i in range(400))
    assert 250 < with_example < 350
    guided = fresh.guided_prompt(fresh.eval_prompts(1)[0])
    assert guided.messages[1]["role"] == "user" and guided.messages[2]["content"].startswith("<calc>")
    assert guided.answer == fresh.eval_prompts(1)[0].answer
    assert fresh.guided_prompt(guided) is None
    with pytest.raises(ValueError, match="data.options of task 'calc'"):
        build_prompt_source(DataConfig(task="calc", options={"nope": 1}), seed=0)


def guided_only(sample):
    """A reward that calls guided episodes (and their substitutes) right and the others wrong: on a random
    tiny model, this drives the substitution."""
    correct = bool(sample.prompt.info.get("example")) or bool(sample.info.get("substituted"))
    return RewardResult(float(correct), {"correct": float(correct)}, correct=correct)


def test_substitution_fills_hard_groups_with_guided_answers_rescored_in_their_own_context():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = TorchEngine(model, tok, seed=0)
    task = CalcTask(DataConfig(eval_size=16), seed=0, example_prob=0.0)
    encoder = PromptEncoder(tok, None, 4096)
    env = build_env(EnvConfig(max_turns=2), "calc")
    episodes = Episodes(env, EpisodeCodec(tok), 24)
    prompts = [(p, encoder.encode(p)) for p in (task.train_prompt(i) for i in range(2))]
    groups = new_groups(prompts, 4, 0)
    params = SamplingParams(max_new_tokens=8)
    episodes.run(engine, groups, params, count())
    for g in groups:
        for s in g.samples:
            assert score_sample(s, guided_only) and not s.correct
    sub = HardSampleSubstitution(task, episodes, engine, encoder, guided_only, 5.0, guided_samples=3,
                                 max_replaced_frac=0.5)
    added, removed = sub(groups, params)
    assert len(added) == len(removed) == 4  # 2 of 4 per group (max_replaced_frac), 3 guided wins available
    for g in groups:
        new = [s for s in g.samples if s.info.get("substituted")]
        assert len(new) == 2 and len(g.samples) == 4
        for s in new:
            assert s.prompt is g.prompt and s.prompt_ids == encoder.encode(g.prompt) and s.group_id == g.group_id
            assert s.correct and s.reward == 1.0
            assert s.episode.messages[:s.episode.prompt_messages] == g.prompt.messages
            with torch.no_grad():
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            P = len(s.prompt_ids)
            want = [float(logp[P - 1 + i, t]) for i, t in enumerate(s.response_ids)]
            got = s.behaviour_logprobs
            assert max(abs(a - b) for a, b, m in zip(want, got, s.loss_mask) if m) < 1e-3
            assert all(v == 0.0 for v, m in zip(got, s.loss_mask) if not m)
            assert sum(b - a for a, b, _ in s.version_spans) == sum(s.loss_mask)
    assert sub.metrics() == {"substitution/groups_hard": 2.0, "substitution/groups_rescued": 2.0,
                             "substitution/samples_substituted": 4.0}
