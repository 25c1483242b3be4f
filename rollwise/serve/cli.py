"""`rollwise serve [CONFIG] [--host] [--port] [--api-key] [--model] [--device] [--engine]`: load the policy, serve
it until Ctrl-C, on the engine the config names (`rollout.engine`, `engine_options`, `train.device`, `model.dtype`);
`--model RUN_DIR` (or one of its checkpoints) serves it with the run's own config.toml.

The token clients must send is, first found: `--api-key`, `serve.api_key`, `$ROLLWISE_SERVE_API_KEY`, else a
generated one, printed once at start (a configured token is never printed).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from rollwise.config import Config, secret_value
from rollwise.serve.app import RunningServer, Service, create_app, limits_of, new_api_key
from rollwise.serve.jobs import Worker
from rollwise.types import SamplingParams

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVE_KEY_ENV = "ROLLWISE_SERVE_API_KEY"


def build_service(cfg: Config, engine, tokenizer, model_name: str, api_key: str | None = None) -> Service:
    """A Service over `engine` (a worker thread starts and owns it); `api_key` None = a generated token. A
    request that leaves out `top_p`, `top_k` or `stop` samples with the run's (`rollout.*`)."""
    from rollwise.generate.factory import engine_summary

    worker = Worker(engine, tokenizer, max_queued=cfg.serve.max_queued_requests,
                    episode_ttl_s=cfg.serve.episode_ttl_s)
    rollout = cfg.rollout
    return Service(worker, tokenizer, model_name, api_key or new_api_key(), limits_of(engine, tokenizer),
                   env_cfg=cfg.env, system_prompt=cfg.data.system_prompt,
                   episode_max_tokens=rollout.max_new_tokens, serve_cfg=cfg.serve,
                   sampling=SamplingParams(top_p=rollout.top_p, top_k=rollout.top_k, stop=tuple(rollout.stop)),
                   engine=engine_summary(cfg, engine))


def configured_key(flag: str | None, cfg: Config) -> str | None:
    """The token from `--api-key`, `serve.api_key` or `$ROLLWISE_SERVE_API_KEY` (first set), else None."""
    return flag or secret_value(cfg.serve.api_key) or os.environ.get(SERVE_KEY_ENV) or None


def load_engine(cfg: Config, run_dir: Path, target: str | None = None):
    """(engine, tokenizer) of the policy `target` (default `cfg.model.name`; a LoRA checkpoint is merged into its
    base, `model.name`) on the run's engine (`rollwise.generate.factory.open_engine`: `rollout.engine`,
    `engine_options`, `train.device`, `model.dtype` decided by that device), version 0; `run_dir` is a scratch
    folder for a vLLM engine's weights."""
    from rollwise.evaluate_cli import load_policy
    from rollwise.generate.factory import open_engine
    from rollwise.hardware import configure_threads

    configure_threads(cfg.model.threads)
    policy, tokenizer = load_policy(target or cfg.model.name, cfg.model.name)
    return open_engine(cfg, policy, tokenizer, run_dir), tokenizer


def serve_config(config: str | None, overrides: list[str], model: str | None, device: str | None = None,
                 engine: str | None = None) -> tuple[Config, str | None]:
    """(config, policy to load). `model` a run directory or one of its checkpoints: that checkpoint, with the
    run's own config.toml when no CONFIG is given (its engine, device, dtype and sampling); another model:
    `model.name`. `device` / `engine` (`--device`, `--engine`) override the config's."""
    from rollwise.config_load import load_config
    from rollwise.evaluate_cli import resolve_target
    from rollwise.generate.factory import apply_engine_flags
    from rollwise.validate import validate

    target, recipe = resolve_target(model) if model else (None, None)
    if recipe is None:
        target = None
        overrides = overrides + ([f"model.name={_quote(model)}"] if model else [])
    elif config is None and recipe.exists():
        config = str(recipe)
    cfg = load_config(config, overrides)
    for note in apply_engine_flags(cfg, device, engine, overrides):
        print(f"rollwise serve: {note}", file=sys.stderr, flush=True)
    return validate(cfg), target


