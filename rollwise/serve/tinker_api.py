"""`rollwise serve --api tinker`: the part of Thinking Machines' Tinker training API that the official `tinker`
SDK (0.38) uses for SFT and RL loops, served by rollwise on this machine (docs/tinker.md).

Routes (all under /api/v1; every one but `healthz` needs the token in `X-API-Key`, as the SDK sends it, or in
`Authorization: Bearer`):

| route                                   | what                                                              |
|-----------------------------------------|-------------------------------------------------------------------|
| client/config, client/dynamic_config    | the SDK's feature flags: API-key auth, JSON and proto as here      |
| create_session, session_heartbeat, telemetry, sessions/{id}/finish | session bookkeeping (accepted)         |
| GET get_server_capabilities, GET healthz | the served base model; liveness                                  |
| create_model                            | a LoRA (rank > 0) or full (rank 0) training client -> future      |
| get_info                                | its base model, LoRA rank and tokenizer (the local model folder)  |
| forward_backward (protobuf)             | cross_entropy, importance_sampling, ppo; forward_only -> future   |
| optim_step                              | AdamW with the SDK's AdamParams -> future                         |
| save_weights, load_weights              | save_state / load_state (optimizer too), create from state -> future |
| save_weights_for_sampler                | a sampler snapshot (save_weights_and_get_sampling_client) -> future |
| create_sampling_session, GET samplers/{id} | a sampler of a base model or a saved path                      |
| asample                                 | samples, log-probs, prompt log-probs; calls sent together batch -> future |
| retrieve_future                         | a future's result (long poll; 408 "try_again" while it runs)      |

Anything else under /api/v1 gets 404 naming the call and what is served. Errors at submission are rollwise
serve's one-line JSON (`{"error": {"message", "type", "code"}}`); a call that fails while it runs fails its
future with Tinker's `{"error", "category"}`, which the SDK raises as `RequestFailedError` with that line. No
user error is answered with a 5xx: the SDK retries those for minutes.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from rollwise.config import ServeConfig
from rollwise.serve.app import HTTPError
from rollwise.serve.jobs import QueueFull, ServerStopped
from rollwise.serve.protocol import BadRequest, parse_json, read_body
from rollwise.serve.tinker_futures import FutureWorker, Outcome
from rollwise.serve.tinker_state import (ModelSpec, TrainingModel, check_name, checkpoint_spec, find_checkpoint,
                                         loss_options, parse_path, sample_many)
from rollwise.serve.tinker_wire import (PROTO, check_loss_inputs, encode_forward_backward, encode_sample,
                                        parse_forward_backward, parse_sample)

LONG_POLL_S = 20.0  # retrieve_future waits this long for a result before answering 408 (the SDK polls again)
MAX_SAMPLES = 128  # num_samples of one sample call
ENGINES_KEPT = 2  # samplers of base models and saved paths: engines kept loaded
KEY_PREFIX = "tml-"  # the SDK refuses to send an API key without it
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
SERVED = ("create_model, get_info, forward_backward (cross_entropy, importance_sampling, ppo), optim_step, "
          "save_weights, load_weights, save_weights_for_sampler, create_sampling_session, asample, retrieve_future")


@dataclass
class SamplerRef:
    """What a sampling session samples: a training client's snapshot, a saved path or a base model."""

    base_model: str
    model_id: str | None = None
    snapshot: int | None = None
    path: str | None = None


