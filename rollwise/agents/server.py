"""The loopback OpenAI-compatible endpoint agent programs call: `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, on 127.0.0.1 (a free port), in a background thread.

Why not `rollwise serve`'s app (rollwise/serve/app.py): its worker thread owns its engine and answers each
batch when the whole batch ends, while here the engine is the run's own, driven by the trainer's thread
between its steps (the Sync stage and evaluation use it too), and every call belongs to an episode whose
tokens are recorded and answered as soon as that call finishes. So this app only authenticates, finds the
episode and hands the JSON body over (`submit`); validation, rendering, the engine and the reply all happen on
the thread that runs the episodes (`rollwise.agents.runner`), the one thread that touches the tokenizer.

Who a call belongs to: the Bearer token is the episode's own key (a plain program's client), or the run's key
(in the `X-Rollwise-Run-Key` header, or as the Bearer token) with the episode's key as `model` (a verifiers
environment, whose client is configured once); the `X-Session-ID` header (verifiers sends its trace id)
separates the conversations of one episode. The key is checked before a byte of the body is read (401), then
the body is read up to `agent.max_body_mb` (413: by its Content-Length before it is read, and by the bytes
received while it streams in, so a chunked body stops there too). Errors are OpenAI's `{"error": {"message",
"type", "code"}}`: 401 unknown key, 413 a body over the cap, 410 the episode is over (returned, timed out), 429
its call limit, 400 a bad request, 500 an engine error.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from typing import Callable

from fastapi import FastAPI, Request  # at module level: FastAPI reads the handlers' annotations from here
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

SESSION_HEADER = "x-session-id"
RUN_KEY_HEADER = "x-rollwise-run-key"  # the run's key, sent by a client configured once (verifiers)
# submit(key, model, session, body) -> a Future of (status, JSON dict)
Submit = Callable[[str, str, str, object], Future]
# known(key) -> whether the key may call at all (an episode's key or the run's): checked before the body is read
Known = Callable[[str], bool]
UNKNOWN_KEY = "unknown API key: use the client or key rollwise gave the episode"


class BodyTooLarge(Exception):
    """A request body over `agent.max_body_mb` (HTTP 413); the message is one line."""


def key_of(headers) -> str:
    """The caller's key: the run key header when sent, else the Bearer token ("" without either)."""
    run_key = headers.get(RUN_KEY_HEADER, "").strip()
    if run_key:
        return run_key
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def read_capped(request: Request, limit_mb: float) -> bytes:
    """The body, refused over `limit_mb` MiB: by its Content-Length before any byte is read, then by the bytes
    received (reading stops at the first chunk past the cap; a chunked body has no length)."""
    limit = int(limit_mb * 2**20)
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(_too_large(f"{int(declared)} bytes", limit_mb))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(_too_large(f"over {limit} bytes received", limit_mb))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit_mb: float) -> str:
    return (f"the request body ({size}) is over agent.max_body_mb = {limit_mb:g} MB: send a shorter conversation, "
            "or raise agent.max_body_mb")


def create_app(submit: Submit, model_name: str, known: Known, max_body_mb: float) -> FastAPI:
    app = FastAPI(title="rollwise agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "rollwise"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        key = key_of(request.headers)
        if not known(key):  # before the body: an unknown caller never makes this process read (or hold) it
            return error(401, UNKNOWN_KEY, "authentication_error")
        try:
            body = json.loads(await read_capped(request, max_body_mb))
        except BodyTooLarge as exc:
            return error(413, str(exc))
        except ClientDisconnect:  # the caller left mid-body: nobody reads an answer
            return error(400, "the client disconnected before its request body ended")
        except ValueError:
            return error(400, "the request body is not JSON")
        model = body.get("model", "") if isinstance(body, dict) else ""
        future = submit(key, str(model or ""), request.headers.get(SESSION_HEADER, ""), body)
        status, payload = await asyncio.wrap_future(future)
        if status != 200:
            kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
            return error(status, payload["message"], "server_error" if status >= 500 else kind)
        return JSONResponse(payload)

    return app


class LoopbackServer:
    """A uvicorn server for `app` on 127.0.0.1 in a daemon thread: `url` (ends in /v1), `stop()`."""

    def __init__(self, app, timeout_s: float = 30.0) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="rollwise-agent-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("rollwise agents: the loopback endpoint did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