def serve_command(config: str | None, overrides: list[str], host: str | None, port: int | None,
                  api_key: str | None, model: str | None, device: str | None = None,
                  engine: str | None = None) -> None:
    """Serve until Ctrl-C (or the server thread ends); the engine and worker are closed on the way out."""
    cfg, target = serve_config(config, overrides, model, device, engine)
    from rollwise import sandbox

    sandbox.allow_unconfined(cfg.sandbox.allow_unconfined)  # episode jobs of code environments (pyexec)
    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    configured = configured_key(api_key, cfg)
    name = model or cfg.model.name
    run_dir = Path(tempfile.mkdtemp(prefix="rollwise-serve-"))
    print(f"rollwise serve: loading {target or cfg.model.name} ...", flush=True)
    generator, tokenizer = load_engine(cfg, run_dir, target)
    service = server = None
    try:
        service = build_service(cfg, generator, tokenizer, name, configured)
        server = RunningServer(create_app(service), host, port)
        if host not in LOOPBACK:
            print(f"rollwise serve: WARNING: bound to {host}: anyone who can reach it and has the token can "
                  "sample from and overwrite the policy", file=sys.stderr, flush=True)
        print(f"rollwise serve: {server.url}/v1 (model {name}, policy version {generator.version}; "
              f"{describe(service.engine)})", flush=True)
        print(f"rollwise serve: token: {service.api_key}" if configured is None else
              f"rollwise serve: token: the one configured (--api-key, serve.api_key or ${SERVE_KEY_ENV})",
              flush=True)
        print("rollwise serve: Ctrl-C stops", flush=True)
        watch(server, service.worker)
    except KeyboardInterrupt:
        print("rollwise serve: stopping", flush=True)
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.worker.close()
        generator.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def describe(used: dict) -> str:
    """`engine torch on cuda:0, bfloat16, options {...}`: the engine line printed at start."""
    options = f", options {used['options']}" if used.get("options") else ""
    return f"engine {used['engine']} on {used['device']}, {used['dtype']}{options}"


def watch(server: RunningServer, worker: Worker, poll_s: float = 0.5) -> None:
    """Wait while the HTTP thread runs; say once (stderr) if the engine thread dies (the server then answers
    503 and /health says why); raise if the HTTP thread ends on its own."""
    told = False
    while server.thread.is_alive():
        server.thread.join(poll_s)
        failure = worker.failure()
        if failure is not None and not told:
            print(f"rollwise serve: ERROR: the engine thread died ({failure}); requests get 503 until you restart "
                  "it", file=sys.stderr, flush=True)
            told = True
    raise RuntimeError("the HTTP server stopped on its own (see the lines above)")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def tinker_serve_command(config: str | None, overrides: list[str], host: str | None, port: int | None,
                         api_key: str | None, model: str | None, device: str | None = None,
                         engine: str | None = None) -> None:
    """`rollwise serve --api tinker`: the Tinker training API (rollwise.serve.tinker_api) until Ctrl-C. Training
    clients are created on whatever base model the SDK names; `--model` (or `model.name`) is the one
    `get_server_capabilities` lists. Training and sampling run on `train.device` (`--device`)."""
    from rollwise.config import ConfigError
    from rollwise.hardware import configure_threads, resolve_device
    from rollwise.models.resolve import cache_dir
    from rollwise.serve.tinker_api import KEY_PREFIX, TinkerService, create_tinker_app

    if engine not in (None, "torch"):
        raise ConfigError(f"--api tinker samples with the torch engine (the trained weights live in this process); "
                          f"--engine {engine} is not supported with it")
    try:
        import tinker.proto.tinker_public_pb2  # noqa: F401  (the wire format is the SDK's own protocol buffers)
    except ImportError:
        raise ConfigError("rollwise serve --api tinker needs the tinker SDK for its wire format: pip install "
                          "'rollwise[tinker]'") from None
    cfg, _ = serve_config(config, overrides, model, device, None)
    configured = configured_key(api_key, cfg)
    if configured is not None and not configured.startswith(KEY_PREFIX):
        raise ConfigError(f"the tinker SDK sends only API keys that start with {KEY_PREFIX!r}: set "
                          f"{SERVE_KEY_ENV}={KEY_PREFIX}... (or --api-key, serve.api_key)")
    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    configure_threads(cfg.model.threads)
    torch_device = resolve_device(cfg.train.device)
    state_dir = Path(cfg.serve.tinker_state_dir or cache_dir() / "tinker").expanduser()
    state_dir.mkdir(parents=True, exist_ok=True)
    key = configured or KEY_PREFIX + "rw-" + new_api_key()[3:]
    service = TinkerService(key, cfg.serve, state_dir, torch_device, model or cfg.model.name)
    server = None
    try:
        server = RunningServer(create_tinker_app(service), host, port)
        if host not in LOOPBACK:
            print(f"rollwise serve: WARNING: bound to {host}: anyone who can reach it and has the token can train "
                  "and sample models on this machine and read its saved states", file=sys.stderr, flush=True)
        print(f"rollwise serve: Tinker API at {server.url} (device {torch_device}, saved states in {state_dir}); "
              f"TINKER_BASE_URL={server.url}", flush=True)
        print(f"rollwise serve: token: {key}" if configured is None else
              f"rollwise serve: token: the one configured (--api-key, serve.api_key or ${SERVE_KEY_ENV})",
              flush=True)
        print("rollwise serve: Ctrl-C stops", flush=True)
        while server.thread.is_alive():
            server.thread.join(0.5)
        raise RuntimeError("the HTTP server stopped on its own (see the lines above)")
    except KeyboardInterrupt:
        print("rollwise serve: stopping", flush=True)
    finally:
        if server is not None:
            server.stop()
        service.close()
