"""`rollout.source = "service"`: `ServiceRollouts` against a real `rollwise serve` (uvicorn thread, 127.0.0.1)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import read_rows, tiny_config
from test_serve import KEY, ScriptedEnv, trainer_logprobs

from rollwise.envs.episode import episode_metrics
from rollwise.generate.groups import new_groups
from rollwise.serve.app import RunningServer, create_app
from rollwise.serve.cli import build_service, load_engine
from rollwise.serve.client import ServiceError, ServiceRollouts
from rollwise.types import Prompt, SamplingParams, Status


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    cfg = tiny_config(tiny_model_dir)
    engine, tok = load_engine(cfg, tmp_path_factory.mktemp("serve"))
    service = build_service(cfg, engine, tok, str(tiny_model_dir), KEY)
    server = RunningServer(create_app(service))
    yield service, server, tok
    server.stop()
    service.worker.close()


def groups_of(tok, texts: list[str], per_prompt: int):
    from rollwise.data.prompts import encode_prompt

    prompts = [Prompt(f"p{i}", [{"role": "user", "content": t}], answer="10") for i, t in enumerate(texts)]
    return new_groups([(p, encode_prompt(p, tok, None)) for p in prompts], per_prompt, 0)


def test_single_turn_job_merges_exact_tokens_and_logprobs(served):
    service, server, tok = served
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=60)
    groups = groups_of(tok, ["What is 7 + 3?", "What is 2 + 8?"], 3)
    rollouts.submit(0, groups, SamplingParams(max_new_tokens=8, temperature=1.0))
    result = rollouts.wait(0)
    assert result.version == 0 and result.stats.requests == 6 and result.stats.groups_completed == 2
    model = service.worker.engine.model
    total = 0
    for g in groups:
        for s in g.samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and 1 <= len(s.response_ids) <= 8
            assert s.loss_mask == [1] * len(s.response_ids) and s.version_spans == [(0, len(s.response_ids), 0)]
            ref = trainer_logprobs(model, s.prompt_ids + s.response_ids, len(s.prompt_ids))
            assert torch.allclose(torch.tensor(ref), torch.tensor(s.behaviour_logprobs), atol=1e-4)
            assert s.response_text == tok.decode(s.response_ids, skip_special_tokens=True)
            total += len(s.response_ids)
    assert rollouts.stats.generated_tokens == total
    rollouts.close()


def test_continued_sample_keeps_its_tokens_and_offsets_spans(served):
    service, server, tok = served
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=60)
    [group] = groups_of(tok, ["What is 7 + 3?"], 1)
    sample = group.samples[0]
    sample.response_ids, sample.behaviour_logprobs = [280, 281], [-1.5, -2.5]
    sample.full_logprobs, sample.version_spans, sample.status = [-1.5, -2.5], [(0, 2, 7)], Status.ABORTED
    rollouts.submit(0, [group], SamplingParams(max_new_tokens=6, temperature=1.0, stop=("zzzz",)))
    rollouts.wait(0)
    assert sample.response_ids[:2] == [280, 281] and sample.behaviour_logprobs[:2] == [-1.5, -2.5]
    n = len(sample.response_ids)
    assert 3 <= n <= 6 and sample.version_spans == [(0, 2, 7), (2, n, 0)]
    ref = trainer_logprobs(service.worker.engine.model, sample.prompt_ids + sample.response_ids,
                           len(sample.prompt_ids) + 2)
    assert torch.allclose(torch.tensor(ref), torch.tensor(sample.behaviour_logprobs[2:]), atol=1e-4)
    rollouts.close()


def test_episode_job_merges_mask_turns_and_episode_state(served):
    service, server, tok = served
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=60, env="test_serve:scripted_env",
                               max_episode_tokens=96)
    groups = groups_of(tok, ["What is 6 * 7?"], 2)
    rollouts.submit(0, groups, SamplingParams(max_new_tokens=6, temperature=1.0))
    rollouts.wait(0)
    for s in groups[0].samples:
        assert len(s.response_ids) == len(s.loss_mask) == len(s.behaviour_logprobs)
        policy = {i for a, b, role in s.turns if role == "assistant" for i in range(a, b)}
        assert s.loss_mask == [int(i in policy) for i in range(len(s.response_ids))]
        assert s.episode is not None and s.episode.messages[0]["content"] == "What is 6 * 7?"
        assert s.response_text == s.episode.final_text
    metrics = episode_metrics(groups[0].samples)
    assert metrics["episode/n"] == 2.0 and metrics["episode/turns_mean"] >= 1.0
    rollouts.close()


def test_push_weights_and_stale_server(served, tiny_model_dir):
    service, server, tok = served
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=60)
    model = service.worker.engine.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        rollouts.push_weights(state, 1)
        assert service.worker.version == 1 and rollouts.version == 1
        rollouts.submit(0, groups_of(tok, ["hi"], 1), SamplingParams(max_new_tokens=2), min_version=2)
        with pytest.raises(ServiceError, match="served policy version 1, the run needs >= 2"):
            rollouts.wait(0)
    finally:
        service.worker.engine.version = 0  # the module's other tests expect version 0
        rollouts.close()


def test_errors_are_one_clear_line(served):
    service, server, tok = served
    with pytest.raises(ServiceError, match="is `rollwise serve` running"):
        ServiceRollouts("http://127.0.0.1:9", KEY, tok, timeout_s=5)
    with pytest.raises(ServiceError, match="rollout.service_url"):
        ServiceRollouts("localhost:8765", KEY, tok)
    wrong = ServiceRollouts(server.url, "wrong", tok, timeout_s=10)
    wrong.submit(0, groups_of(tok, ["hi"], 1), SamplingParams(max_new_tokens=2))
    with pytest.raises(ServiceError, match=r"HTTP 401: .*rollout.service_api_key") as info:
        wrong.wait(0)
    assert "\n" not in str(info.value)
    with pytest.raises(ServiceError, match="partial rollouts"):
        wrong.submit(1, [], SamplingParams(), stop=object())


def test_no_key_anywhere_is_one_line_naming_the_variable(served, monkeypatch):
    _, server, tok = served
    monkeypatch.delenv("ROLLWISE_API_KEY", raising=False)
    with pytest.raises(ServiceError) as info:
        ServiceRollouts(server.url, None, tok, timeout_s=10)
    assert "set $ROLLWISE_API_KEY" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setenv("ROLLWISE_API_KEY", KEY)  # the environment is enough
    rollouts = ServiceRollouts(server.url, None, tok, timeout_s=10)
    rollouts.submit(0, groups_of(tok, ["hi"], 1), SamplingParams(max_new_tokens=2))
    assert rollouts.wait(0).stats.requests == 1
    rollouts.close()


def test_request_timeout_cancels_the_job(served):
    service, server, tok = served
    service._envs[("slow", 4)] = ScriptedEnv(4, step_s=2.0)
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=0.5, env="slow", max_episode_tokens=96)
    rollouts.submit(0, groups_of(tok, ["x"], 1), SamplingParams(max_new_tokens=4))
    began = time.monotonic()
    with pytest.raises(ServiceError, match="request_timeout_s = 0.5 s; cancelled it"):
        rollouts.wait(0)
    assert time.monotonic() - began < 5
    deadline = time.monotonic() + 30
    while service.worker.running is not None:  # the cancelled job ends on the server too
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rollouts.close()


def test_two_step_training_run_against_the_service(tiny_model_dir, tmp_path):
    from rollwise.loop import train

    cfg = tiny_config(tiny_model_dir)
    engine, tok = load_engine(cfg, tmp_path / "serve")
    service = build_service(cfg, engine, tok, str(tiny_model_dir), KEY)
    server = RunningServer(create_app(service))
    try:
        run_cfg = tiny_config(tiny_model_dir, **{"rollout.source": "service", "rollout.service_url": server.url,
                                                 "rollout.service_api_key": KEY, "eval.n": 0})
        train(run_cfg, tmp_path / "run")
        rows = [r for r in read_rows(tmp_path / "run") if r.get("kind") == "train"]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["rollout/tokens"] > 0 for r in rows)
        assert service.worker.version == 2  # the trainer pushed its policy after each step
        assert service.worker.counters["weight_updates"] == 2 and service.worker.counters["completions"] >= 8
    finally:
        server.stop()
        service.worker.close()


class NanPartEnv(ScriptedEnv):
    """ScriptedEnv whose tool turn reports a NaN reward part (a broken verifier inside an environment)."""

    def step(self, state, text):
        result = super().step(state, text)
        result.reward_parts = {"tool_calls": float("nan")}
        return result


def test_a_nan_reward_part_is_served_and_comes_back_as_nan(served):
    import math

    service, server, tok = served
    service._envs[("nanparts", 4)] = NanPartEnv(2)
    rollouts = ServiceRollouts(server.url, KEY, tok, timeout_s=60, env="nanparts", max_episode_tokens=96)
    groups = groups_of(tok, ["What is 6 * 7?"], 1)
    rollouts.submit(0, groups, SamplingParams(max_new_tokens=4, temperature=1.0))
    rollouts.wait(0)  # the job's JSON used to fail to render (HTTP 500): JSON has no NaN
    assert math.isnan(groups[0].samples[0].episode.parts["tool_calls"])
    rollouts.close()
