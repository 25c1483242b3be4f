"""`rollwise serve [CONFIG] [--host] [--port] [--api-key] [--model]`: load the policy, serve it until Ctrl-C.

The token clients must send is, first found: `--api-key`, `serve.api_key`, `$ROLLWISE_SERVE_API_KEY`, else a
generated one, printed once at start (a configured token is never printed).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from rollwise.config import Config, secret_value
from rollwise.serve.app import RunningServer, Service, create_app, limits_of, new_api_key
from rollwise.serve.jobs import Worker

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVE_KEY_ENV = "ROLLWISE_SERVE_API_KEY"


def build_service(cfg: Config, engine, tokenizer, model_name: str, api_key: str | None = None) -> Service:
    """A Service over `engine` (a worker thread starts and owns it); `api_key` None = a generated token."""
    worker = Worker(engine, tokenizer, max_queued=cfg.serve.max_queued_requests,
                    episode_ttl_s=cfg.serve.episode_ttl_s)
    return Service(worker, tokenizer, model_name, api_key or new_api_key(), limits_of(engine, tokenizer),
                   env_cfg=cfg.env, system_prompt=cfg.data.system_prompt,
                   episode_max_tokens=cfg.rollout.max_new_tokens, serve_cfg=cfg.serve)


def configured_key(flag: str | None, cfg: Config) -> str | None:
    """The token from `--api-key`, `serve.api_key` or `$ROLLWISE_SERVE_API_KEY` (first set), else None."""
    return flag or secret_value(cfg.serve.api_key) or os.environ.get(SERVE_KEY_ENV) or None


def load_engine(cfg: Config, run_dir: Path):
    """(engine, tokenizer) of `cfg.model.name` through `rollwise.generate.factory.build_engine` (version 0)."""
    import torch

    from rollwise.generate.factory import build_engine
    from rollwise.hardware import configure_threads
    from rollwise.models import load_model

    configure_threads(cfg.model.threads)
    model, tokenizer = load_model(cfg.model.name, dtype=torch.float32)
    return build_engine(cfg, model, tokenizer, run_dir), tokenizer


def serve_command(config: str | None, overrides: list[str], host: str | None, port: int | None,
                  api_key: str | None, model: str | None) -> None:
    """Serve until Ctrl-C (or the server thread ends); the engine and worker are closed on the way out."""
    from rollwise.validate import load

    extra = [f"model.name={_quote(model)}"] if model else []
    cfg = load(config, overrides + extra)
    from rollwise import sandbox

    sandbox.allow_unconfined(cfg.sandbox.allow_unconfined)  # episode jobs of code environments (pyexec)
    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    configured = configured_key(api_key, cfg)
    run_dir = Path(tempfile.mkdtemp(prefix="rollwise-serve-"))
    print(f"rollwise serve: loading {cfg.model.name} ...", flush=True)
    engine, tokenizer = load_engine(cfg, run_dir)
    service = server = None
    try:
        service = build_service(cfg, engine, tokenizer, cfg.model.name, configured)
        server = RunningServer(create_app(service), host, port)
        if host not in LOOPBACK:
            print(f"rollwise serve: WARNING: bound to {host}: anyone who can reach it and has the token can "
                  "sample from and overwrite the policy", file=sys.stderr, flush=True)
        print(f"rollwise serve: {server.url}/v1 (model {cfg.model.name}, policy version {engine.version})",
              flush=True)
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
        engine.close()


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
