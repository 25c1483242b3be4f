"""`rollwise serve --api tinker` driven by the official `tinker` SDK (0.38), over HTTP, against a real server
subprocess on a tiny random model (tests/tinker_loops.py holds the user's loops, written against the SDK only).

What is checked: an SFT loop's loss falls (LoRA), an RL loop's reward rises (full fine-tuning, importance_sampling
and ppo, a deterministic toy reward), sampled log-probs equal the trainer's, saved state loads back identical
(in the same server, in a new client with the optimizer, and in a restarted server), unsupported calls fail with
a line that says so, and a request without the key is refused. The losses are checked by hand-computed numbers.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install 'rollwise[tinker]')")
pytest.importorskip("fastapi", reason="rollwise serve needs fastapi (pip install 'rollwise[serve]')")
pytest.importorskip("peft", reason="LoRA training clients need peft (pip install 'rollwise[tinker]')")

import tinker_loops as loops  # noqa: E402
from conftest import ROLLWISE, subprocess_env  # noqa: E402
from tinker import types  # noqa: E402

from rollwise.serve.protocol import BadRequest  # noqa: E402
from rollwise.serve.tinker_state import loss_options, tinker_loss  # noqa: E402
from rollwise.serve.tinker_wire import Datum, encode_forward_backward, encode_sample, Sequence  # noqa: E402

KEY = "tml-test-key-34"


class Server:
    """`rollwise serve --api tinker` as a subprocess; `url` once it listens, `stop()` by Ctrl-C."""

    def __init__(self, model_dir, state_dir, key: str = KEY):
        env = subprocess_env()
        env["ROLLWISE_SERVE_API_KEY"] = key
        self.proc = subprocess.Popen(
            [ROLLWISE, "serve", "--api", "tinker", "--model", str(model_dir), "--port", "0", "--device", "cpu",
             "model.threads=1", f"serve.tinker_state_dir={state_dir}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines, self.url = [], None
        deadline = time.monotonic() + 120
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"TINKER_BASE_URL=(http://127\.0\.0\.1:\d+)", line)
            self.url = m.group(1) if m else None
        if self.url is None:
            self.stop()
            raise AssertionError("rollwise serve --api tinker did not start:\n" + "".join(lines))

    def client(self, key: str = KEY):
        return tinker.ServiceClient(base_url=self.url, api_key=key)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.stdout.close()
        return self.proc.wait()


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker-state")


@pytest.fixture(scope="module")
def server(tiny_model_dir, state_dir):
    srv = Server(tiny_model_dir, state_dir)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def service(server):
    client = server.client()
    yield client
    client.close("success").result()


# -- the losses, by hand ------------------------------------------------------------------------------------

def _datum(**inputs) -> Datum:
    n = len(next(iter(inputs.values())))
    return Datum(list(range(n)), {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})


def test_tinker_losses_match_their_definitions_by_hand():
    """cross_entropy = -w logp; importance_sampling = -exp(logp - q) A; ppo = -min(r A, clip(r, 0.8, 1.2) A)."""
    logp = torch.tensor([[-1.0, -2.0]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    ce = tinker_loss("cross_entropy", logp, [_datum(weights=[1.0, 0.5])], valid, loss_options("cross_entropy", {}))
    torch.testing.assert_close(ce, torch.tensor([[1.0, 1.0]]))  # -1 * -1, -0.5 * -2
    rl = _datum(logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])  # ratios 1 and e^-1 = 0.3679
    is_loss = tinker_loss("importance_sampling", logp, [rl], valid, loss_options("importance_sampling", {}))
    torch.testing.assert_close(is_loss, torch.tensor([[-1.0, -math.exp(-1.0)]]))
    ppo = tinker_loss("ppo", logp, [rl], valid, loss_options("ppo", {}))
    torch.testing.assert_close(ppo, torch.tensor([[-1.0, -math.exp(-1.0)]]))  # A > 0: min(0.368, 0.8) = 0.368
    neg = _datum(logprobs=[-1.0, -1.0], advantages=[-1.0, -1.0])  # A < 0: min(-0.368, -0.8) = -0.8
    ppo = tinker_loss("ppo", logp, [neg], valid, loss_options("ppo", {}))
    torch.testing.assert_close(ppo, torch.tensor([[1.0, 0.8]]))
    tight = tinker_loss("ppo", logp, [neg], valid, loss_options("ppo", {"clip_low_threshold": 0.9,
                                                                       "clip_high_threshold": 1.1}))
    torch.testing.assert_close(tight, torch.tensor([[1.0, 0.9]]))
    with pytest.raises(BadRequest, match="not used by cross_entropy"):
        loss_options("cross_entropy", {"clip_low_threshold": 0.9})


def test_wire_results_decode_with_the_sdks_own_decoders():
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    out = deserialize_forward_backward_output(encode_forward_backward(
        [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-3.0])}], {"loss:sum": 6.0}))
    assert out.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    sample = deserialize_sample_response(encode_sample([Sequence([5, 6], [-0.5, -0.25], True)], [None, -1.5]))
    seq = sample.sequences[0]
    assert (seq.tokens, seq.logprobs, seq.stop_reason) == ([5, 6], [-0.5, -0.25], "stop")
    assert sample.prompt_logprobs == [None, -1.5]


# -- the SDK against the server -----------------------------------------------------------------------------

def test_sft_loss_falls_and_saved_state_loads_back_identical(service, tiny_model_dir):
    client, losses = loops.sft(service, str(tiny_model_dir), rank=8, steps=5, lr=1e-2)
    assert losses[-1] < losses[0] - 0.3, losses
    assert client.get_info().lora_rank == 8
    probe = [loops.sft_datum(client.get_tokenizer().encode(t)) for t in loops.SFT_TEXTS]
    path = client.save_state("sft-5").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/sft-5")
    saved = loops.forward_logprobs(client, probe)
    # with the optimizer state: one more step here and one in a client created from the state agree exactly
    twin = service.create_training_client_from_state_with_optimizer(path).result()
    for c in (client, twin):
        c.forward_backward(probe, "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    stepped = loops.forward_logprobs(client, probe)
    assert stepped != saved
    assert loops.forward_logprobs(twin, probe) == stepped
    fresh = service.create_training_client_from_state(path).result()  # weights only
    assert loops.forward_logprobs(fresh, probe) == saved
    with pytest.warns(FutureWarning):
        client.load_state(path).result()  # deprecated in the SDK, still served
    assert loops.forward_logprobs(client, probe) == saved


def test_rl_reward_rises(service, tiny_model_dir):
    """Full fine-tuning (rank 0) on a toy reward, importance_sampling then ppo: the mean reward of the last two
    steps is well above the first two (deterministic: seeded sampling, one CPU thread)."""
    for loss_fn, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.8,
                                                                      "clip_high_threshold": 1.2})):
        _, rewards = loops.rl(service, str(tiny_model_dir), ["Count:"], loops.even_share, rank=0, lr=0.05, steps=8,
                              loss_fn=loss_fn, loss_fn_config=config)
        assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.25, (loss_fn, rewards)


def test_sampled_logprobs_are_the_trainers(service, tiny_model_dir):
    """At temperature 1 the sampler's log-probs, compute_logprobs and forward() agree (fp32, one CPU)."""
    client = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    client.forward_backward([loops.sft_datum([5, 9, 17, 33, 60])], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()  # the adapters are no longer zero
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = [5, 9, 17]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=5, seed=1)).result()
    assert len(res.sequences) == 3 and all(len(s.tokens) == len(s.logprobs) >= 1 for s in res.sequences)
    data = [loops.rl_datum(prompt, s, 0.0) for s in res.sequences]
    for seq, lp in zip(res.sequences, loops.forward_logprobs(client, data)):
        torch.testing.assert_close(torch.tensor(lp[len(prompt) - 1:]), torch.tensor(seq.logprobs))
        full = prompt + seq.tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert scored[0] is None
        torch.testing.assert_close(torch.tensor(scored[1:]), torch.tensor(lp))  # full[1:] given what precedes
    # training on: the old sampling client keeps its weights (a snapshot), a new one has the new weights
    client.forward_backward([loops.sft_datum(prompt + s.tokens) for s in res.sequences], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=5, seed=1))
    assert [s.tokens for s in again.result().sequences] == [s.tokens for s in res.sequences]
    base = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    assert base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=3)).result()


