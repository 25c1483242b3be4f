"""Rollout engines that are clients of an inference server over HTTP: any OpenAI-compatible `/v1/completions`
server that takes token-id prompts and returns token ids (vLLM); the shared client that SGLang's
(`sglang_engine.py`) builds on.

Both implement the engine contract of `rollwise.generate.base.Engine` (tokens in, tokens out, never re-tokenised
text; behaviour log-probs; abort and continue; version spans) plus `probe_logprobs` and `close`.

- Every request is its own HTTP call, sent concurrently (asyncio + httpx, at most `max_concurrency` at once);
  the server's prefix cache shares the prompt of a group's samples, and each sample can be aborted alone.
- Abort keeps the tokens already generated. OpenAI/vLLM: responses are streamed (`stream: true`) and an abort
  cancels the HTTP call (the server aborts a request whose client went away), keeping the streamed tokens.
  SGLang: `POST /abort_request {rid}`; the pending `/generate` then answers with `finish_reason.type = "abort"`
  and the tokens so far. A later request whose `response_ids` holds them continues from prompt + those tokens.
- A server that is silent for longer than `timeout_s` (rollout.request_timeout_s) or answers an error ends the
  call with one `ServerEngineError` line naming the URL.

`device` is `torch.device("cpu")`: a placeholder, the weights live in the server's process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from rollwise.errors import UserError
from rollwise.generate.base import EngineCaps
from rollwise.generate.sampling import truncates
from rollwise.generate.torch_engine import EngineStats, sequence_result
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams, Status

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


class ServerEngineError(UserError, RuntimeError):
    """A server engine's HTTP call failed; the message is one line naming the URL and what to do."""


@dataclass
class _Sequence:
    """One request in flight: the tokens it came with plus those received so far."""

    req: GenerationRequest
    ids: list[int]
    logprobs: list[float]
    full_logprobs: list[float] | None  # None once a truncating request makes them unknown
    start_len: int
    status: Status | None = None
    rid: str = ""
    sent: bool = False  # the HTTP call started (SGLang: the server may know the rid)

    @classmethod
    def start(cls, req: GenerationRequest) -> "_Sequence":
        full = list(req.response_full_logprobs or req.response_logprobs)
        return cls(req, list(req.response_ids), list(req.response_logprobs), full, len(req.response_ids),
                   rid=f"rollwise-{uuid.uuid4().hex[:12]}-{req.request_id}")

    def add(self, ids: list[int], logprobs: list[float], full_known: bool) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        if self.full_logprobs is not None:
            self.full_logprobs = self.full_logprobs + list(logprobs) if full_known else None

    @property
    def remaining(self) -> int:
        return self.req.params.max_new_tokens - len(self.ids)


