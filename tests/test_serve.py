"""`rollwise serve`: a real uvicorn server on 127.0.0.1 (a thread of this process) over a tiny random model,
driven by the real `openai` client and plain httpx.

Exactness is checked two ways: against the engine's own `generate` with the same seed (identical ids and
log-probs), and against a trainer forward pass at temperature 1 (fp32, 1e-4).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer


from rollwise.validate import load
from rollwise.data.prompts import encode_prompt
from rollwise.envs.base import StepResult
from rollwise.generate.torch_engine import TorchEngine
from rollwise.serve.app import RunningServer, create_app
from rollwise.serve.cli import build_service
from rollwise.types import GenerationRequest, Prompt, SamplingParams, ToolCall

KEY = "test-key-123"
TOOL_TEXT = "result: 42"


class ScriptedEnv:
    """Two assistant turns whatever the policy writes: a tool message after the first, done after the second.
    `step_s` makes each step slow (to catch a job while it runs)."""

    name = "scripted"
    stop = tuple("aeiou ")  # ends a turn of the random tiny model within a few tokens (so turns complete)

    def __init__(self, max_turns: int = 2, step_s: float = 0.0, fail: bool = False):
        self.max_turns = max_turns
        self.step_s = step_s
        self.fail = fail

    def reset(self, prompt):
        if self.fail:
            raise RuntimeError("the sandbox is gone")
        time.sleep(self.step_s)
        return {"turn": 0}

    def step(self, state, text):
        time.sleep(self.step_s)
        state["turn"] += 1
        if state["turn"] >= 2:
            return StepResult(done=True, reward_parts={"tool_calls": 0.0})
        call = ToolCall("calc", {"query": "6*7"}, state["turn"] - 1, result=TOOL_TEXT)
        return StepResult(messages=[{"role": "tool", "content": TOOL_TEXT}], reward_parts={"tool_calls": 1.0},
                          tool_calls=[call])


def scripted_env(cfg):
    return ScriptedEnv(cfg.max_turns, **cfg.options)


def trainer_logprobs(model, ids: list[int], start: int) -> list[float]:
    """Log-probs at temperature 1 of ids[start:] given what precedes each (fp32 forward of the whole sequence)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L-1]
    return logp[start - 1:].tolist()


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model, tok


def start(tiny, **serve):
    model, tok = tiny
    overrides = [f"serve.{k}={v}" for k, v in serve.items()]
    cfg = load(None, overrides + ['env.options={}', "env.max_episode_tokens=96", "rollout.max_new_tokens=8"])
    service = build_service(cfg, TorchEngine(model, tok, max_batch_size=64), tok, "tiny", KEY)
    server = RunningServer(create_app(service))
    return service, server


@pytest.fixture(scope="module")
def served(tiny):
    service, server = start(tiny)
    yield service, server
    server.stop()
    service.worker.close()


def client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def wait_job(http: httpx.Client, job_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = http.get(f"/v1/episodes/{job_id}").json()
        if state["status"] not in ("queued", "running"):
            return state
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} still {state['status']} after {timeout_s} s")


def test_openai_client_token_ids_and_logprobs_round_trip(tiny, served):
    from openai import OpenAI

    model, tok = tiny
    _, server = served
    api = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    prompt = [int(i) for i in tok("What is 7 + 3?")["input_ids"]]
    out = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=2,
                                 logprobs=1)
    assert out.model_extra["policy_version"] == 0
    # the engine's own generate on the same seed: identical ids and log-probs
    engine = TorchEngine(model, tok, max_batch_size=64)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
    ref = engine.generate([GenerationRequest(i, prompt, params) for i in range(2)])
    for choice, r in zip(out.choices, ref):
        ids, lps = choice.model_extra["token_ids"], choice.model_extra["token_logprobs"]
        assert ids == r.response_ids and lps == r.logprobs
        assert choice.logprobs.token_logprobs == lps
        assert choice.text == r.text
        assert choice.model_extra["version_spans"] == [[0, len(ids), 0]]
        # a trainer forward pass at temperature 1 gives the same log-probs
        assert torch.allclose(torch.tensor(trainer_logprobs(model, prompt + ids, len(prompt))), torch.tensor(lps),
                              atol=1e-4)