def test_concurrent_samples_batch_and_sample_what_they_would_alone(service, tiny_model_dir):
    """Sample calls sent together run as one engine call; each seeded call gets what it gets alone, and one
    bad call fails alone."""
    client = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompts = [[5, 9], [17, 33, 60], [7]]

    def params(i):
        return types.SamplingParams(max_tokens=5, seed=10 + i)

    together = [sampler.sample(types.ModelInput.from_ints(p), 3, params(i)) for i, p in enumerate(prompts)]
    too_long = sampler.sample(types.ModelInput.from_ints([5] * 510), 1, types.SamplingParams(max_tokens=8))
    together = [f.result() for f in together]
    with pytest.raises(tinker.RequestFailedError, match="over the model's context of 512 tokens"):
        too_long.result()
    alone = [sampler.sample(types.ModelInput.from_ints(p), 3, params(i)).result() for i, p in enumerate(prompts)]
    for a, b in zip(together, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs))


def test_unsupported_calls_fail_with_a_clear_message(server, service, tiny_model_dir):
    client = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
    datum = loops.sft_datum([5, 9, 17])
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'cispo' is not supported by rollwise serve"):
        client.forward_backward([datum], "cispo").result()
    client = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
    bad = types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": [9, 17]})
    with pytest.raises(tinker.BadRequestError, match=r"lacks \['logprobs', 'advantages'\]"):
        client.forward_backward([bad], "importance_sampling").result()
    sampler = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs is not supported"):
        sampler.sample(types.ModelInput.from_ints([5]), 1, types.SamplingParams(max_tokens=2),
                       topk_sample_logprobs=2).result()
    with pytest.raises(tinker.NotFoundError, match="is not supported by rollwise serve --api tinker"):
        tinker.RestClient(base_url=server.url, api_key=KEY).list_training_runs().result()
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint path of this server"):
        service.create_training_client_from_state("tinker://elsewhere/checkpoints/x").result()


