"""`rollwise serve`: the current policy behind an HTTP API (FastAPI), for external agents and remote trainers.

Routes (every one under /v1 needs `Authorization: Bearer <token>`; /health does not):

| route                              | what                                                                   |
|------------------------------------|------------------------------------------------------------------------|
| GET  /health                       | liveness, policy version, queue length, the engine (kind, device...)   |
| GET  /v1/models                    | the served model (OpenAI shape)                                        |
| POST /v1/completions               | OpenAI completions; `prompt` as text or token ids; + token ids, logprobs |
| POST /v1/chat/completions          | messages -> the chat template -> the same, + `prompt_token_ids`        |
| POST /v1/episodes                  | queue an episode job (env + prompts), ProRL Agent style -> `{id}`      |
| GET  /v1/episodes                  | the jobs kept (id, env, status)                                        |
| GET  /v1/episodes/{id}             | its status and, when done, the trajectories                            |
| POST /v1/episodes/{id}/cancel      | cancel it                                                              |
| POST /v1/weights                   | load new policy weights (safetensors body, or a path under weights_root) |

Errors are OpenAI's `{"error": {"message", "type", "code"}}` with a one-line message: 400 for a bad request,
401 for a missing or wrong token, 404 for an unknown job, 413 for a body or a prompt list over its limit
(`serve.max_body_mb`, `serve.max_weights_mb`, `serve.max_prompts_per_request`), 429 when
`serve.max_weight_uploads` uploads are already in progress, 503 when the queue is full or the engine thread
died (then `/health` answers 503 with `status: "dead"` and why); never a traceback.

A completion whose client disconnects while it waits is dropped from the queue, or its engine requests are
aborted if it runs (checked every `DISCONNECT_POLL_S`); the server goes on with the other requests.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rollwise.config import EnvConfig, ServeConfig
from rollwise.errors import one_line
from rollwise.serve.jobs import Completion, EpisodeJob, QueueFull, ServerStopped, Worker
from rollwise.serve.protocol import (MAX_N, BadRequest, Limits, chat_messages, chat_response, check_common,
                                     check_ids, check_length, check_prompt_count, completion_prompts,
                                     completion_response, engine_requests, parse_json, read_body, sampling_from)
from rollwise.serve.weights import read_weights
from rollwise.types import Prompt, SamplingParams

DISCONNECT_POLL_S = 0.2  # how often a waiting completion checks that its client is still connected


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Service:
    """What the routes need: the worker (which owns the engine), the tokenizer, the token and the limits
    (`serve_cfg`: body sizes, prompts per request, weight uploads, the weights root)."""

    worker: Worker
    tokenizer: object
    model_name: str
    api_key: str = field(repr=False)
    limits: Limits
    env_cfg: EnvConfig = field(default_factory=EnvConfig)
    system_prompt: str | None = None
    episode_max_tokens: int = 64  # per assistant turn, when a job does not say (rollout.max_new_tokens)
    serve_cfg: ServeConfig = field(default_factory=ServeConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # top_p, top_k, stop a request leaves out
    engine: dict = field(default_factory=dict)  # what generates (`rollwise.generate.factory.engine_summary`)
    weight_uploads: int = 0  # in progress now (changed on the event loop only)
    _envs: dict = field(default_factory=dict)
    _codec: object = None

    def env(self, name: str, max_turns: int | None):
        """The environment `name` (built once per name and turn limit); BadRequest for an unknown one."""
        from rollwise.envs import build_env
        from rollwise.envs.base import EnvError

        key = (name, max_turns or self.env_cfg.max_turns)
        if key not in self._envs:
            cfg = self.env_cfg.model_copy(update={"name": name, "max_turns": key[1]})
            try:
                self._envs[key] = build_env(cfg)
            except EnvError as exc:
                raise BadRequest(one_line(str(exc))) from None
        return self._envs[key]

    def codec(self):
        from rollwise.envs.episode import EpisodeCodec

        if self._codec is None:
            self._codec = EpisodeCodec(self.tokenizer, self.system_prompt)
        return self._codec


def limits_of(engine, tokenizer) -> Limits:
    """Vocabulary and context of the engine's model (the tokenizer's when the engine has no local model)."""
    config = engine.model.config if engine.caps.local_model else None
    vocab = getattr(config, "vocab_size", None) or len(tokenizer)
    context = getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
    return Limits(int(vocab), int(min(context, 1_000_000)))


def new_api_key() -> str:
    return "rw-" + secrets.token_urlsafe(24)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="rollwise serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
                            status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _starlette_error(request: Request, exc: HTTPException):
        return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                       "code": exc.status_code}}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return JSONResponse({"error": {"message": f"{where}: {first['msg']}" if where else first["msg"],
                                       "type": "invalid_request_error", "code": 400}}, status_code=400)

    def authorize(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), service.api_key.encode()):
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <token>' with the token "
                                 "`rollwise serve` printed (or serve.api_key, $ROLLWISE_SERVE_API_KEY)",
                           "authentication_error")

    async def body_of(request: Request) -> dict:
        authorize(request)
        try:
            body = parse_json(await read_body(request, service.serve_cfg.max_body_mb, "max_body_mb"))
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    async def run(future):
        """The result of work on the worker; user and server errors as HTTPError."""
        try:
            return await asyncio.wrap_future(future)
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        except ServerStopped as exc:
            raise HTTPError(503, str(exc), "server_error") from None
        except Exception as exc:  # the engine failed: one line, no traceback
            raise HTTPError(500, f"engine error: {type(exc).__name__}: {one_line(str(exc))}", "server_error") \
                from None

    async def complete(request: Request, work: Completion):
        """`work`'s result; if the client disconnects (or this handler is cancelled) first, the worker drops or
        aborts `work` and nobody is answered."""
        waiter = asyncio.wrap_future(work.future)
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
                if not waiter.done() and await request.is_disconnected():
                    service.worker.abandon(work)
                    waiter.cancel()
                    raise HTTPError(499, "the client closed the request")
        except asyncio.CancelledError:
            service.worker.abandon(work)
            raise
        return await run(waiter)

    def submit(fn, *args):
        try:
            return fn(*args)
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        except (QueueFull, ServerStopped) as exc:
            raise HTTPError(503, str(exc), "server_error") from None

    @app.get("/health")
    async def health():
        w = service.worker
        out = {"status": "ok", "model": service.model_name, "policy_version": w.version, "queued": w.queued(),
               "running_job": w.running.id if w.running is not None else None, "engine": service.engine}
        failure = w.failure()
        if failure is not None:
            out["status"] = "dead"
            out["error"] = {"message": f"the engine thread died: {failure}; restart `rollwise serve`",
                            "type": "server_error", "code": 503}
            return JSONResponse(out, status_code=503)
        return out

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "rollwise",
                                            "policy_version": service.worker.version}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        tokenizer = service.tokenizer
        try:
            n = check_common(body)
            params = sampling_from(body, defaults=service.sampling)
            if "prompt" not in body:
                raise BadRequest("prompt is required (text or a list of token ids)")
            prompts = completion_prompts(body["prompt"], tokenizer, service.limits,
                                         service.serve_cfg.max_prompts_per_request)
            for i, p in enumerate(prompts):
                what = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                check_length(p, params.max_new_tokens, service.limits, what)
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        work = submit(service.worker.submit_completion, engine_requests(prompts, n, params))
        results, version = await complete(request, work)
        return completion_response(results, prompts, version, service.model_name, tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from rollwise.data.prompts import encode_prompt

        body = await body_of(request)
        try:
            n = check_common(body)
            params = sampling_from(body, defaults=service.sampling)
            messages = chat_messages(body)
            ids = encode_prompt(Prompt("chat", messages), service.tokenizer, None)
            check_length(ids, params.max_new_tokens, service.limits)
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        work = submit(service.worker.submit_completion, engine_requests([ids], n, params))
        results, version = await complete(request, work)
        return chat_response(results, ids, version, service.model_name, service.tokenizer)

    @app.post("/v1/episodes", status_code=202)
    async def episodes(request: Request):
        body = await body_of(request)
        job = submit(lambda: service.worker.submit_job(episode_job(body, service)))
        return {"id": job.id, "object": "episode_job", "status": job.status}

    @app.get("/v1/episodes")
    async def episode_list(request: Request):
        """Every job the server keeps (a client that lost a job id finds it here)."""
        authorize(request)
        jobs = service.worker.list_jobs()
        return {"object": "list", "data": [{"id": j.id, "env": j.env_name, "status": j.status,
                                            "created_at": j.created_at} for j in jobs]}

    def job_or_404(request: Request, job_id: str) -> EpisodeJob:
        authorize(request)
        job = service.worker.job(job_id)
        if job is None:
            raise HTTPError(404, f"no episode job {job_id!r} (finished jobs are kept serve.episode_ttl_s = "
                                 f"{service.worker.episode_ttl_s:g} s)", "not_found_error")
        return job

    @app.get("/v1/episodes/{job_id}")
    async def episode_status(job_id: str, request: Request):
        return job_or_404(request, job_id).summary()

    @app.post("/v1/episodes/{job_id}/cancel")
    async def episode_cancel(job_id: str, request: Request):
        job_or_404(request, job_id)
        job = service.worker.cancel(job_id)
        return {"id": job.id, "object": "episode_job", "status": job.status}

    @app.post("/v1/weights")
    async def weights(request: Request):
        authorize(request)
        limit = service.serve_cfg.max_weight_uploads
        if service.weight_uploads >= limit:
            raise HTTPError(429, f"serve.max_weight_uploads = {limit} weight upload(s) are in progress; retry "
                                 "when they end", "rate_limit_error")
        service.weight_uploads += 1
        try:
            try:
                state, version = await read_weights(request, service)
            except BadRequest as exc:
                raise HTTPError(exc.status, str(exc)) from None
            loaded = await run(service.worker.push_weights(state, version))
        finally:
            service.weight_uploads -= 1
        return {"policy_version": loaded, "tensors": len(state)}

    return app


def episode_job(body: dict, service: Service) -> EpisodeJob:
    """Validate `POST /v1/episodes` and build its job (BadRequest with the field on a bad one)."""
    from rollwise.data.prompts import encode_prompt
    from rollwise.generate.groups import new_groups

    name = body.get("env")
    if not isinstance(name, str) or not name:
        raise BadRequest("env must name an environment (e.g. 'calc')")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest("prompts must be a non-empty list of {messages | prompt, answer}")
    check_prompt_count(len(prompts), service.serve_cfg.max_prompts_per_request, "prompts")
    per_prompt = body.get("samples_per_prompt", 1)
    if isinstance(per_prompt, bool) or not isinstance(per_prompt, int) or not 1 <= per_prompt <= MAX_N:
        raise BadRequest(f"samples_per_prompt must be an integer in 1..{MAX_N}, got {per_prompt!r}")
    max_episode = body.get("max_episode_tokens", service.env_cfg.max_episode_tokens)
    if isinstance(max_episode, bool) or not isinstance(max_episode, int) or max_episode <= 0:
        raise BadRequest(f"max_episode_tokens must be an integer > 0, got {max_episode!r}")
    max_turns = body.get("max_turns")
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise BadRequest(f"max_turns must be an integer >= 1, got {max_turns!r}")
    params = sampling_from(body, default_max_tokens=service.episode_max_tokens, defaults=service.sampling)
    env = service.env(name, max_turns)
    encoded = []
    for i, row in enumerate(prompts):
        prompt = episode_prompt(row, i)
        if row.get("prompt_ids") is not None:
            ids = check_ids(row["prompt_ids"], service.limits, f"prompts[{i}].prompt_ids")
        else:
            ids = encode_prompt(prompt, service.tokenizer, service.system_prompt)
        check_length(ids, max_episode, service.limits, f"prompts[{i}]", "max_episode_tokens")
        encoded.append((prompt, ids))
    return EpisodeJob(name, env, service.codec(), new_groups(encoded, per_prompt, 0), params, max_episode)


def episode_prompt(row, i: int) -> Prompt:
    """One row of `prompts`: `{"messages": [...]}` or `{"prompt": text}`, with `answer`, `uid`, `info`."""
    if not isinstance(row, dict):
        raise BadRequest(f"prompts[{i}] must be an object with 'messages' or 'prompt'")
    if row.get("messages") is not None:
        try:
            messages = chat_messages(row)
        except BadRequest as exc:
            raise BadRequest(f"prompts[{i}].{exc}") from None
    elif isinstance(row.get("prompt"), str) and row["prompt"]:
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise BadRequest(f"prompts[{i}] needs 'messages' (a chat) or 'prompt' (a non-empty text)")
    answer = row.get("answer")
    info = row.get("info") or {}
    if not isinstance(info, dict):
        raise BadRequest(f"prompts[{i}].info must be an object")
    return Prompt(str(row.get("uid") or f"request-{i}"), messages, None if answer is None else str(answer),
                  source=f"request prompts[{i}]", info=info)


class RunningServer:
    """A uvicorn server in a background thread (tests, notebooks): `url`, `port`, `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0):
        import time

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="rollwise-serve-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rollwise serve: the HTTP server did not start on {host}:{port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
