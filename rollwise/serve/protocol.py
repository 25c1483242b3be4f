"""Request validation and response shapes of `rollwise serve` (OpenAI's completion shapes plus token ids).

Every check raises `BadRequest` with one line naming the field and what is wrong; the app answers 400.
Extensions to OpenAI's shapes, per choice: `token_ids` (the sampled ids), `token_logprobs` (their behaviour
log-probs, also in OpenAI's `logprobs` object), `full_logprobs` (untruncated, what a trainer computes),
`version_spans` (`[start, end, policy_version]`); top level: `policy_version` (and `prompt_token_ids` for chat).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rollwise.serve.jobs import finish_reason
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams

MAX_N = 256  # samples per prompt in one request at most
MAX_LOGPROBS = 20  # OpenAI allows 0..5 (completions) / 0..20 (chat); alternatives are not reported


class BadRequest(ValueError):
    """A user error in a request: HTTP `status` (400 unless said: 413 for a request over a limit) with this
    one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_body(request, limit_mb: float, key: str) -> bytes:
    """The request's body, refused with 413 over `limit_mb` MiB (`serve.<key>`): by its Content-Length before
    any byte is read, and by the bytes received while it streams in (a chunked body has no length)."""
    limit = int(limit_mb * 2**20)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise BadRequest(f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise _too_large(f"{int(declared)} bytes", limit_mb, key)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit} bytes received", limit_mb, key)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit_mb: float, key: str) -> BadRequest:
    return BadRequest(f"the request body ({size}) is over serve.{key} = {limit_mb:g} MB: send less, or raise the "
                      "limit on the server", 413)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes) -> Any:
    """JSON text -> value; BadRequest for text that is not JSON (NaN and Infinity, which Python accepts, are
    not JSON and are refused)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except ValueError as exc:
        reason = str(exc) if "JSON number" in str(exc) else "it does not parse"
        raise BadRequest(f"the request body is not JSON: {reason}") from None


@dataclass(frozen=True)
class Limits:
    """What a request must fit: token ids below `vocab_size`, prompt + max_tokens within `context_tokens`."""

    vocab_size: int
    context_tokens: int


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
        raise BadRequest(f"{key} must be a finite number, got {value!r}")
    return kind(value)


def sampling_from(body: dict, default_max_tokens: int = 16, defaults: SamplingParams | None = None) -> SamplingParams:
    """`max_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `seed` of a request -> SamplingParams. `top_p` and
    `top_k` left out (or null) are `defaults`' (the served run's `rollout.*`; else 1 and 0), and so is `stop` left
    out (`"stop": null` or `[]` is no stop string)."""
    defaults = defaults or SamplingParams()
    max_tokens = _number(body, "max_tokens", default_max_tokens, int)
    if max_tokens <= 0:
        raise BadRequest(f"max_tokens must be > 0, got {max_tokens}")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}")
    top_p = _number(body, "top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = _number(body, "top_k", defaults.top_k, int)
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 = off), got {top_k}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    stop = (body.get("stop") or []) if "stop" in body else list(defaults.stop)
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings")
    greedy = temperature == 0
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=1.0 if greedy else top_p,
                          top_k=0 if greedy else top_k, stop=tuple(stop), seed=seed)


def check_common(body: dict) -> int:
    """`n` (returned), `stream` and `logprobs` of a request."""
    if body.get("stream"):
        raise BadRequest("stream = true is not supported; send the request without it")
    if body.get("echo"):
        raise BadRequest("echo = true is not supported")
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in 1..{MAX_N}, got {n}")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool) and \
            (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (or a boolean), got {logprobs!r}")
    return n


def check_ids(ids: list, limits: Limits, what: str = "prompt") -> list[int]:
    """Token ids: integers in [0, vocab_size), not empty."""
    if not ids:
        raise BadRequest(f"{what} is empty")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{what}[{i}] = {t!r} is not a token id (an integer)")
        if not 0 <= t < limits.vocab_size:
            raise BadRequest(f"{what}[{i}] = {t} is out of the vocabulary (0..{limits.vocab_size - 1})")
    return [int(t) for t in ids]


def check_length(ids: list[int], max_tokens: int, limits: Limits, what: str = "prompt",
                 budget: str = "max_tokens") -> None:
    """`what` plus `max_tokens` new tokens (named `budget`) must fit the model's context."""
    if len(ids) + max_tokens > limits.context_tokens:
        raise BadRequest(f"{what} has {len(ids)} tokens; with {budget} = {max_tokens} that is over the model's "
                         f"context of {limits.context_tokens} tokens: shorten it or lower {budget}")


def check_prompt_count(count: int, max_prompts: int, what: str = "prompt") -> None:
    """At most `max_prompts` prompts in one request (`serve.max_prompts_per_request`); 413 otherwise."""
    if count > max_prompts:
        raise BadRequest(f"{what} holds {count} prompts, over serve.max_prompts_per_request = {max_prompts}: "
                         "split the request", 413)


def completion_prompts(prompt: Any, tokenizer, limits: Limits, max_prompts: int = 1 << 62) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a list of either (a batch) -> token-id prompts,
    at most `max_prompts` of them (413 otherwise, before any is tokenised)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list):
        prompts = [prompt]
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a list of strings or token-id lists")
    check_prompt_count(len(prompts), max_prompts)
    out = []
    for i, p in enumerate(prompts):
        what = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise BadRequest(f"{what} is empty")
            p = [int(t) for t in tokenizer(p)["input_ids"]]
        out.append(check_ids(p, limits, what))
    return out


def chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def engine_requests(prompts: list[list[int]], n: int, params: SamplingParams) -> list[GenerationRequest]:
    """`n` requests per prompt (ids are set by the worker)."""
    return [GenerationRequest(0, list(p), params) for p in prompts for _ in range(n)]


def _choice_extras(result: GenerationResult) -> dict:
    full = result.full_logprobs if len(result.full_logprobs) == len(result.response_ids) else result.logprobs
    return {"finish_reason": finish_reason(result), "token_ids": list(result.response_ids),
            "token_logprobs": list(result.logprobs), "full_logprobs": list(full),
            "version_spans": [list(s) for s in result.version_spans]}


def completion_response(results: list[GenerationResult], prompts: list[list[int]], version: int, model: str,
                        tokenizer) -> dict:
    """OpenAI's text_completion object, with the extensions of the module docstring."""
    choices = []
    for i, r in enumerate(results):
        pieces = [tokenizer.decode([t]) for t in r.response_ids]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": pieces, "token_logprobs": list(r.logprobs), "top_logprobs": None,
                    "text_offset": offsets}
        choices.append({"index": i, "text": r.text, "logprobs": logprobs, **_choice_extras(r)})
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.response_ids) for r in results)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "policy_version": version, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chat_response(results: list[GenerationResult], prompt_ids: list[int], version: int, model: str,
                  tokenizer) -> dict:
    """OpenAI's chat.completion object plus `prompt_token_ids` (the exact ids the engine continued)."""
    choices = []
    for i, r in enumerate(results):
        content = [{"token": (piece := tokenizer.decode([t])), "logprob": lp, "bytes": list(piece.encode()),
                    "top_logprobs": []} for t, lp in zip(r.response_ids, r.logprobs)]
        choices.append({"index": i, "message": {"role": "assistant", "content": r.text},
                        "logprobs": {"content": content}, **_choice_extras(r)})
    completion_tokens = sum(len(r.response_ids) for r in results)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "policy_version": version, "prompt_token_ids": list(prompt_ids), "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens}}