@dataclass
class TinkerService:
    api_key: str = field(repr=False)
    serve_cfg: ServeConfig
    state_dir: Path
    device: torch.device
    base_model: str  # what get_server_capabilities lists (any model rollwise can load may be asked for)
    worker: FutureWorker = None  # type: ignore[assignment]
    models: dict[str, TrainingModel] = field(default_factory=dict)
    samplers: dict[str, SamplerRef] = field(default_factory=dict)
    engines: OrderedDict = field(default_factory=OrderedDict)  # ("base"|"path", name) -> (engine, tokenizer, ctx)

    def __post_init__(self):
        if self.worker is None:
            self.worker = FutureWorker(self.serve_cfg.max_queued_requests)

    def close(self) -> None:
        self.worker.close()
        for model in self.models.values():
            model.close()

    # -- the calls (each runs on the worker thread) -------------------------------------------------------
    def finish(self, session_id: str) -> Outcome:
        prefix = f"{session_id}:"
        for sampler_id in [k for k in self.samplers if k.startswith(prefix)]:
            del self.samplers[sampler_id]
        for model_id in [k for k in self.models if k.startswith(prefix)]:
            self.models.pop(model_id).close()
        return Outcome({})

    def create_model(self, model_id: str, spec: ModelSpec) -> Outcome:
        self.models[model_id] = TrainingModel(model_id, spec, self.device)
        return Outcome({"type": "create_model", "model_id": model_id})

    def create_from_state(self, model_id: str, path: str, base_model: str | None, optimizer: bool) -> Outcome:
        ckpt = find_checkpoint(self.state_dir, path)
        spec, _ = checkpoint_spec(ckpt)
        if base_model and base_model != spec.base_model:
            raise BadRequest(f"{path} was trained on {spec.base_model!r}, not {base_model!r}")
        model = TrainingModel(model_id, spec, self.device)
        model.load(ckpt, optimizer)
        self.models[model_id] = model
        return Outcome({"type": "load_weights", "path": path, "model_id": model_id})

    def sampler_engine(self, ref: SamplerRef):
        """(engine, tokenizer, context) for a sampler, its weights loaded."""
        if ref.model_id is not None:
            model = self.model(ref.model_id)
            model.load_snapshot(ref.snapshot)
            return model.engine, model.tokenizer, model.context
        ckpt = find_checkpoint(self.state_dir, ref.path) if ref.path else None  # a re-save is another engine
        key = ("path", str(ckpt)) if ckpt else ("base", ref.base_model)
        if key not in self.engines:
            self.engines[key] = self._load_engine(ref.base_model, ckpt)
            while len(self.engines) > ENGINES_KEPT:
                self.engines.popitem(last=False)[1][0].close()
        self.engines.move_to_end(key)
        return self.engines[key]

    def _load_engine(self, base_model: str, ckpt: Path | None):
        from rollwise.evaluate_cli import load_policy
        from rollwise.generate.torch_engine import TorchEngine
        from rollwise.models.resolve import load_model
        from rollwise.serve.tinker_state import engine_dtype

        if ckpt is not None:  # a LoRA checkpoint is merged into its base, as `rollwise eval` loads it
            model, tokenizer = load_policy(str(ckpt), base_model)
        else:
            model, tokenizer = load_model(base_model)
        context = int(getattr(model.config, "max_position_embeddings", 0) or 1_000_000)
        return TorchEngine(model.to(self.device), tokenizer, dtype=engine_dtype(self.device)), tokenizer, context

    def sample_batch(self, ref: SamplerRef, specs: list) -> list[Outcome]:
        """Sample calls of one sampling client, as one engine call (see `tinker_state.sample_many`)."""
        engine, tokenizer, context = self.sampler_engine(ref)
        return [Outcome(error=f"sample: {r}", category="user") if isinstance(r, BadRequest)
                else Outcome(proto=encode_sample(*r)) for r in sample_many(engine, tokenizer, specs, context)]

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise BadRequest(f"no training client {model_id!r} on this server (did it restart? resume from a saved "
                             "state with create_training_client_from_state(path))")
        return model


