"""Agent programs as the episode source (rollwise.agents): a plain Python agent using the `openai` client trains
through `rollwise.loop.train` token-exactly (the trainer's ids are the ids the engine sampled, the loss mask
covers exactly the completions), rewritten histories are split and counted, failing and hanging programs are
counted failed and stop the run, and the endpoint refuses what it cannot serve."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

import toy_agents
from conftest import read_rows, tiny_config
from rollwise.agents.calls import Call, fill_sample, stitch
from rollwise.agents.chat import BadRequest, ChatCodec, normalise, parse_tool_calls
from rollwise.agents.program import Outcome, outcome_of
from rollwise.config import ConfigError
from rollwise.generate.torch_engine import TorchEngine
from rollwise.rewards import RewardsFailingError
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, RewardResult, Sample, Status

AGENT = {"agent.program": "toy_agents:tool_agent", "algo.filter_zero_variance": False, "eval.n": 0}


def call(session: str, prompt: list[int], completion: list[int], version: int = 0) -> Call:
    return Call(session, [], "", {"role": "assistant", "content": ""}, "", prompt, completion,
                [-0.5] * len(completion), [-0.25] * len(completion), [(0, len(completion), version)], Status.COMPLETED)


def blank(prompt_ids=()) -> Sample:
    return Sample(Prompt("p", [{"role": "user", "content": "q"}]), list(prompt_ids), [], [], [], Status.PENDING, 0)


# -- stitching: pure token bookkeeping ------------------------------------------------------------------------
def test_calls_that_extend_stitch_into_one_sample_with_masks_between_completions():
    first = call("", [1, 2, 3], [4, 5])
    second = call("", [1, 2, 3, 4, 5, 9, 9], [6], version=1)  # prompt = first prompt + completion + 2 new tokens
    (segment,) = stitch([first, second])
    sample = blank()
    fill_sample(sample, segment)
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.response_ids == [4, 5, 9, 9, 6]
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.behaviour_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert sample.full_logprobs == [-0.25, -0.25, 0.0, 0.0, -0.25]
    assert sample.version_spans == [(0, 2, 0), (4, 5, 1)]
    assert sample.turns == [(0, 2, "assistant"), (2, 4, "template"), (4, 5, "assistant")]
    assert sample.status == Status.COMPLETED


def test_a_call_that_does_not_extend_starts_a_new_sample_and_sessions_stay_apart():
    a1 = call("a", [1, 2], [3])
    b1 = call("b", [7], [8])  # another conversation of the same episode (a second verifiers trace)
    a2 = call("a", [1, 2, 3, 4], [5])  # extends a1
    a3 = call("a", [1, 9], [6])  # rewrote the history: does not start with [1, 2, 3, 4, 5]
    segments = stitch([a1, b1, a2, a3])
    assert [[c.completion_ids for c in s] for s in segments] == [[[3], [5]], [[8]], [[6]]]


# -- the chat codec -------------------------------------------------------------------------------------------
def test_bridged_prompt_keeps_the_sampled_ids_where_a_whole_render_would_retokenise():
    from helpers_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    codec = ChatCodec(tok)
    first = normalise({"messages": [{"role": "user", "content": "What is 7 + 3?"}]})
    prompt = codec.prompt_ids(first)
    # a completion the engine could sample: "The answer" written as single characters, then EOS
    completion = [i for ch in "The answer" for i in codec.encode(ch)] + [tok.eos_token_id]
    assert codec.encode("The answer") != completion[:-1], "the example must re-tokenise differently"
    tail = [{"role": "tool", "content": "10"}]
    bridged = (prompt + completion + codec.closing_ids(completion, None, "") + codec.tail_ids(tail, None, ""))
    history = first.messages + [{"role": "assistant", "content": "The answer"}] + tail
    whole = codec.canonical_ids(history, None)
    assert bridged[:len(prompt) + len(completion)] == prompt + completion  # token-exact continuation
    assert bridged != whole  # what a re-rendering server would have fed the model instead
    assert tok.decode(bridged) == tok.decode(whole)  # the same text
    # with the canonical ids as the completion, bridging reproduces the whole render exactly
    canonical = codec.encode("The answer") + [tok.eos_token_id]
    assert prompt + canonical + codec.closing_ids(canonical, None, "") + codec.tail_ids(tail, None, "") == whole


def test_a_reply_sent_back_as_parsed_tool_calls_still_bridges_to_the_sampled_ids():
    """The program appends the reply as the SDK gave it (content None, tool_calls with JSON-text arguments):
    the next prompt continues the ids the engine sampled for the `<tool_call>` block, not the template's JSON."""
    from helpers_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    codec = ChatCodec(tok)
    first = normalise({"messages": [{"role": "user", "content": "What is 7 + 3?"}], "tools": toy_agents.TOOLS})
    prompt = codec.prompt_ids(first)
    text = '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 3}}</tool_call>'
    completion = codec.encode(text) + [tok.eos_token_id]
    content, calls = parse_tool_calls(text)
    calls[0]["id"] = "call_0_0"
    earlier = Call("", first.messages, first.tools_key, {"role": "assistant", "content": content, "tool_calls": calls},
                   text, prompt, completion, [0.0] * len(completion), [], [], Status.COMPLETED)
    sdk_reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": '{"a":7,"b":3}'}}]}
    follow = normalise({"messages": [*first.messages, sdk_reply, {"role": "tool", "tool_call_id": "call_0_0",
                                                                  "content": "10"}], "tools": toy_agents.TOOLS})
    ids, parent, role = codec.bridge([earlier], "", follow)
    assert parent == 0 and role == "tool"
    assert ids[:len(prompt) + len(completion)] == prompt + completion
    # an edited reply is not the one rollwise gave: no bridge (the call is rendered whole and starts a sample)
    edited = normalise({"messages": [*first.messages, {"role": "assistant", "content": "7 + 3 = 10"}],
                        "tools": toy_agents.TOOLS})
    assert codec.bridge([earlier], "", edited) is None


