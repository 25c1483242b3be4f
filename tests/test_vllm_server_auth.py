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


# -- rollout.engine_options may not move the launched server off loopback or around its key ---------------------
REBINDS = [{"host": "0.0.0.0"}, {"hos": "0.0.0.0"}, {"port": 8000}, {"uds": "/tmp/vllm.sock"}, {"grpc": True},
           {"grpc_port": 50051}, {"api_key": KEY}, {"api-k": KEY}, {"config": "/tmp/args.yaml"},
           {"served_model_name": "other"}, {"dtype": "float16"},
           {"Host": "0.0.0.0"}, {"host=0.0.0.0": True}, {"enforce_eager": "--host=0.0.0.0"}]


@pytest.mark.parametrize("options", REBINDS, ids=lambda o: next(iter(o)))
def test_engine_options_that_rebind_or_unkey_the_launched_server_are_refused(options, monkeypatch):
    """On the argument builder: one line naming the key and what to do, no value printed, no process started."""
    import subprocess

    from rollwise.generate.vllm_server import launch_vllm_server

    ((key, value),) = options.items()
    with pytest.raises(ServerEngineError) as info:
        server_command("/models/m", 8000, "float32", options)
    message = str(info.value)
    assert "\n" not in message
    assert f"rollout.engine_options.{key}" in message or f"rollout.engine_options: {key!r}" in message
    assert "remove" in message or "flag" in message
    assert not isinstance(value, str) or value not in message.replace(repr(key), "")  # no value printed

    def no_process(*args, **kwargs):
        raise AssertionError("a server process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ServerEngineError):
        launch_vllm_server("/models/m", port=8000, options=options, log_path="/dev/null")


def test_engine_options_that_rebind_are_refused_at_dry_run(tmp_path, monkeypatch):
    """Through the CLI's validation (`rollwise train --dry-run`), only for the server rollwise launches."""
    from typer.testing import CliRunner

    from rollwise.cli import app

    monkeypatch.chdir(tmp_path)
    base = ["train", "--dry-run", "rollout.engine=vllm"]
    result = CliRunner().invoke(app, [*base, "rollout.server=launch", 'rollout.engine_options={host = "0.0.0.0"}'])
    assert result.exit_code != 0
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert "rollout.engine_options.host (--host)" in line and "remove host" in line and "127.0.0.1" in line
    fine = CliRunner().invoke(app, [*base, "rollout.server=launch", "rollout.engine_options={enforce_eager = true}"])
    assert fine.exit_code == 0, fine.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_vllms_own_parser_keeps_the_launched_server_on_loopback_behind_its_key():
    """vLLM's parser (it takes unambiguous prefixes) reads rollwise's argv with allowed options as 127.0.0.1,
    the given port and the key middleware; no flag of vLLM's that is allowed is refused by mistake."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rollwise.generate.vllm_server import BIND_FLAGS, OWN_FLAGS, launch_option_errors

    parser = make_arg_parser(FlexibleArgumentParser())
    cmd = server_command("/models/m", 8123, "float32", {"enforce_eager": True, "max_model_len": 64,
                                                        "disable_log_stats": True, "gpu_memory_utilization": 0.3})
    args = parser.parse_args(cmd[3:])
    assert (args.host, args.port, args.uds, args.middleware) == ("127.0.0.1", 8123, None,
                                                                  ["rollwise.generate.vllm_server.RequireKey"])
    refused = {"api-key", *BIND_FLAGS, *OWN_FLAGS}
    flags = {o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")}
    assert refused <= flags, "a refused flag is no longer vLLM's"
    wrongly = [f for f in flags - refused if not f.startswith("no-") and launch_option_errors({f: 1})]
    assert not wrongly