def create_tinker_app(service: TinkerService) -> FastAPI:
    app = FastAPI(title="rollwise serve (Tinker API)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "code": exc.status}},
                            status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _starlette_error(request: Request, exc: HTTPException):  # a path outside /api/v1, a wrong method
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail} (the Tinker "
                                       "API is under /api/v1; docs/tinker.md)", "type": "invalid_request_error",
                                       "code": exc.status_code}}, status_code=exc.status_code)

    def authorize(request: Request) -> None:
        token = request.headers.get("x-api-key")
        if token is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            token = token if scheme.lower() == "bearer" else ""
        if not secrets.compare_digest(token.strip().encode(), service.api_key.encode()):
            raise HTTPError(401, "missing or wrong API key: set TINKER_API_KEY (or ServiceClient(api_key=...)) to the "
                                 "token `rollwise serve --api tinker` printed (or serve.api_key, "
                                 "$ROLLWISE_SERVE_API_KEY)", "authentication_error")

    async def raw_body(request: Request) -> bytes:
        authorize(request)
        try:
            return await read_body(request, service.serve_cfg.max_body_mb, "max_body_mb")
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None

    async def body_of(request: Request) -> dict:
        data = await raw_body(request)
        try:
            body = parse_json(data) if data else {}
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    def submit(what: str, fn, model_id: str | None = None, **batch) -> dict:
        try:
            request_id = service.worker.submit(what, fn, **batch)
        except (QueueFull, ServerStopped) as exc:
            raise HTTPError(503, str(exc), "server_error") from None
        return {"request_id": request_id, "model_id": model_id}

    def checked(fn, *args):
        try:
            return fn(*args)
        except BadRequest as exc:
            raise HTTPError(exc.status, str(exc)) from None

    # -- session bookkeeping ----------------------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        authorize(request)
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request):
        authorize(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await body_of(request)
        return {"type": "create_session", "session_id": f"rw{uuid.uuid4().hex[:16]}"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        authorize(request)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await raw_body(request)
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        """ServiceClient.close(): the session's training clients and samplers are freed (after the calls
        queued before this one); their saved states stay on disk."""
        authorize(request)
        submit("finish_session", lambda: service.finish(session_id))
        return {}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        authorize(request)
        return {"supported_models": [{"model_name": service.base_model, "trainable": True, "sampleable": True}]}

    # -- training clients -------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await body_of(request)
        model_id = checked(new_model_id, body)
        lora = body.get("lora_config") or {}
        spec = checked(model_spec, body.get("base_model"), lora)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise HTTPError(400, f"optimizer {optimizer!r} is not supported by rollwise serve (only adamw)")
        return submit("create_model", lambda: service.create_model(model_id, spec), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await body_of(request)
        return checked(lambda: service.model(body.get("model_id")).info())

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        data = await raw_body(request)
        if "json" in request.headers.get("content-type", ""):
            raise HTTPError(400, "forward_backward takes the SDK's protocol-buffer body (tinker==0.38)")
        if request.headers.get("content-encoding", "identity") != "identity":
            raise HTTPError(400, "forward_backward: compressed bodies are not accepted by this server")
        req = checked(parse_forward_backward, data)
        model = checked(service.model, req.model_id)
        checked(check_loss_inputs, req, model.vocab_size, model.context)
        checked(loss_options, req.loss_fn, req.config)

        def run() -> Outcome:
            outputs, metrics = model.forward_backward(req)
            return Outcome(proto=encode_forward_backward(outputs, metrics))

        return submit("forward" if req.forward_only else "forward_backward", run, req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await body_of(request)
        model = checked(service.model, body.get("model_id"))
        adam = body.get("adam_params")
        if adam is None:
            raise HTTPError(400, "optim_step: only AdamParams are supported by rollwise serve (adam_params)")
        if not isinstance(adam, dict):
            raise HTTPError(400, "adam_params must be an object")
        return submit("optim_step", lambda: Outcome({"metrics": model.optim_step(adam)}), model.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await body_of(request)
        model = checked(service.model, body.get("model_id"))
        name = checked(check_name, body.get("path"), "save_state name")
        overwrite = bool(body.get("overwrite"))

        def run() -> Outcome:
            path = model.save(service.state_dir, "weights", name, overwrite)
            return Outcome({"type": "save_weights", "path": path})

        return submit("save_state", run, model.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = await body_of(request)
        path = body.get("path")
        checked(parse_path, path)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is None:  # ServiceClient.create_training_client_from_state
            model_id = checked(new_model_id, body)
            return submit("create_training_client_from_state",
                          lambda: service.create_from_state(model_id, path, body.get("base_model"), optimizer),
                          model_id)
        model = checked(service.model, body.get("model_id"))

        def run() -> Outcome:
            model.load(find_checkpoint(service.state_dir, path), optimizer)
            return Outcome({"type": "load_weights", "path": path, "model_id": model.model_id})

        return submit("load_state", run, model.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = await body_of(request)
        model = checked(service.model, body.get("model_id"))
        if body.get("kind", "snapshot") != "snapshot":
            raise HTTPError(400, f"sampling client kind {body.get('kind')!r} is not supported (only 'snapshot')")
        name = body.get("path")
        if name is not None:
            checked(check_name, name, "save_weights_for_sampler name")

        def run() -> Outcome:
            if name is not None:
                path = model.save(service.state_dir, "sampler_weights", name, overwrite=True)
                return Outcome({"type": "save_weights_for_sampler", "path": path})
            sampler_id = f"{model.model_id}:sample:{uuid.uuid4().hex[:12]}"
            service.samplers[sampler_id] = SamplerRef(model.spec.base_model, model.model_id, model.snapshot())
            return Outcome({"type": "save_weights_for_sampler", "sampling_session_id": sampler_id})

        return submit("save_weights_for_sampler", run, model.model_id)

    # -- sampling ---------------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await body_of(request)
        path, base = body.get("model_path"), body.get("base_model")
        if path:
            ckpt = checked(find_checkpoint, service.state_dir, path)
            ref = SamplerRef(checked(checkpoint_spec, ckpt)[0].base_model, path=path)
        elif isinstance(base, str) and base:
            ref = SamplerRef(base)
        else:
            raise HTTPError(400, "create_sampling_client needs model_path (a path save_state or "
                                 "save_weights_for_sampler returned) or base_model")
        sampler_id = f"{body.get('session_id', 'rw')}:sample:{uuid.uuid4().hex[:12]}"
        service.samplers[sampler_id] = ref
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        authorize(request)
        ref = checked(sampler_of, service, sampler_id)
        return {"sampler_id": sampler_id, "base_model": ref.base_model, "model_path": ref.path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = await body_of(request)
        spec = checked(parse_sample, body, MAX_SAMPLES)
        ref = checked(sampler_of, service, spec.sampler_id)

        promise = submit("sample", None, batch=spec.sampler_id, item=spec,
                         run_batch=lambda specs: service.sample_batch(ref, specs),
                         seeds=frozenset() if spec.seed is None else frozenset({spec.seed}))
        promise["sample_sequence_ids"] = [f"{promise['request_id']}:{i}" for i in range(spec.num_samples)]
        return promise

    # -- futures ----------------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await body_of(request)
        request_id = body.get("request_id")
        future = service.worker.get(request_id) if isinstance(request_id, str) else None
        if future is None:
            raise HTTPError(404, f"no future {request_id!r} on this server (results are kept "
                                 f"{service.worker.ttl_s:g} s; a restarted server forgets them)", "not_found_error")
        try:
            outcome = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), LONG_POLL_S)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408)
        service.worker.retrieved(request_id)
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if outcome.proto is not None:
            if PROTO not in request.headers.get("accept", ""):
                raise HTTPError(400, "this result is a protocol buffer: send Accept: application/x-protobuf "
                                     "(the tinker SDK does)")
            return Response(outcome.proto, media_type=PROTO)
        return outcome.json

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_served(rest: str, request: Request):
        authorize(request)
        raise HTTPError(404, f"{request.method} /api/v1/{rest} is not supported by rollwise serve --api tinker; it "
                             f"serves {SERVED} (docs/tinker.md)", "not_found_error")

    return app


def sampler_of(service: TinkerService, sampler_id: str) -> SamplerRef:
    ref = service.samplers.get(sampler_id)
    if ref is None:
        raise BadRequest(f"no sampling client {sampler_id!r} on this server (did it restart? create it again)")
    return ref


def new_model_id(body: dict) -> str:
    """`<session id>:train:<model_seq_id>`, the id the SDK itself derives for create-from-state."""
    session, seq = body.get("session_id"), body.get("model_seq_id")
    if not isinstance(session, str) or not session or isinstance(seq, bool) or not isinstance(seq, int):
        raise BadRequest("session_id and model_seq_id are required (create training clients with a ServiceClient)")
    check_name(session, "session_id")
    return f"{session}:train:{seq}"


def model_spec(base_model, lora: dict) -> ModelSpec:
    if not isinstance(base_model, str) or not base_model:
        raise BadRequest("base_model is required: the embedded 'smollm2-135m-instruct', a local model folder or a "
                         "hub id")
    rank = lora.get("rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise BadRequest(f"lora_config.rank must be an integer >= 0 (0 = full fine-tuning), got {rank!r}")
    seed = lora.get("seed")
    return ModelSpec(base_model, rank, 0 if seed is None else int(seed), bool(lora.get("train_mlp", True)),
                     bool(lora.get("train_attn", True)), bool(lora.get("train_unembed", True)))