def test_requests_are_normalised_and_refused_in_one_line():
    request = normalise({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}], "temperature": 0.2, "max_tokens": 5})
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "name": "add", "arguments": {"a": 1, "b": 2}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    assert request.max_tokens == 5 and request.ignored == ["temperature"]
    for body, field in [({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
                        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n = 2"),
                        ({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
                        ({"messages": [{"role": "wizard", "content": "x"}]}, "role")]:
        with pytest.raises(BadRequest, match=field):
            normalise(body)


def test_hermes_tool_calls_are_parsed_from_the_reply():
    content, calls = parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "Let me add." and calls == [{"name": "add", "arguments": {"a": 1}}]
    text = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_a_programs_return_value_is_its_reward_its_answer_or_an_error():
    assert outcome_of(0.5).reward == 0.5 and outcome_of(True).reward is True
    result = RewardResult(1.0, {"x": 1.0})
    assert outcome_of(result).reward is result
    assert outcome_of("42").answer == "42" and outcome_of(None) == Outcome()
    assert "returned a dict" in outcome_of({"reward": 1}).error


def test_config_errors_name_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match="control.mode = 'sync'"):
        tiny_config(tiny_model_dir, **{**AGENT, "control.mode": "async", "control.max_staleness": 0})
    with pytest.raises(ConfigError, match="agent.program = 'toy_agents:nope'"):
        tiny_config(tiny_model_dir, **{**AGENT, "agent.program": "toy_agents:nope"})
    with pytest.raises(ConfigError, match="remove env.name"):
        tiny_config(tiny_model_dir, **{**AGENT, "env.name": "calc"})


# -- real runs ------------------------------------------------------------------------------------------------
@pytest.fixture
def recorded(monkeypatch):
    """(engine calls: (context ids, sampled ids, log-probs), samples the trainer stepped on), recorded at the
    engine and the trainer themselves."""
    engine_calls, trained = [], []
    real_generate, real_step = TorchEngine.generate, Trainer.step

    def generate(self, requests, on_finish=None, feed=None):
        asked = {r.request_id: r for r in requests}

        def finish(result):
            engine_calls.append((tuple(asked[result.request_id].prompt_ids), tuple(result.response_ids),
                                 tuple(result.logprobs)))
            if on_finish is not None:
                on_finish(result)

        class Fed:  # requests handed to the running call (caps.request_feed) are recorded as they are taken
            done = property(lambda _: feed.done)

            def take(self, idle):
                new = feed.take(idle)
                asked.update((r.request_id, r) for r in new)
                return new

        return real_generate(self, requests, finish, **({"feed": Fed()} if feed is not None else {}))

    def step(self, samples, *args, **kwargs):
        trained.extend(samples)
        return real_step(self, samples, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "generate", generate)
    monkeypatch.setattr(Trainer, "step", step)
    toy_agents.CALLS.clear()
    return engine_calls, trained


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assert_token_exact(sample: Sample, engine_calls: list, completions: int) -> None:
    """Every loss-mask-1 run of `sample` is one engine call: the engine was asked to continue exactly the ids
    before it and sampled exactly its ids and log-probs; there are `completions` of them and the last one ends
    the response."""
    full = sample.prompt_ids + sample.response_ids
    runs = mask_runs(sample.loss_mask)
    assert len(runs) == completions
    sampled = {(ctx, ids): lps for ctx, ids, lps in engine_calls}
    for a, b in runs:
        key = (tuple(full[:len(sample.prompt_ids) + a]), tuple(sample.response_ids[a:b]))
        assert key in sampled, "a trained span is not what the engine sampled after that exact context"
        assert tuple(sample.behaviour_logprobs[a:b]) == sampled[key]
    assert runs[-1][1] == len(sample.response_ids)
    assert all(lp == 0.0 for lp, m in zip(sample.behaviour_logprobs, sample.loss_mask) if not m)


def quiet_train(cfg, run_dir):
    from rollwise.loop import train

    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("feed", [True, False], ids=["request_feed", "rounds"])
def test_a_plain_openai_agent_trains_two_steps_token_exactly(tmp_path, tiny_model_dir, recorded, monkeypatch, feed):
    """tool_agent: three chat calls with a tool turn between the first two, then the final answer; 4 prompts x
    4 episodes per step, two steps, evaluation through the agent too. Calls join the running engine call
    (`caps.request_feed`), or, on an engine without it, run in rounds."""
    if not feed:
        monkeypatch.setattr(TorchEngine, "caps", dataclasses.replace(TorchEngine.caps, request_feed=False))
    engine_calls, trained = recorded
    summary = quiet_train(tiny_config(tiny_model_dir, **{**AGENT, "eval.n": 4}), tmp_path / "run")
    assert summary["steps"] == 2 and summary["tokens_trained"] > 0
    assert len(trained) == 2 * 16
    for sample in trained:
        calls = toy_agents.CALLS[sample.info["agent"]["key"]]
        assert len(calls) == 3
        assert_token_exact(sample, engine_calls, completions=3)
        # the program saw exactly these ids, and every prompt extends the previous call's prompt + completion
        assert sample.prompt_ids == calls[0]["prompt_ids"]
        assert sample.prompt_ids + sample.response_ids == calls[-1]["prompt_ids"] + calls[-1]["ids"]
        assert sum(sample.loss_mask) == sum(len(c["ids"]) for c in calls)
        assert sample.reward == pytest.approx(toy_agents.text_reward(calls[-1]["content"]))
    assert {s.info["agent"]["calls"] for s in trained} == {3}
    train_rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    for row in train_rows:
        assert row["agent/episodes"] == 16 and row["agent/calls_mean"] == 3
        assert row["agent/retokenize_mismatch"] == 0 and row["agent/failed"] == 0 and row["reward/errors"] == 0
        # the trainer's log-probs of every completion, in its stitched context, are the engine's (fp32)
        assert row["mismatch/logprob_abs_diff_max"] < 1e-5
    versions = [{c["version"] for c in toy_agents.CALLS[s.info["agent"]["key"]]} for s in trained]
    assert versions[0] == {0} and versions[-1] == {1}  # each step sampled with the weights synced before it
    evals = [r for r in read_rows(tmp_path / "run") if r["kind"] == "eval"]
    assert len(evals) == 2 and all(r["eval/reward_errors"] == 0 for r in evals)


@pytest.mark.slow
def test_rewritten_history_is_split_and_counted_or_dropped(tmp_path, tiny_model_dir, recorded):
    from rollwise.build import open_run
    from rollwise.loop import rl_step

    engine_calls, trained = recorded
    base = {**AGENT, "agent.program": "toy_agents:rewriting_agent", "rollout.prompts_per_step": 2,
            "rollout.samples_per_prompt": 2}
    run = open_run(tiny_config(tiny_model_dir, **base), tmp_path / "split")
    try:
        row, batch = rl_step(run)
    finally:
        run.close()
    assert row["agent/retokenize_mismatch"] == 4 and row["agent/split_frac"] == 1.0
    assert [len(g.samples) for g in batch.generated] == [4, 4]  # two samples per episode
    for sample in trained:
        assert_token_exact(sample, engine_calls, completions=1)
    run = open_run(tiny_config(tiny_model_dir, **{**base, "agent.on_mismatch": "drop"}), tmp_path / "drop")
    try:
        row, batch = rl_step(run)
    finally:
        run.close()
    assert row["reward/errors"] == 4 and row["agent/failed"] == 4
    assert all("rewrote its message history" in s.reward_error for g in batch.generated for s in g.samples)


@pytest.mark.slow
def test_a_failing_program_is_counted_and_stops_the_run(tmp_path, tiny_model_dir, recorded):
    cfg = tiny_config(tiny_model_dir, **{**AGENT, "agent.program": "toy_agents:failing_agent", "train.steps": 4})
    with pytest.raises(RewardsFailingError, match="ToolFailed: the calculator is down"):
        quiet_train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert len(rows) == 2  # reward.max_failed_steps = 2
    assert all(r["agent/failed"] == 16 and r["reward/errors"] == 16 for r in rows)
    assert not recorded[1], "a failed episode reached the trainer"


@pytest.mark.slow
def test_timeouts_call_limits_and_refused_requests(tmp_path, tiny_model_dir, recorded):
    from rollwise.build import open_run
    from rollwise.loop import rl_step

    small = {**AGENT, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2}
    cases = [({"agent.program": "toy_agents:slow_agent", "agent.timeout_s": 1.0}, "agent/timeouts"),
             ({"agent.program": "toy_agents:looping_agent", "agent.max_calls": 2}, "agent/call_limit"),
             ({"agent.program": "toy_agents:probing_agent"}, None)]
    rows = []
    for i, (overrides, counter) in enumerate(cases):
        run = open_run(tiny_config(tiny_model_dir, **{**small, **overrides}), tmp_path / f"run{i}")
        try:
            rows.append(rl_step(run))
        finally:
            run.close()
    (slow, slow_batch), (loop, loop_batch), (probe, _) = rows
    # a program past agent.timeout_s (an async one is cancelled) fails its sample, counted
    assert slow["agent/timeouts"] == 4 and slow["reward/errors"] == 4
    assert all("agent.timeout_s" in s.reward_error for g in slow_batch.generated for s in g.samples)
    # one past agent.max_calls is refused (429); raising after that is an episode without an answer, scored
    assert loop["agent/call_limit"] == 4 and loop["reward/errors"] == 0 and loop["agent/calls_mean"] == 2
    assert all(s.response_text == "" and s.reward == 0.0 for g in loop_batch.generated for s in g.samples)
    # a wrong key, a streamed call and n = 2 are refused; the valid call goes on
    statuses = [v for k, v in toy_agents.CALLS.items() if k.endswith(":statuses")]
    assert len(statuses) == 4 and all(s == [401, 400, 400] for s in statuses)
    assert probe["reward/errors"] == 0 and probe["agent/calls_mean"] == 1


@pytest.mark.slow
def test_a_verifiers_environment_trains_two_steps_token_exactly(tmp_path, tiny_model_dir, recorded):
    """tests/vf_toy_env.py: a verifiers v1 Taskset, rubric and in-process harness (two calls with a tool turn)."""
    pytest.importorskip("verifiers")
    import vf_toy_env

    engine_calls, trained = recorded
    vf_toy_env.CALLS.clear()
    cfg = tiny_config(tiny_model_dir, **{"data.task": "verifiers:vf_toy_env", "data.eval_size": 4, "eval.n": 4,
                                         "algo.filter_zero_variance": False})
    summary = quiet_train(cfg, tmp_path / "run")
    assert summary["steps"] == 2 and len(trained) == 2 * 16
    for sample in trained:
        assert_token_exact(sample, engine_calls, completions=2)
        assert len(vf_toy_env.CALLS[sample.info["agent"]["key"]]) == 2  # the harness ran both calls
        assert sample.reward_parts == {"varied": sample.reward}  # the rubric's reward and its part
        assert sample.prompt.source.startswith("verifiers:vf_toy_env[")
    rows = read_rows(tmp_path / "run")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert all(r["agent/calls_mean"] == 2 and r["agent/failed"] == 0 and r["agent/retokenize_mismatch"] == 0
               for r in train_rows)
    assert all("reward/part/varied" in r and r["mismatch/logprob_abs_diff_max"] < 1e-5 for r in train_rows)
    from rollwise.agents.vf_env import verifiers_task

    source = verifiers_task(cfg.data, 0)  # the held-out tasks are never trained
    train_uids = {source.train_prompt(i).uid for i in range(len(source.train))}
    assert not train_uids & {p.uid for p in source.eval_prompts(4)}


def test_a_verifiers_episode_becomes_per_trace_rewards_or_a_counted_error():
    """`episode_outcome` on verifiers-shaped episodes (no verifiers needed): each trainable trace's reward and
    parts, untrainable traces left out, and any error or unscored reward failing the episode."""
    from types import SimpleNamespace as NS

    from rollwise.agents.vf_env import episode_outcome

    def trace(id_, score, trainable=True, errors=()):
        rewards = {"right": None if score is None else NS(score=score, value=score)}
        return NS(id=id_, rewards=rewards, reward=score or 0.0, errors=list(errors), agent=NS(trainable=trainable))

    good = episode_outcome(NS(ok=True, errors=[], traces=[trace("a", 1.0), trace("judge", 0.0, trainable=False)]))
    assert good.error is None and good.untrained == {"judge"}
    assert good.session_rewards["a"] == RewardResult(1.0, {"right": 1.0}) and good.reward == good.session_rewards["a"]
    failed = episode_outcome(NS(ok=False, errors=[NS(type="HarnessError", message="exited 1")], traces=[]))
    assert failed.error == "verifiers episode failed: HarnessError: exited 1"
    unscored = episode_outcome(NS(ok=True, errors=[], traces=[trace("a", None)]))
    assert "rewards ['right'] were not scored" in unscored.error



def judged_step(tmp_path, model_dir):
    """One training step on tests/vf_judge_env.py (2 prompts x 2 episodes; in each, the policy's trace, then an
    untrainable judge's): (its metrics row, its batch, the run's key, what a child started after the step sees)."""
    pytest.importorskip("verifiers")
    import subprocess
    import sys

    import vf_judge_env

    from rollwise.build import open_run
    from rollwise.loop import rl_step

    vf_judge_env.CALLS.clear()
    vf_judge_env.CHILD_ENV.clear()
    cfg = tiny_config(model_dir, **{"data.task": "verifiers:vf_judge_env", "data.eval_size": 4, "eval.n": 0,
                                    "algo.filter_zero_variance": False, "rollout.prompts_per_step": 2,
                                    "rollout.samples_per_prompt": 2})
    run = open_run(cfg, tmp_path / "run")
    try:
        row, batch = rl_step(run)
        child = subprocess.run([sys.executable, "-c", vf_judge_env.PROBE], capture_output=True, text=True, check=True)
        return row, batch, run.episodes.run_key, child.stdout
    finally:
        run.close()


@pytest.mark.slow
def test_a_frozen_judges_reply_is_never_the_policys_response_text(tmp_path, tiny_model_dir, recorded):
    """The judge's calls come last in each episode; the sample's `response_text` is the policy's own final
    reply, and only the policy's calls are trained."""
    import vf_judge_env

    row, batch, _, _ = judged_step(tmp_path, tiny_model_dir)
    assert row["agent/failed"] == 0 and row["reward/errors"] == 0 and row["agent/calls_mean"] == 4
    samples = [s for g in batch.generated for s in g.samples]
    assert len(samples) == 4 and len(recorded[1]) == 4
    for sample in samples:
        _, policy_final, _, judge_final = vf_judge_env.CALLS[sample.info["agent"]["key"]]
        assert sample.response_text == policy_final["content"]
        assert_token_exact(sample, recorded[0], completions=2)
    assert any(c[3]["content"] != c[1]["content"] for c in vf_judge_env.CALLS.values())  # the test can tell


@pytest.mark.slow
def test_the_verifiers_run_key_never_enters_the_environment(tmp_path, tiny_model_dir, recorded):
    """The run's key reaches the loopback endpoint (every call of every episode answered) without entering
    `os.environ`: a child the harness starts during an episode, or one started after the step, sees no key."""
    import os

    import vf_judge_env

    row, _, key, after = judged_step(tmp_path, tiny_model_dir)
    assert row["agent/failed"] == 0 and row["agent/calls_mean"] == 4
    assert key not in os.environ.values() and key not in after
    assert vf_judge_env.CHILD_ENV == [{}] * 8  # 4 episodes x (policy, judge)
