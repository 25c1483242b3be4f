"""The key of the vLLM server rollwise launches, without vLLM: `RequireKey` (the middleware the launched server
runs) in front of a small fake of vLLM's routes (uvicorn thread, 127.0.0.1), and `VLLMServerEngine`, which must
send the key on every call: sampling, probes and every step of a weight sync. The real server is checked in
tests/test_scale_e2e.py (slow)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from helpers_tokenizer import tiny_tokenizer

from rollwise.generate.http_engine import ServerEngineError
from rollwise.generate.vllm_server import KEY_ENV, RequireKey, VLLMServerEngine, server_command
from rollwise.serve.app import RunningServer
from rollwise.types import GenerationRequest, SamplingParams

KEY = "launch-key-0123456789abcdef0123456789"


def fake_vllm(workers: list) -> FastAPI:
    """/v1/models, streamed /v1/completions (two tokens), and the dev routes of a sync; `workers` is what
    /collective_rpc answers for rollwise_version; `app.state.calls` records every path called."""
    app = FastAPI()
    app.state.calls = []

    @app.middleware("http")
    async def record(request: Request, call_next):
        app.state.calls.append(request.url.path)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "rollwise"}]}

    @app.post("/v1/completions")
    async def completions():
        chunks = [{"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": None}]},
                  {"choices": [{"token_ids": [8], "logprobs": {"token_logprobs": [-0.25]},
                                "finish_reason": "length"}]}]
        lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(lines), media_type="text/event-stream")

    @app.post("/collective_rpc")
    async def rpc(request: Request):
        body = await request.json()
        return {"results": workers if body["method"] == "rollwise_version" else [None]}

    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        app.add_api_route(path, lambda: {"success": True}, methods=["POST"])
    return app


@pytest.fixture
def guarded(monkeypatch):
    """The fake behind RequireKey (the key from $VLLM_API_KEY, as the launched server has it)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    app = fake_vllm(workers=[3])
    server = RunningServer(RequireKey(app))
    yield server, app
    server.stop()


def test_every_route_refuses_a_caller_without_the_key(guarded):
    server, app = guarded
    for path in ("/v1/models", "/collective_rpc", "/pause", "/health", "/nothing-here"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            assert httpx.post(server.url + path, headers=headers).status_code == 401, (path, headers)
    assert app.state.calls == []  # nothing reached the app
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_engine_sends_the_key_on_every_call(guarded):
    server, app = guarded
    tok = tiny_tokenizer()
    engine = VLLMServerEngine(server.url, tok, api_key=KEY, timeout_s=30)
    (res,) = engine.generate([GenerationRequest(0, [5, 6], SamplingParams(max_new_tokens=2))])
    assert res.response_ids == [7, 8] and res.logprobs == [-0.5, -0.25]
    engine.reload_from("/nowhere", 3)
    assert engine.version == 3 and engine.server_versions() == [3]
    assert app.state.calls == ["/v1/models", "/v1/completions", "/pause", "/collective_rpc", "/reset_prefix_cache",
                               "/resume", "/collective_rpc"]
    with pytest.raises(ServerEngineError, match="answered HTTP 401"):
        VLLMServerEngine(server.url, tok, api_key="wrong", timeout_s=30)


def test_the_key_comes_from_the_environment_for_a_server_run_elsewhere(guarded):
    server, _ = guarded  # $VLLM_API_KEY is set: a server the user started with it
    engine = VLLMServerEngine(server.url, tiny_tokenizer(), timeout_s=30)
    assert engine.model == "rollwise"


def test_no_worker_answering_is_not_an_agreement(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    server = RunningServer(RequireKey(fake_vllm(workers=[])))
    try:
        engine = VLLMServerEngine(server.url, tiny_tokenizer(), api_key=KEY, timeout_s=30)
        with pytest.raises(ServerEngineError, match="no worker answered"):
            engine.server_versions()
    finally:
        server.stop()


def test_the_middleware_refuses_to_start_without_a_key_and_the_key_never_goes_on_the_command_line(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"\$VLLM_API_KEY is not set"):
        RequireKey(fake_vllm([]))
    cmd = server_command("/models/m", 8000, "float32")
    assert cmd[cmd.index("--middleware") + 1] == "rollwise.generate.vllm_server.RequireKey"
    with pytest.raises(ServerEngineError, match="remove api_key"):
        server_command("/models/m", 8000, "float32", {"api_key": KEY})