def test_body_limit_and_key_as_rollwise_serve(tmp_path):
    """serve.max_body_mb bounds every body (413, one line naming the key) and every route but healthz needs the
    key; an in-process server this time (the same app the command serves)."""
    from rollwise.config import ServeConfig
    from rollwise.serve.app import RunningServer
    from rollwise.serve.tinker_api import TinkerService, create_tinker_app

    service = TinkerService(KEY, ServeConfig(max_body_mb=0.01), tmp_path, torch.device("cpu"), "unused")
    server = RunningServer(create_tinker_app(service))
    try:
        big = b"\0" * 20_000
        r = httpx.post(server.url + "/api/v1/forward_backward", content=big, headers={"X-API-Key": KEY})
        assert r.status_code == 413 and "serve.max_body_mb = 0.01" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/api/v1/forward_backward", content=big)
        assert r.status_code == 401
        r = httpx.post(server.url + "/api/v1/forward_backward", content=b"not a proto", headers={"X-API-Key": KEY,
                       "Content-Type": "application/x-protobuf"})
        assert r.status_code == 400 and "not a ForwardBackwardRequest" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/api/v1/retrieve_future", json={"request_id": "req-x"}, headers={"X-API-Key": KEY})
        assert r.status_code == 404 and "no future 'req-x'" in r.json()["error"]["message"]
        r = httpx.get(server.url + "/v1/models")
        assert r.status_code == 404 and "the Tinker API is under /api/v1" in r.json()["error"]["message"]
    finally:
        server.stop()
        service.close()


def test_a_call_longer_than_the_long_poll_is_polled_again(monkeypatch, tiny_model_dir, tmp_path):
    """retrieve_future answers 408 try_again while the call runs; the SDK polls again and gets the result."""
    from rollwise.config import ServeConfig
    from rollwise.serve import tinker_api
    from rollwise.serve.app import RunningServer

    monkeypatch.setattr(tinker_api, "LONG_POLL_S", 0.01)
    service = tinker_api.TinkerService(KEY, ServeConfig(), tmp_path, torch.device("cpu"), str(tiny_model_dir))
    server = RunningServer(tinker_api.create_tinker_app(service))
    try:
        sdk = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        client = sdk.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
        assert client.forward([loops.sft_datum([5, 9, 17])], "cross_entropy").result().metrics["loss:sum"] > 0
        sdk.close("success").result()
    finally:
        server.stop()
        service.close()


def test_a_key_the_sdk_would_not_send_is_refused_at_start(tiny_model_dir):
    from rollwise.config import ConfigError
    from rollwise.serve.cli import tinker_serve_command

    with pytest.raises(ConfigError, match="only API keys that start with 'tml-'"):
        tinker_serve_command(None, ["model.threads=1"], None, 0, "sk-123", str(tiny_model_dir))


