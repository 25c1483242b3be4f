"""`rollwise serve [CONFIG] [--host] [--port] [--api-key] [--model]`: load the policy, serve it until Ctrl-C."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rollwise.config import Config
from rollwise.serve.app import RunningServer, Service, create_app, limits_of, new_api_key
from rollwise.serve.jobs import Worker

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_service(cfg: Config, engine, tokenizer, model_name: str, api_key: str | None = None) -> Service:
    """A Service over `engine` (a worker thread starts and owns it); `api_key` None = a generated token."""
    worker = Worker(engine, tokenizer, max_queued=cfg.serve.max_queued_requests,
                    episode_ttl_s=cfg.serve.episode_ttl_s)
    return Service(worker, tokenizer, model_name, api_key or new_api_key(), limits_of(engine, tokenizer),
                   env_cfg=cfg.env, system_prompt=cfg.data.system_prompt,
                   episode_max_tokens=cfg.rollout.max_new_tokens)


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
    from rollwise.config import load_config

    extra = [f"model.name={_quote(model)}"] if model else []
    cfg = load_config(config, overrides + extra)
    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    configured = api_key or cfg.serve.api_key
    run_dir = Path(tempfile.mkdtemp(prefix="rollwise-serve-"))
    print(f"rollwise serve: loading {cfg.model.name} ...", flush=True)
    engine, tokenizer = load_engine(cfg, run_dir)
    service = build_service(cfg, engine, tokenizer, cfg.model.name, configured)
    server = None
    try:
        server = RunningServer(create_app(service), host, port)
        if host not in LOOPBACK:
            print(f"rollwise serve: WARNING: bound to {host}: anyone who can reach it and has the token can "
                  "sample from and overwrite the policy", file=sys.stderr, flush=True)
        print(f"rollwise serve: {server.url}/v1 (model {cfg.model.name}, policy version {engine.version})",
              flush=True)
        print(f"rollwise serve: token: {service.api_key}" if configured is None else
              "rollwise serve: token: the one configured (--api-key or serve.api_key)", flush=True)
        print("rollwise serve: Ctrl-C stops", flush=True)
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        print("rollwise serve: stopping", flush=True)
    finally:
        if server is not None:
            server.stop()
        service.worker.close()
        getattr(engine, "close", lambda: None)()


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
