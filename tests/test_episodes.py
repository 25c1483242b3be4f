"""Multi-turn episodes: token exactness, masks, log-probs, partial rollouts, env failures (rollwise.envs.episode)."""

from __future__ import annotations

import pickle
from functools import lru_cache
from itertools import count

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.data.prompts import encode_prompt
from rollwise.envs.base import StepResult
from rollwise.envs.episode import (EpisodeCodec, TurnSchedule, episode_metrics, final_text, finish_turn, run_episodes,
                                   start_episode, transcript)
from rollwise.generate.groups import StopRule, new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.rewards import score_batch
from rollwise.types import GenerationResult, Prompt, SamplingParams, Status, ToolCall

PROMPTS = [Prompt(f"p{i}", [{"role": "user", "content": text}], answer="1")
           for i, text in enumerate(["What is 7 + 3?", "Compute 12 - 5.", "The product of 4 and 5"])]


class EchoEnv:
    """Answers every assistant message with a tool message until `turns` messages; stops turns at `stop`."""

    name = "echo"

    def __init__(self, turns: int = 3, stop: tuple[str, ...] = ("e", "a", "o", "1"), max_turns: int = 5):
        self.turns, self.stop, self.max_turns = turns, stop, max_turns

    def reset(self, prompt):
        return {"turn": 0}

    def step(self, state, text):
        state["turn"] += 1
        call = ToolCall(name="echo", args={"text": text}, turn=state["turn"] - 1, result=f"seen {state['turn']}",
                        wall_s=0.001)
        return StepResult(messages=[{"role": "tool", "content": f"seen {state['turn']}"}],
                          done=state["turn"] >= self.turns, reward_parts={"tool_calls": 1.0}, tool_calls=[call])


class SpyEngine:
    """The real TorchEngine, recording every result it returns (to rebuild the episode independently)."""

    def __init__(self, engine):
        self.engine, self.results, self.requests = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, on_finish=None, **feed):
        self.requests += requests

        def record(result):
            self.results.append(result)
            if on_finish is not None:
                on_finish(result)

        if feed.get("feed") is not None:  # the next turns of a continuous call: record them as they come
            feed["feed"] = RecordingFeed(feed["feed"], self.requests)
        return self.engine.generate(requests, on_finish=record, **feed)


class RecordingFeed:
    """A feed that notes every request it hands the engine."""

    def __init__(self, feed, seen):
        self.feed, self.seen = feed, seen

    @property
    def done(self):
        return self.feed.done

    def take(self, idle):
        out = self.feed.take(idle)
        self.seen += out
        return out


@lru_cache(maxsize=None)
def embedded_tokenizer():
    from rollwise.models import load_model

    return load_model("smollm2-135m-instruct")[1]