def as_dtype(value) -> torch.dtype | None:
    """'bfloat16' / torch.bfloat16 / None -> torch dtype or None (unknown, e.g. a server's 'auto')."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).removeprefix("torch."))


class _ServerEngine:
    """The engine contract over HTTP; subclasses implement `_run_one` (one request) and the probes."""

    server_name = "server"
    caps = EngineCaps(continue_aborted=True)

    def __init__(self, base_url: str, tokenizer, timeout_s: float = 600.0, max_concurrency: int = 64,
                 dtype=None, version: int = 0, api_key: str | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{self.server_name} engine: base_url {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.max_concurrency = max_concurrency
        self.dtype = as_dtype(dtype)
        self.version: int | None = version
        self.device = torch.device("cpu")  # placeholder: the weights live in the server's process
        self.stats = EngineStats()
        self.eos_ids = sorted({t for t in [tokenizer.eos_token_id] if t is not None})
        self._aborted: set[int] = set()
        self._inflight: dict[int, _Sequence] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        # sent with every call (generation, probes, weight sync); never printed: not in repr or messages
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # -- protocol -----------------------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        """Send every request concurrently; results in request order, `on_finish(result)` as each ends (it runs
        on this engine's event loop thread and may call `abort`)."""
        if self._closed:
            raise ServerEngineError(f"{self.base_url}: this {self.server_name} engine is closed")
        if self.version is None:
            raise ServerEngineError(f"{self.base_url}: engine weights are in an unknown state after a failed "
                                    "sync; sync the weights again before sampling")
        if not requests:
            return []
        results = _run_sync(self._generate_all(requests, on_finish))
        with self._lock:
            self._aborted.difference_update(r.request_id for r in requests)
        return results

    def abort(self, request_ids: list[int]) -> None:
        """Stop these requests now; they return with status `aborted` and the tokens generated so far."""
        with self._lock:
            self._aborted.update(request_ids)
            loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort_on_loop(list(request_ids))
        else:
            loop.call_soon_threadsafe(self._abort_on_loop, list(request_ids))

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        raise ServerEngineError(f"{self.base_url}: a plain {self.server_name} server cannot receive weights; use "
                                "rollout.engine = 'vllm' with rollout.server (or 'sglang') to train against it")

    def close(self) -> None:
        """Nothing to release for a client of a server that someone else runs (idempotent)."""
        self._closed = True

    # -- the event loop -----------------------------------------------------------------------------
    async def _generate_all(self, requests: list[GenerationRequest], on_finish) -> list[GenerationResult]:
        self._loop = asyncio.get_running_loop()
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        gate = asyncio.Semaphore(self.max_concurrency)
        results: dict[int, GenerationResult] = {}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=self._headers) as client:
                for req in requests:
                    seq = _Sequence.start(req)
                    self._inflight[req.request_id] = seq
                    self._tasks[req.request_id] = asyncio.create_task(
                        self._run_guarded(client, seq, gate, results, on_finish))
                await asyncio.gather(*self._tasks.values())
        except BaseException:
            for task in self._tasks.values():
                task.cancel()
            raise
        finally:
            self._tasks, self._inflight, self._loop = {}, {}, None
        return [results[r.request_id] for r in requests]

    async def _run_guarded(self, client, seq: _Sequence, gate, results: dict, on_finish) -> None:
        """Run one request (or not, when it is aborted or has no tokens left) and publish its result."""
        if seq.remaining <= 0:
            seq.status = Status.TRUNCATED
        elif seq.req.request_id in self._aborted:
            seq.status = Status.ABORTED
        if seq.status is None:
            async with gate:
                if seq.req.request_id in self._aborted:  # aborted while waiting for a connection
                    seq.status = Status.ABORTED
                else:
                    seq.sent = True
                    self.stats.prefill_tokens += len(seq.req.prompt_ids) + len(seq.req.response_ids)
                    self.stats.prefill_sequences += 1
                    try:
                        await self._run_one(client, seq)
                    except asyncio.CancelledError:
                        if seq.req.request_id not in self._aborted:
                            raise
                        seq.status = Status.ABORTED  # cancelled by `abort`: keep what was streamed
        self._finish_status(seq)
        self.stats.generated_tokens += len(seq.ids) - seq.start_len
        result = self._result(seq)
        results[seq.req.request_id] = result
        if on_finish is not None:
            on_finish(result)

    def _abort_on_loop(self, request_ids: list[int]) -> None:
        """Cancel in-flight calls (the OpenAI default); SGLang overrides this with `/abort_request`."""
        for rid in request_ids:
            task = self._tasks.get(rid)
            seq = self._inflight.get(rid)
            if task is not None and seq is not None and seq.sent and not task.done():
                task.cancel()

    def _finish_status(self, seq: _Sequence) -> None:
        if seq.status is None or seq.status == Status.COMPLETED:
            if seq.ids[seq.start_len:] and seq.ids[-1] in self.eos_ids:
                seq.status = Status.COMPLETED
            elif seq.status is None:
                seq.status = Status.TRUNCATED if seq.remaining <= 0 else Status.COMPLETED

    def _result(self, seq: _Sequence) -> GenerationResult:
        return sequence_result(seq, self.version, self.tokenizer)

    async def _run_one(self, client: httpx.AsyncClient, seq: _Sequence) -> None:
        raise NotImplementedError

    # -- HTTP helpers -------------------------------------------------------------------------------
    def _fail(self, path: str, exc: BaseException, what: str = "") -> ServerEngineError:
        """One line for a failed call: timeout, connection refused, or an error answer."""
        url = f"{self.base_url}{path}"
        what = f" ({what})" if what else ""
        if isinstance(exc, httpx.TimeoutException):
            return ServerEngineError(f"{url}{what}: no answer within rollout.request_timeout_s = {self.timeout_s:g} "
                                     "s; raise rollout.request_timeout_s or check that the server is not overloaded")
        if isinstance(exc, httpx.TransportError):
            return ServerEngineError(f"{url}{what}: cannot reach the {self.server_name} server "
                                     f"({type(exc).__name__}: {exc}); is it running at {self.base_url}?")
        return ServerEngineError(f"{url}{what}: {exc}")

    def _answer_error(self, path: str, status: int, body: bytes | str) -> ServerEngineError:
        message = _error_message(body)
        return ServerEngineError(f"{self.base_url}{path} answered HTTP {status}: {message}")

    def _post(self, path: str, body: dict | None = None, params: dict | None = None, what: str = ""):
        """A blocking control call (weights, probes, cache): parsed JSON answer, or None for an empty one."""
        try:
            with httpx.Client(timeout=self.timeout_s, headers=self._headers) as client:
                answer = client.post(f"{self.base_url}{path}", json=body, params=params)
        except httpx.HTTPError as exc:
            raise self._fail(path, exc, what) from None
        if answer.status_code >= 400:
            raise self._answer_error(path, answer.status_code, answer.content)
        try:
            return answer.json() if answer.content else None
        except json.JSONDecodeError:
            return answer.text

    def _get(self, path: str):
        try:
            with httpx.Client(timeout=self.timeout_s, headers=self._headers) as client:
                answer = client.get(f"{self.base_url}{path}")
        except httpx.HTTPError as exc:
            raise self._fail(path, exc) from None
        if answer.status_code >= 400:
            raise self._answer_error(path, answer.status_code, answer.content)
        return answer.json()


