"""A call to a tool the environment does not have is a failed attempt, never a call: through an episode, its
scoring and the tool-use shaping a training step applies (`rollwise.loop.assign_advantages`)."""

from __future__ import annotations

from itertools import count

import pytest

from helpers_tokenizer import tiny_tokenizer
from rollwise.config import Config, EnvConfig
from rollwise.data.prompts import encode_prompt
from rollwise.envs import build_env
from rollwise.envs.episode import EpisodeCodec, episode_metrics, run_episodes, transcript
from rollwise.generate import EngineCaps
from rollwise.generate.groups import new_groups
from rollwise.loop import assign_advantages
from rollwise.rewards import REWARDS, score_batch
from rollwise.types import GenerationResult, Prompt, SamplingParams, Status

UNKNOWN = '<tool_call>{"name": "search", "arguments": {"query": "123*45"}}</tool_call>'
CALC = '<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>'
ANSWER = "The answer is 5535."


class ScriptedTextEngine:
    """Writes the next scripted assistant message for each request (one episode at a time)."""

    version = 0
    caps = EngineCaps()  # it ignores `response_ids`: it cannot continue an aborted request

    def __init__(self, tokenizer, messages: list[str]) -> None:
        self.tokenizer, self.messages = tokenizer, list(messages)

    def abort(self, request_ids) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, requests, on_finish=None):
        results = []
        for request in requests:
            ids = self.tokenizer(self.messages.pop(0), add_special_tokens=False)["input_ids"]
            result = GenerationResult(request.request_id, list(ids), [-0.5] * len(ids), Status.COMPLETED,
                                      [(0, len(ids), self.version)])
            results.append(result)
            if on_finish is not None:
                on_finish(result)
        return results


def episode(messages: list[str], parser: str = "hermes"):
    tok = tiny_tokenizer()
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "What is 123 * 45?"}], answer="5535",
                    source="calc:0")
    groups = new_groups([(prompt, encode_prompt(prompt, tok, None))], 1, 0)
    env = build_env(EnvConfig(parser=parser, max_turns=4), "calc")
    run_episodes(ScriptedTextEngine(tok, messages), groups, SamplingParams(max_new_tokens=64), count(), env,
                 EpisodeCodec(tok), max_episode_tokens=2048)
    score_batch(groups[0].samples, REWARDS.get("arith"))
    return groups


@pytest.mark.parametrize("shaping, options, shaped", [
    ("accumulative_tool", {"per_call": 0.1}, 1.1),  # 1 + 0.1 x 1 call (was 1.2: the unknown tool counted)
    ("tool_format", {"weight": 0.1}, 0.9),  # 1 - 0.1 x 1 failed attempt (was 1.1: "clean" tool use)
    ("cost_aware", {"cost": 0.5, "free_calls": 1}, 1.0),  # 1 call, free (was exp(-0.5): billed for a 2nd)
])
def test_a_call_to_an_unknown_tool_is_not_counted_as_a_call(shaping, options, shaped):
    groups = episode([UNKNOWN, CALC, ANSWER])
    sample = groups[0].samples[0]
    assert (sample.reward, sample.correct) == (1.0, True)
    assert sample.reward_parts["env/tool_calls"] == 1.0 and sample.reward_parts["env/parse_failures"] == 1.0
    assert [c.name for c in sample.tool_calls] == ["calc"]
    # the policy still reads why its call failed
    assert transcript(sample)[2] == {"role": "tool", "content": "error: unknown tool 'search'; available: calc"}
    metrics = episode_metrics(groups[0].samples)
    assert (metrics["episode/tool_calls_mean"], metrics["episode/parse_failures"]) == (1.0, 1.0)
    cfg = Config()
    cfg.algo.shaping = {shaping: options}
    assign_advantages(groups, cfg)
    assert sample.train_reward == pytest.approx(shaped)


def test_only_unknown_tools_earn_no_tool_bonus():
    groups = episode([UNKNOWN, ANSWER])
    sample = groups[0].samples[0]
    assert sample.reward_parts["env/tool_calls"] == 0.0 and sample.tool_calls == []
    cfg = Config()
    cfg.algo.shaping = {"accumulative_tool": {"per_call": 0.1}}
    assign_advantages(groups, cfg)
    assert sample.train_reward == pytest.approx(1.0)


def test_the_env_drops_unknown_calls_whatever_parser_made_them():
    """A custom parser that lets an unknown name through: the env still records it as a failed attempt."""
    from rollwise.envs.parsers import ParsedCall, ParseOutcome, TagParser
    from rollwise.envs.tool_env import ToolEnv, calculator_tool

    class Lenient(TagParser):
        def parse(self, text, tools):
            return ParseOutcome(calls=[ParsedCall("search", {"query": text}),
                                       ParsedCall("calc", {"expression": "2*3"})])

    env = ToolEnv([calculator_tool()], parser=Lenient())
    step = env.step(env.reset(None), "anything")
    assert step.reward_parts == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_failures": 1.0}
    assert [c.name for c in step.tool_calls] == ["calc"] and step.parse_failures == 1
    assert step.messages[0]["content"] == "6\nerror: unknown tool 'search'; available: calc"