def test_chat_completions_return_the_prompt_ids_trained_on(tiny, served):
    from openai import OpenAI

    model, tok = tiny
    _, server = served
    api = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "How many letters are in the word 'banana'?"}]
    out = api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0)
    prompt_ids = out.model_extra["prompt_token_ids"]
    assert prompt_ids == encode_prompt(Prompt("x", messages), tok, None)
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    greedy = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].argmax().item()
    assert ids[0] == greedy  # temperature 0 is greedy
    assert [c.logprob for c in choice.logprobs.content] == choice.model_extra["token_logprobs"]
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)


def test_wrong_or_missing_token_gets_401(served):
    _, server = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401, headers
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # no token needed
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="wrong").completions.create(model="tiny", prompt="hi")


@pytest.mark.parametrize("path,body,words", [
    ("/v1/completions", {"prompt": []}, "prompt is empty"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"prompt": [3, 10**6]}, "out of the vocabulary"),
    ("/v1/completions", {"prompt": [3, -1]}, "out of the vocabulary"),
    ("/v1/completions", {"prompt": [3, 1.5]}, "not a token id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be > 0"),
    ("/v1/completions", {"prompt": [5] * 600}, "over the model's context of 512"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream": True}, "stream"),
    ("/v1/completions", {}, "prompt is required"),
    ("/v1/chat/completions", {"messages": []}, "messages must be"),
    ("/v1/episodes", {"env": "no-such-env", "prompts": [{"prompt": "x"}]}, "unknown environment 'no-such-env'"),
    ("/v1/episodes", {"env": "calc", "prompts": []}, "prompts must be"),
    ("/v1/episodes", {"env": "calc", "prompts": [{"answer": "1"}]}, "prompts[0] needs"),
])
def test_bad_requests_get_400_with_one_line(served, path, body, words):
    _, server = served
    r = client(server).post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message and "Traceback" not in message