def policy(tokenizer_name: str):
    tok = tiny_tokenizer() if tokenizer_name == "tiny" else embedded_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = tiny_llama(len(tok), seed=3, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    return model, tok


def encoded(tok, prompts=PROMPTS):
    return [(p, encode_prompt(p, tok, None)) for p in prompts]


def trainer_logprobs(model, ids: list[int], start: int) -> list[float]:
    """Log-probs of `ids[start:]` from one forward pass over the whole sequence (temperature 1), fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(start, len(ids))]


def test_codec_renders_the_template_suffix():
    tok = tiny_tokenizer()
    codec = EpisodeCodec(tok)
    assert tok.convert_ids_to_tokens(codec.closer_ids) == ["<|im_end|>", "Ċ"]
    block = codec.message_ids([{"role": "tool", "content": "seen 1"}])
    assert tok.decode(block) == "<|im_start|>tool\nseen 1<|im_end|>\n<|im_start|>assistant\n"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert codec.closing_ids([5, 6, im_end]) == codec.closer_ids[1:]  # the policy's EOS is not added again
    assert codec.closing_ids([5, 6]) == codec.closer_ids


@pytest.mark.parametrize("tokenizer_name, kind", [("tiny", "continuous"), ("tiny", "asap"), ("tiny", "rounds"),
                                                  ("embedded", "continuous")])
def test_episode_ids_are_what_the_engine_generated_plus_rendered_messages(tokenizer_name, kind):
    model, tok = policy(tokenizer_name)
    spy = SpyEngine(TorchEngine(model, tok, seed=1))
    codec = EpisodeCodec(tok)
    groups = new_groups(encoded(tok), 2, 0)
    run_episodes(spy, groups, SamplingParams(max_new_tokens=12), count(), EchoEnv(), codec, max_episode_tokens=400,
                 schedule=TurnSchedule(kind))
    by_id = {}
    for req, res in zip(spy.requests, spy.results):
        by_id[res.request_id] = res
    multi_turn = 0
    for g in groups:
        for s in g.samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            # rebuild: each turn's request continued from exactly the episode's ids so far
            rebuilt, mask = [], []
            turns = [t for t in s.turns if t[2] == "assistant"]
            for k, (start, end, _) in enumerate(turns, start=1):
                req = next(r for r in spy.requests if r.prompt_ids == s.prompt_ids + rebuilt
                           and by_id[r.request_id].response_ids == s.response_ids[start:end])
                gen = by_id[req.request_id].response_ids
                rebuilt += gen
                mask += [1] * len(gen)
                if end < len(s.response_ids):  # the env answered: closer + tool message + assistant header
                    added = codec.closing_ids(gen) + codec.message_ids([{"role": "tool", "content": f"seen {k}"}])
                    rebuilt += added
                    mask += [0] * len(added)
            assert rebuilt == s.response_ids
            assert mask == s.loss_mask
            assert len(s.behaviour_logprobs) == len(s.full_logprobs) == len(s.response_ids)
            assert all(lp == 0.0 for lp, m in zip(s.behaviour_logprobs, s.loss_mask) if m == 0)
            multi_turn += len(turns) > 1
            # policy tokens' log-probs equal one trainer forward pass over the whole episode
            want = trainer_logprobs(model, s.prompt_ids + s.response_ids, len(s.prompt_ids))
            diffs = [abs(a - b) for a, b, m in zip(want, s.behaviour_logprobs, s.loss_mask) if m]
            assert max(diffs) < 1e-3
    assert multi_turn >= 3  # the stop strings end most turns early: the test exercises several turns


def test_a_retokenisation_difference_is_counted_not_trained():
    tok = embedded_tokenizer()
    codec = EpisodeCodec(tok)
    (prompt, ids), = encoded(tok, PROMPTS[:1])
    sample = new_groups([(prompt, ids)], 1, 0)[0].samples[0]
    start_episode(sample, EchoEnv(turns=1))
    split = tok.convert_tokens_to_ids(["Ġl", "st"])  # decodes to " lst", which encodes as one token
    assert tok(" lst", add_special_tokens=False)["input_ids"] != split
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    result = GenerationResult(0, split + [eos], [-1.0, -2.0, -0.5], Status.COMPLETED, [(0, 3, 7)])
    finish_turn(sample, result, EchoEnv(turns=1), codec, max_episode_tokens=64)
    assert sample.response_ids == split + [eos]  # the sampled ids, not the re-encoded ones
    assert sample.behaviour_logprobs == [-1.0, -2.0, -0.5] and sample.version_spans == [(0, 3, 7)]
    assert sample.episode.retokenize_mismatch is True
    assert episode_metrics([sample])["episode/retokenize_mismatch"] == 1.0


@pytest.mark.parametrize("schedule", [TurnSchedule("rounds"), TurnSchedule("continuous", lag_steps=2)],
                         ids=["rounds", "continuous"])
def test_aborted_episodes_continue_mid_turn_under_the_next_version(schedule):
    model, tok = policy("tiny")
    engine = TorchEngine(model, tok, seed=2)
    codec = EpisodeCodec(tok)
    env = EchoEnv(turns=3, stop=("e",))
    groups = new_groups(encoded(tok), 4, 0)
    ids = count()
    stats = run_episodes(engine, groups, SamplingParams(max_new_tokens=16), ids, env, codec,
                         stop=StopRule(after_groups=1), max_episode_tokens=400, schedule=schedule)
    aborted = [s for g in groups for s in g.samples if s.status == Status.ABORTED]
    assert stats.aborted == len(aborted) > 0
    carried = pickle.loads(pickle.dumps(groups))  # partial rollouts carry episodes across steps and checkpoints
    engine.version = 1
    before = {id(s): (list(s.response_ids), list(s.loss_mask)) for g in carried for s in g.samples}
    run_episodes(engine, carried, SamplingParams(max_new_tokens=16), ids, env, codec, max_episode_tokens=400,
                 schedule=schedule)
    continued = 0
    for g in carried:
        for s in g.samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            old_ids, old_mask = before[id(s)]
            assert s.response_ids[:len(old_ids)] == old_ids and s.loss_mask[:len(old_mask)] == old_mask
            versions = {v for _, _, v in s.version_spans}
            if versions == {0, 1}:
                continued += 1
            covered = sum(e - b for b, e, _ in s.version_spans)
            assert covered == sum(s.loss_mask)  # spans cover exactly the policy's tokens
            want = trainer_logprobs(model, s.prompt_ids + s.response_ids, len(s.prompt_ids))
            assert max(abs(a - b) for a, b, m in zip(want, s.behaviour_logprobs, s.loss_mask) if m) < 1e-3
    assert continued > 0


def test_turn_and_token_limits_end_episodes():
    model, tok = policy("tiny")
    codec = EpisodeCodec(tok)
    groups = new_groups(encoded(tok), 2, 0)
    run_episodes(TorchEngine(model, tok, seed=0), groups, SamplingParams(max_new_tokens=8), count(),
                 EchoEnv(turns=99, stop=("e", "a", "o", "1"), max_turns=2), codec, max_episode_tokens=400)
    ended = set()
    for s in (s for g in groups for s in g.samples):
        assert s.episode.assistant_turns <= 2
        assert s.episode.ended_by in ("turn_limit", "truncated")
        ended.add(s.episode.ended_by)
        if s.episode.ended_by == "turn_limit":  # still calling tools when cut: no answer to score
            assert s.response_text == "" and final_text(s) == s.episode.messages[-1]["content"] != ""
    assert "turn_limit" in ended
    groups = new_groups(encoded(tok), 2, 0)
    run_episodes(TorchEngine(model, tok, seed=0), groups, SamplingParams(max_new_tokens=8), count(),
                 EchoEnv(turns=99, stop=("e", "a", "o", "1"), max_turns=50), codec, max_episode_tokens=40)
    for s in (s for g in groups for s in g.samples):
        assert len(s.response_ids) <= 40 + 8 + len(codec.message_ids([{"role": "tool", "content": "seen 99"}]))
        assert s.status == Status.TRUNCATED


class CrashingEnv(EchoEnv):
    def step(self, state, text):
        raise RuntimeError("tool backend is down")


def test_a_crashing_environment_fails_the_sample_loudly():
    model, tok = policy("tiny")
    groups = new_groups(encoded(tok, PROMPTS[:1]), 2, 0)
    env = CrashingEnv(stop=("e", "a", "o", "1", "2", "3", "t", "s"))
    run_episodes(TorchEngine(model, tok, seed=0), groups, SamplingParams(max_new_tokens=30), count(), env,
                 EpisodeCodec(tok), max_episode_tokens=100)
    samples = groups[0].samples
    stepped = [s for s in samples if s.episode.ended_by == "env_error"]
    assert stepped, "no turn reached the environment"
    scored = score_batch(samples, lambda s: 1.0)
    for s in stepped:
        assert s not in scored and s.status == Status.FAILED
        assert "env 'echo' step 1 failed: RuntimeError: tool backend is down" in s.reward_error
    assert episode_metrics(samples)["episode/env_errors"] == float(len(stepped))


def test_env_reward_parts_reach_the_sample_and_transcript_holds_every_message():
    model, tok = policy("tiny")
    groups = new_groups(encoded(tok, PROMPTS[:1]), 2, 0)
    run_episodes(TorchEngine(model, tok, seed=0), groups, SamplingParams(max_new_tokens=12), count(),
                 EchoEnv(turns=2), EpisodeCodec(tok), max_episode_tokens=400)
    for s in groups[0].samples:
        score_batch([s], lambda s: 1.0)
        assert s.reward_parts["env/tool_calls"] == float(len(s.tool_calls))
        messages = transcript(s)
        assert messages[0] == PROMPTS[0].messages[0]
        turns = s.episode.assistant_turns
        assert [m["role"] for m in messages[1:]] == ["assistant"] + ["tool", "assistant"] * (turns - 1)
        assert sum(role == "assistant" for _, _, role in s.turns) == turns