def test_requests_without_the_key_are_refused(server):
    assert httpx.get(server.url + "/api/v1/healthz").json() == {"status": "ok"}
    for headers in ({}, {"X-API-Key": "tml-wrong"}, {"Authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/api/v1/create_session", json={}, headers=headers)
        assert r.status_code == 401 and "missing or wrong API key" in r.json()["error"]["message"]
    with pytest.raises(tinker.AuthenticationError):
        server.client("tml-wrong").create_lora_training_client(base_model="x", rank=1)


def test_custom_loss_and_saved_sampler_weights(service, tiny_model_dir):
    """forward_backward_custom (run by the SDK through forward + forward_backward) gives the loss it computed;
    sampler weights saved by name sample exactly what the in-memory snapshot samples."""
    client = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    data = [loops.sft_datum([5, 9, 17, 33, 60]), loops.sft_datum([7, 8, 9])]
    forward = client.forward(data, "cross_entropy").result()
    plain = forward.metrics["loss:sum"]
    assert plain == pytest.approx(-sum(o["logprobs"].to_numpy().sum() for o in forward.loss_fn_outputs), rel=1e-6)
    out = client.forward_backward_custom(data, lambda d, lps: (sum(-lp.sum() for lp in lps), {})).result()
    assert out.metrics["loss:sum"] == pytest.approx(plain, rel=1e-6)
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = client.save_weights_for_sampler("after-custom").result().path
    assert path.endswith("/sampler_weights/after-custom")
    params = types.SamplingParams(max_tokens=6, seed=3)
    prompt = types.ModelInput.from_ints([5, 9])
    snapshot = client.save_weights_and_get_sampling_client().result().sample(prompt, 2, params).result()
    saved = service.create_sampling_client(model_path=path).result().sample(prompt, 2, params).result()
    assert [s.tokens for s in saved.sequences] == [s.tokens for s in snapshot.sequences]
    for a, b in zip(saved.sequences, snapshot.sequences):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@pytest.mark.slow
def test_embedded_model_learns_a_builtin_task(tmp_path):
    """The embedded SmolLM2-135M-Instruct with LoRA, trained by the SDK-only RL loop (importance_sampling) on
    fresh training prompts of the built-in arith task every step, scored by that task's own reward: its greedy
    accuracy on the task's held-out prompts (none of them a training prompt) rises, well beyond noise."""
    from rollwise.config import DataConfig
    from rollwise.data.tasks import task_factory
    from rollwise.rewards.verifiers import REWARDS
    from rollwise.types import Sample, Status

    steps, per_step, group, max_tokens = 10, 6, 8, 16  # 48 samples of at most 16 tokens a step
    task = task_factory("arith")(DataConfig(split="fact"), 0)  # 1-digit + and -; held out by fact: no problem in any wording
    held_out = task.eval_prompts(48)
    train = [task.train_prompt(i) for i in range(steps * per_step)]  # a new 6 every step, never seen again
    prompts = {p.messages[-1]["content"]: p for p in held_out + train}
    held_texts = [p.messages[-1]["content"] for p in held_out]
    train_texts = [p.messages[-1]["content"] for p in train]
    assert len(set(held_texts)) == 48 and not set(held_texts) & set(train_texts)
    score = REWARDS.get("arith")

    def reward(prompt: str, tokens: list[int], text: str) -> float:
        sample = Sample(prompts[prompt], [], tokens, [], [], Status.COMPLETED, 0, response_text=text)
        return score(sample).value

    server = Server("smollm2-135m-instruct", tmp_path)
    try:
        service = server.client()
        client = service.create_lora_training_client(base_model="smollm2-135m-instruct", rank=16, seed=0).result()
        before, _ = loops.greedy_accuracy(client, held_texts, reward, max_tokens, chat=True)
        _, rewards = loops.rl(service, "smollm2-135m-instruct",
                              lambda step: train_texts[step * per_step:(step + 1) * per_step], reward,
                              steps=steps, group=group, lr=1e-3, max_tokens=max_tokens, chat=True, client=client)
        after, answers = loops.greedy_accuracy(client, held_texts, reward, max_tokens, chat=True)
        service.close("success").result()
    finally:
        assert server.stop() == 0
    print(f"arith held-out greedy accuracy {before:.3f} -> {after:.3f}; training reward per step:",  # pytest -s
          [round(r, 3) for r in rewards], "; held-out answers after:", answers[:6])
    assert after >= before + 0.15, (before, after, rewards)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]), rewards


def test_a_restarted_server_resumes_from_saved_state(server, service, tiny_model_dir, state_dir):
    """Runs last in this module: it closes the module's client and stops its server, then a new server process
    on the same state folder resumes the saved client (weights and optimizer) exactly."""
    client, _ = loops.sft(service, str(tiny_model_dir), rank=4, steps=2)
    probe = [loops.sft_datum(client.get_tokenizer().encode(t)) for t in loops.SFT_TEXTS]
    path = client.save_state("before-restart").result().path
    saved = loops.forward_logprobs(client, probe)
    client.forward_backward(probe, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stepped = loops.forward_logprobs(client, probe)
    service.close("success").result()
    assert server.stop() == 0
    second = Server(tiny_model_dir, state_dir)
    try:
        service = second.client()
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        assert loops.forward_logprobs(resumed, probe) == saved
        resumed.forward_backward(probe, "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert loops.forward_logprobs(resumed, probe) == stepped
        service.close("success").result()
    finally:
        assert second.stop() == 0