def test_non_json_body_and_unknown_job(served):
    _, server = served
    http = client(server)
    r = http.post("/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = http.get("/v1/episodes/ep-missing")
    assert r.status_code == 404 and "ep-missing" in r.json()["error"]["message"]


def test_32_concurrent_requests_are_all_answered_and_batched(tiny, served):
    model, tok = tiny
    service, server = served
    calls_before = service.worker.counters["generate_calls"]
    answers: dict[int, dict] = {}

    def ask(i: int) -> None:
        with client(server) as http:
            r = http.post("/v1/completions", json={"prompt": [5 + i, 7, 9], "max_tokens": 6, "seed": i})
            answers[i] = r.json() if r.status_code == 200 else {"status": r.status_code}

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert time.monotonic() - began < 120
    assert sorted(answers) == list(range(32))
    for i, answer in answers.items():
        ids = answer["choices"][0]["token_ids"]
        assert len(ids) >= 1
        lps = answer["choices"][0]["token_logprobs"]
        assert torch.allclose(torch.tensor(trainer_logprobs(model, [5 + i, 7, 9] + ids, 3)), torch.tensor(lps),
                              atol=1e-4)
    assert service.worker.counters["generate_calls"] - calls_before < 32  # requests shared engine calls


def test_full_queue_answers_503(tiny):
    service, server = start(tiny, max_queued_requests=1)
    try:
        service._envs[("slow", 2)] = ScriptedEnv(2, step_s=1.0)
        http = client(server)
        job = http.post("/v1/episodes", json={"env": "slow", "max_turns": 2, "prompts": [{"prompt": "x"}]}).json()
        deadline = time.monotonic() + 30
        while http.get(f"/v1/episodes/{job['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        queued = threading.Thread(target=lambda: client(server).post("/v1/completions", json={"prompt": "hi"}))
        queued.start()
        while http.get("/health").json()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "max_queued_requests = 1" in r.json()["error"]["message"]
        queued.join(60)
    finally:
        server.stop()
        service.worker.close()


def test_episode_tokens_mask_and_logprobs_are_exact(tiny, served):
    model, tok = tiny
    _, server = served
    http = client(server)
    body = {"env": "test_serve:scripted_env", "prompts": [{"prompt": "What is 6 * 7?", "answer": "42"}],
            "samples_per_prompt": 2, "max_tokens": 6, "temperature": 1.0}
    job = http.post("/v1/episodes", json=body)
    assert job.status_code == 202 and job.json()["status"] == "queued"
    state = wait_job(http, job.json()["id"])
    assert state["status"] == "done", state
    assert len(state["episodes"]) == 2
    for ep in state["episodes"]:
        ids, mask, lps = ep["response_ids"], ep["loss_mask"], ep["logprobs"]
        assert len(ids) == len(mask) == len(lps)
        (a0, a1, r0), (t0, t1, _), (u0, u1, _), (b0, b1, r1) = ep["turns"][0], ep["turns"][1], ep["turns"][2], \
            ep["turns"][3]
        assert (r0, r1) == ("assistant", "assistant") and a0 == 0 and a1 <= t0 and t1 == u0 and u1 == b0
        assert b1 == len(ids)
        policy = set(range(a0, a1)) | set(range(b0, b1))
        assert mask == [1 if i in policy else 0 for i in range(len(ids))]
        assert TOOL_TEXT in tok.decode(ids[u0:u1])  # the tool message, as tokens with mask 0
        assert ep["transcript"][-2] == {"role": "tool", "content": TOOL_TEXT}
        assert ep["tool_calls"][0]["result"] == TOOL_TEXT and ep["reward_parts"] == {"tool_calls": 1.0}
        spans = ep["version_spans"]
        assert spans == [[a0, a1, 0], [b0, b1, 0]]
        reference = trainer_logprobs(model, ep["prompt_ids"] + ids, len(ep["prompt_ids"]))
        for i in sorted(policy):
            assert abs(reference[i] - lps[i]) < 1e-4, i


def test_client_disconnect_loses_no_job(served):
    """A client posts a job over a raw socket and hangs up before reading the answer: the job still runs and
    a new client finds it (GET /v1/episodes) and fetches its result."""
    _, server = served
    http = client(server)
    before = {j["id"] for j in http.get("/v1/episodes").json()["data"]}
    payload = (b'{"env": "test_serve:scripted_env", "prompts": [{"prompt": "What is 6 * 7?"}], '
               b'"samples_per_prompt": 2, "max_tokens": 5}')
    request = (f"POST /v1/episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
    deadline = time.monotonic() + 30
    while not (new := [j for j in http.get("/v1/episodes").json()["data"] if j["id"] not in before]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    state = wait_job(http, new[0]["id"])
    assert state["status"] == "done" and len(state["episodes"]) == 2


def test_client_gone_mid_episode_then_fetched_by_another(tiny):
    service, server = start(tiny)
    try:
        service._envs[("slow", 2)] = ScriptedEnv(2, step_s=0.3)
        first = client(server)
        job = first.post("/v1/episodes", json={"env": "slow", "max_turns": 2, "prompts": [{"prompt": "x"}],
                                               "max_tokens": 4}).json()
        while first.get(f"/v1/episodes/{job['id']}").json()["status"] == "queued":
            time.sleep(0.01)
        first.close()  # gone while the episode runs
        state = wait_job(client(server), job["id"])
        assert state["status"] == "done" and len(state["episodes"]) == 1 and state["run_s"] >= 0.3
    finally:
        server.stop()
        service.worker.close()


def test_cancel_running_and_queued_jobs(tiny):
    service, server = start(tiny)
    try:
        service._envs[("slow", 2)] = ScriptedEnv(2, step_s=0.5)
        http = client(server)
        body = {"env": "slow", "max_turns": 2, "prompts": [{"prompt": "x"}], "max_tokens": 4}
        running, queued = http.post("/v1/episodes", json=body).json(), http.post("/v1/episodes", json=body).json()
        assert http.post(f"/v1/episodes/{queued['id']}/cancel").json()["status"] == "cancelled"
        while http.get(f"/v1/episodes/{running['id']}").json()["status"] == "queued":
            time.sleep(0.01)
        assert http.post(f"/v1/episodes/{running['id']}/cancel").status_code == 200
        assert wait_job(http, running["id"])["status"] == "cancelled"
        assert http.get(f"/v1/episodes/{queued['id']}").json()["status"] == "cancelled"
    finally:
        server.stop()
        service.worker.close()


def test_failed_job_says_why_and_server_goes_on(served):
    service, server = served
    service._envs[("broken", 4)] = ScriptedEnv(fail=True)
    http = client(server)
    job = http.post("/v1/episodes", json={"env": "broken", "prompts": [{"prompt": "x"}]}).json()
    state = wait_job(http, job["id"])
    assert state["status"] == "failed" and state["error"] == "RuntimeError: the sandbox is gone"
    assert "episodes" not in state
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_weights_push_changes_the_policy_and_version(tiny, tmp_path):
    from safetensors.torch import save, save_file

    model, tok = tiny
    service, server = start(tiny, weights_root=tmp_path)
    try:
        other = tiny_llama(len(tok), seed=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        state = {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}
        http = client(server)
        r = http.post("/v1/weights?version=3", content=save(state),
                      headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 200 and r.json()["policy_version"] == 3
        out = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}).json()
        assert out["policy_version"] == 3 and out["choices"][0]["version_spans"][0][2] == 3
        ids = out["choices"][0]["token_ids"]
        assert torch.allclose(torch.tensor(trainer_logprobs(other, [5, 6, 7] + ids, 3)),
                              torch.tensor(out["choices"][0]["token_logprobs"]), atol=1e-4)
        # a folder under serve.weights_root on the shared file system, as JSON
        (tmp_path / "v4").mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                  tmp_path / "v4" / "model.safetensors")
        r = http.post("/v1/weights", json={"path": str(tmp_path / "v4"), "version": 4})
        assert r.status_code == 200 and r.json()["policy_version"] == 4
        # bad weights: 400 with the reason, the policy is left as it was
        r = http.post("/v1/weights?version=5", content=save({"nope.weight": torch.zeros(2)}),
                      headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and "nope.weight" in r.json()["error"]["message"]
        r = http.post("/v1/weights?version=5", content=b"garbage")
        assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
        r = http.post("/v1/weights", content=save(state), headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and "version" in r.json()["error"]["message"]
        assert http.get("/health").json()["policy_version"] == 4
        assert httpx.post(server.url + "/v1/weights?version=9", content=save(state)).status_code == 401
    finally:
        server.stop()
        service.worker.close()


@pytest.mark.slow
def test_serve_command_prints_url_and_token_and_stops_on_ctrl_c(tiny_model_dir):
    """`rollwise serve --model DIR --port 0` as a real process: URL and generated token on stdout, answers
    with that token, exits 0 on SIGINT."""
    import re
    import signal
    import subprocess

    from conftest import ROLLWISE, subprocess_env

    proc = subprocess.Popen([ROLLWISE, "serve", "--model", str(tiny_model_dir), "--port", "0", "model.threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    try:
        lines, url, token = [], None, None
        deadline = time.monotonic() + 90
        while (url is None or token is None) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            url = url or (m.group(1) if (m := re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)) else None)
            token = token or (m.group(1) if (m := re.search(r"token: (rw-\S+)", line)) else None)
        assert url and token, "".join(lines)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3},
                       headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