def _error_message(body: bytes | str) -> str:
    """The message of an error answer (OpenAI `{"error": {"message"}}`, FastAPI `{"detail"}`, SGLang
    `{"message"}`), on one line and at most 300 characters."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict):
            text = str(inner.get("message") or inner.get("detail") or data.get("detail") or inner)
        else:
            text = str(inner)
    line = " ".join(text.split())
    return (line[:297] + "...") if len(line) > 300 else (line or "(empty answer)")


def _run_sync(coro):
    """Run a coroutine to completion from synchronous code (in a helper thread when a loop already runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="rollwise-http-engine")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# =================================================================================================
class OpenAIEngine(_ServerEngine):
    """Client of an OpenAI-compatible `/v1/completions` server with token-id prompts (vLLM's OpenAI server).

    Sends `prompt` = token ids, `logprobs: 0`, `stream: true` and vLLM's `return_token_ids` /
    `return_tokens_as_token_ids`; a server that returns no token ids is refused (text is never re-tokenised).
    Behaviour log-probs: vLLM reports the sampled distribution's log-probs (after temperature, top-k, top-p) only
    when started with `--logprobs-mode processed_logprobs` (`launch_vllm_server` does). Pass
    `processed_logprobs=False` for a server that reports raw ones (temperature 1, untruncated): they are then
    returned as behaviour log-probs, exact only at temperature 1 without top-k / top-p, and `full_logprobs`
    stays empty. `full_logprobs` (same temperature, no truncation) are reported only where no top-k / top-p
    applies (they equal the behaviour ones there).

    Args:
        base_url: e.g. "http://127.0.0.1:8000" (without /v1).
        tokenizer: EOS ids and response text.
        timeout_s: rollout.request_timeout_s: a call silent for longer fails.
        max_concurrency: HTTP calls in flight at once.
        model: the served model name; None asks `/v1/models` for the first one.
        dtype: the server's compute dtype when known (it is not reported over HTTP); None = unknown.
        processed_logprobs: whether the server reports processed (sampled-distribution) log-probs.
        api_key: sent as `Authorization: Bearer <api_key>` with every call (None = no header).
    """

    server_name = "OpenAI-compatible"
    caps = EngineCaps(probe_logprobs=True, continue_aborted=True)

    def __init__(self, base_url: str, tokenizer, timeout_s: float = 600.0, max_concurrency: int = 64,
                 model: str | None = None, dtype=None, processed_logprobs: bool = True, version: int = 0,
                 api_key: str | None = None):
        super().__init__(base_url, tokenizer, timeout_s, max_concurrency, dtype, version, api_key)
        self.processed_logprobs = processed_logprobs
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise ServerEngineError(f"{self.base_url}/v1/models lists no model; pass the served model name")
        return models[0]["id"]

    def _body(self, seq: _Sequence) -> dict:
        p: SamplingParams = seq.req.params
        body = {"model": self.model, "prompt": seq.req.prompt_ids + seq.ids, "max_tokens": seq.remaining,
                "temperature": p.temperature, "top_p": p.top_p, "logprobs": 0, "stream": True,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                "stop_token_ids": self.eos_ids, "request_id": seq.rid}
        if p.top_k > 0:
            body["top_k"] = p.top_k
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        return body

    async def _run_one(self, client: httpx.AsyncClient, seq: _Sequence) -> None:
        path = "/v1/completions"
        what = f"request {seq.req.request_id}"
        truncating = truncates(seq.req.params.top_k, seq.req.params.top_p, 1 << 30)
        full_known = self.processed_logprobs and not truncating
        try:
            async with client.stream("POST", f"{self.base_url}{path}", json=self._body(seq)) as answer:
                if answer.status_code >= 400:
                    raise self._answer_error(path, answer.status_code, await answer.aread())
                async for line in answer.aiter_lines():
                    chunk = _sse_data(line)
                    if chunk is None:
                        continue
                    if "error" in chunk:
                        raise ServerEngineError(f"{self.base_url}{path} ({what}) streamed an error: "
                                                f"{_error_message(json.dumps(chunk))}")
                    for choice in chunk.get("choices") or []:
                        self._take_choice(seq, choice, full_known, path)
        except httpx.HTTPError as exc:
            raise self._fail(path, exc, what) from None

    def _take_choice(self, seq: _Sequence, choice: dict, full_known: bool, path: str) -> None:
        ids, logprobs = _choice_tokens(choice)
        if ids is None:
            raise ServerEngineError(f"{self.base_url}{path} returned no token ids (it needs vLLM's "
                                    "return_token_ids or return_tokens_as_token_ids); rollwise never re-tokenises "
                                    "text: use a vLLM server, or rollout.engine = 'sglang'")
        if len(logprobs) != len(ids):
            raise ServerEngineError(f"{self.base_url}{path} returned {len(ids)} token ids but {len(logprobs)} "
                                    "log-probs; the server must support `logprobs: 0` on streamed completions")
        seq.add(ids, logprobs, full_known)
        reason = choice.get("finish_reason")
        if reason == "length":
            seq.status = Status.TRUNCATED
        elif reason in ("stop", "eos"):
            seq.status = Status.COMPLETED
        elif reason == "abort":
            seq.status = Status.ABORTED

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of token_ids[1:] given the tokens before them (length len - 1), from the
        server's current weights (vLLM `prompt_logprobs`, else OpenAI `echo` + `logprobs`)."""
        body = {"model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        answer = self._post("/v1/completions", body, what="probe_logprobs")
        choice = answer["choices"][0]
        prompt_lp = choice.get("prompt_logprobs")
        if prompt_lp is None:
            body = {"model": self.model, "prompt": list(token_ids), "max_tokens": 0, "echo": True, "logprobs": 0}
            echo = self._post("/v1/completions", body, what="probe_logprobs")["choices"][0]["logprobs"]
            return [float(v) for v in echo["token_logprobs"][1:len(token_ids)]]
        return [float(_entry_logprob(prompt_lp[i], token_ids[i])) for i in range(1, len(token_ids))]


def _sse_data(line: str) -> dict | None:
    """The JSON of one server-sent-events `data:` line; None for blank lines, comments and `[DONE]`."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def _choice_tokens(choice: dict) -> tuple[list[int] | None, list[float]]:
    """(token ids, log-probs) of one streamed completion choice; ids None when the server sent none."""
    lp = choice.get("logprobs") or {}
    logprobs = [float(v) for v in (lp.get("token_logprobs") or [])]
    ids = choice.get("token_ids")
    if ids is None and lp.get("tokens") is not None:
        tokens = lp["tokens"]
        if all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
    return (list(ids) if ids is not None else None), logprobs


def _entry_logprob(entry: dict, token_id: int) -> float:
    """vLLM prompt_logprobs entry ({token id: {"logprob": ...}}, JSON keys are strings) -> the token's value."""
    value = entry.get(str(token_id), entry.get(token_id))
    if value is None:
        raise ServerEngineError(f"prompt_logprobs has no entry for token {token_id}")
    return value["logprob"] if isinstance(value, dict) else value


def push_through_folder(engine, state_dict: dict[str, torch.Tensor], version: int) -> None:
    """A server engine's `update_weights`: a version folder (`rollwise.models.weights_folder`: whole groups
    checked, written atomically) in `engine.sync_dir` (a temporary one when unset), reloaded by the server;
    older folders are deleted."""
    from rollwise.models.weights_folder import delete_older_versions, write_version_dir

    if engine.model_dir is None:
        raise ServerEngineError(f"{engine.base_url}: update_weights writes an HF folder and needs the model's "
                                "folder for its config files (pass model_dir)")
    if engine.sync_dir is None:
        import tempfile

        engine.sync_dir = Path(tempfile.mkdtemp(prefix="rollwise-sync-"))
    folder, _ = write_version_dir(state_dict, version, engine.sync_dir, engine.model_dir, dtype=engine.dtype)
    engine.reload_from(folder, version)
    delete_older_versions(engine.sync_dir, keep=folder)
