"""`rollout.source = "service"`: the run's Generate stage through a `rollwise serve` on another machine.

`ServiceRollouts` has the interface of `rollwise.rollout.LocalRollouts` (`submit`, `wait`, `push_weights`, `close`,
`stats`). A single-turn job is sent as `/v1/completions` calls with token-id prompts (one call per distinct
context, `n` = its samples, sent concurrently; the server batches them into its engine); a run with an
environment sends the job as one `/v1/episodes` job and polls it. Results merge into the samples exactly: the
server's token ids, behaviour and untruncated log-probs and version spans, never re-tokenised text.
`push_weights` POSTs the policy as safetensors bytes to `/v1/weights`.

Every HTTP call is bounded by `rollout.request_timeout_s` (an episode job by that much in all); a server error
stops the run with one `ServiceError` line naming the URL.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from rollwise.generate.groups import FINAL, GenerateStats, is_complete, merge_result
from rollwise.generate.http_engine import ServerEngineError
from rollwise.generate.torch_engine import EngineStats
from rollwise.rollout import JobResult
from rollwise.types import GenerationResult, Group, Sample, SamplingParams, Status, ToolCall

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


KEY_ENV = "ROLLWISE_API_KEY"


class ServiceError(ServerEngineError):
    """The rollout service failed or refused a call; one line naming the URL and what to do (a user error:
    `rollwise train` ends with that line and exit code 2)."""


class ServiceRollouts:
    """Generation by a `rollwise serve` at `url` (see the module docstring): a `rollwise.rollout.Rollouts` whose
    engine is on the server (`engine` None; episodes run there too, `episodes` None here).

    Args:
        url: the server, e.g. `http://10.0.0.2:8765` (`rollout.service_url`).
        api_key: its Bearer token (`rollout.service_api_key`, else $ROLLWISE_API_KEY; one of them is needed).
        tokenizer: the run's (text of continued responses).
        timeout_s: one HTTP call at most (`rollout.request_timeout_s`); an episode job in all.
        env: environment name for episode jobs (None = single-turn completions).
        max_episode_tokens: `env.max_episode_tokens` of episode jobs.
        max_concurrency: completion calls in flight at once.
    """

    engine = None
    episodes = None
    threads = None

    def __init__(self, url: str, api_key: str | None, tokenizer=None, timeout_s: float = 600.0,
                 env: str | None = None, max_episode_tokens: int = 512, max_concurrency: int = 16,
                 poll_s: float = 0.05):
        if not url or not url.startswith(("http://", "https://")):
            raise ServiceError(f"rollout.service_url = {url!r}: give the URL of a running `rollwise serve`, "
                               "e.g. http://127.0.0.1:8765")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.env = env
        self.max_episode_tokens = max_episode_tokens
        self.poll_s = poll_s
        self.stats = EngineStats()
        self.version: int | None = None  # the server's policy version, from its last answer
        key = api_key or os.environ.get(KEY_ENV, "")
        if not key:
            raise ServiceError(f"rollout.source = 'service' needs the token of the server at {self.url}: set "
                               f"${KEY_ENV} (config.toml never holds it, so a resumed run needs it again) or pass "
                               "rollout.service_api_key=...")
        self._client = httpx.Client(base_url=self.url, timeout=self.timeout_s,
                                    headers={"Authorization": f"Bearer {key}"},
                                    limits=httpx.Limits(max_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="rollwise-service")
        self._jobs: dict[int, tuple[list[Group], SamplingParams, int]] = {}
        self.version = self._call("GET", "/health")["policy_version"]

    # -- the rollouts interface ---------------------------------------------------------------------------
    def submit(self, job: int, groups: list[Group], params: SamplingParams, min_version: int = 0,
               stop=None) -> None:
        if stop is not None:
            raise ServiceError("rollout.source = 'service' runs whole jobs: partial rollouts "
                               "(control.partial_rollouts) need rollout.source = 'local'")
        self._jobs[job] = (groups, params, min_version)

    def wait(self, job: int) -> JobResult:
        groups, params, min_version = self._jobs.pop(job)
        start = time.perf_counter()
        requests = sum(s.status not in FINAL for g in groups for s in g.samples)
        if self.env is not None:
            versions = self._run_episodes(groups, params)
        else:
            versions = self._run_completions(groups, params)
        version = min(versions, default=self.version)
        if version is not None and version < min_version:
            raise ServiceError(f"{self.url} served policy version {version}, the run needs >= {min_version}: "
                               "another trainer pushed weights, or the server restarted; restart it and the run")
        completed = sum(is_complete(g) for g in groups)
        aborted = sum(s.status == Status.ABORTED for g in groups for s in g.samples)
        return JobResult(version if version is not None else 0, time.perf_counter() - start,
                         GenerateStats(requests, aborted, completed))

    def push_weights(self, state, version: int) -> None:
        """Send `state` (parameters by name, or a module's) as safetensors bytes; returns when the server
        samples with them."""
        from safetensors.torch import save

        if isinstance(state, torch.nn.Module):
            state = {name: p.detach() for name, p in state.named_parameters()}
        data = save({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
        answer = self._call("POST", f"/v1/weights?version={int(version)}", content=data,
                            headers={"Content-Type": "application/octet-stream"})
        self.version = answer["policy_version"]

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- single turn: completions with token-id prompts ------------------------------------------------------
    def _run_completions(self, groups: list[Group], params: SamplingParams) -> list[int]:
        """One call per distinct (context, tokens left) of the unfinished samples; returns the versions."""
        calls: dict[tuple, list[Sample]] = {}
        for g in groups:
            for s in g.samples:
                if s.status not in FINAL:
                    left = params.max_new_tokens - len(s.response_ids)
                    calls.setdefault((tuple(s.prompt_ids + s.response_ids), left), []).append(s)
        futures = [(samples, self._pool.submit(self._complete, list(ctx), left, len(samples), params))
                   for (ctx, left), samples in calls.items()]
        versions = []
        for samples, future in futures:
            answer = future.result()
            versions.append(answer["policy_version"])
            for sample, choice in zip(samples, answer["choices"], strict=True):
                self._merge_choice(sample, choice, params)
        return versions

    def _complete(self, context: list[int], left: int, n: int, params: SamplingParams) -> dict:
        if left <= 0:  # nothing left to generate: as the engines do, the sample is truncated where it is
            return {"policy_version": self.version, "choices": [None] * n}
        body = {"prompt": context, "max_tokens": left, "n": n, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "stop": list(params.stop) or None,
                "seed": params.seed, "logprobs": 1}
        return self._call("POST", "/v1/completions", json=body)

    def _merge_choice(self, sample: Sample, choice: dict | None, params: SamplingParams) -> None:
        """The server's new tokens appended to the sample's earlier ones (a continued sample keeps its own)."""
        earlier = len(sample.response_ids)
        if choice is None:
            sample.status = Status.TRUNCATED
            return
        ids = list(choice["token_ids"])
        full = choice.get("full_logprobs") or choice["token_logprobs"]
        spans = [(earlier + a, earlier + b, v) for a, b, v in choice["version_spans"]]
        text = choice["text"] if earlier == 0 or self.tokenizer is None else None
        result = GenerationResult(0, sample.response_ids + ids, sample.behaviour_logprobs + choice["token_logprobs"],
                                  _STATUS.get(choice["finish_reason"], Status.ABORTED), spans,
                                  text if text is not None else "",
                                  full_logprobs=(list(sample.full_logprobs or sample.behaviour_logprobs) + list(full)))
        if text is None:
            result.text = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        merge_result(sample, result)
        self.stats.generated_tokens += len(ids)

    # -- episodes: one /v1/episodes job per wait -----------------------------------------------------------
    def _run_episodes(self, groups: list[Group], params: SamplingParams) -> list[int]:
        todo = [g for g in groups if any(s.status not in FINAL for s in g.samples)]
        if not todo:
            return []
        sizes = {len(g.samples) for g in todo}
        if len(sizes) != 1 or any(s.status != Status.PENDING for g in todo for s in g.samples):
            raise ServiceError("rollout.source = 'service' runs fresh groups of equal size as episode jobs; "
                               "continued episodes need rollout.source = 'local'")
        prompts = [{"uid": g.prompt.uid, "messages": g.prompt.messages, "answer": g.prompt.answer,
                    "info": _jsonable(g.prompt.info), "prompt_ids": g.samples[0].prompt_ids} for g in todo]
        body = {"env": self.env, "prompts": prompts, "samples_per_prompt": sizes.pop(),
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "stop": list(params.stop) or None, "seed": params.seed,
                "max_episode_tokens": self.max_episode_tokens}
        job = self._call("POST", "/v1/episodes", json=body)
        state = self._poll(job["id"])
        records = state["episodes"]
        samples = [s for g in todo for s in g.samples]
        if len(records) != len(samples):
            raise ServiceError(f"{self.url}: episode job {job['id']} returned {len(records)} episodes for "
                               f"{len(samples)} samples")
        for sample, record in zip(samples, records):
            merge_episode(sample, record)
            self.stats.generated_tokens += sum(record["loss_mask"])
        return [state["policy_version"]]

    def _poll(self, job_id: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            state = self._call("GET", f"/v1/episodes/{job_id}")
            if state["status"] == "done":
                return state
            if state["status"] in ("failed", "cancelled"):
                raise ServiceError(f"{self.url}: episode job {job_id} {state['status']}: "
                                   f"{state.get('error') or 'cancelled on the server'}")
            if time.monotonic() > deadline:
                self._call("POST", f"/v1/episodes/{job_id}/cancel")
                raise ServiceError(f"{self.url}: episode job {job_id} still {state['status']} after "
                                   f"rollout.request_timeout_s = {self.timeout_s:g} s; cancelled it (raise the limit)")
            time.sleep(self.poll_s)

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise ServiceError(f"{self.url}{path}: no answer within rollout.request_timeout_s = "
                               f"{self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise ServiceError(f"{self.url}{path}: {type(exc).__name__}: {exc} (is `rollwise serve` running "
                               "there? rollout.service_url)") from None
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            hint = " (rollout.service_api_key or $ROLLWISE_API_KEY)" if response.status_code == 401 else ""
            raise ServiceError(f"{self.url}{path}: HTTP {response.status_code}: {message}{hint}")
        return response.json()


def merge_episode(sample: Sample, record: dict) -> None:
    """A server episode record into its sample: tokens, mask, log-probs, spans, turns, tool calls and the
    episode's state (rebuilt as `EpisodeState`, without the env's own state, which stays on the server)."""
    from rollwise.envs.episode import EpisodeState
    from rollwise.metrics.sinks import restore_value

    if record["prompt_ids"] != sample.prompt_ids:
        raise ServiceError(f"episode of prompt {sample.prompt.uid!r}: the server's prompt ids differ from the run's")
    sample.response_ids = list(record["response_ids"])
    sample.behaviour_logprobs = list(record["logprobs"])
    sample.full_logprobs = list(record.get("full_logprobs") or record["logprobs"])
    sample.loss_mask = list(record["loss_mask"])
    sample.version_spans = [tuple(s) for s in record["version_spans"]]
    sample.turns = [(int(a), int(b), str(r)) for a, b, r in record["turns"]]
    sample.tool_calls = [ToolCall(**c) for c in record["tool_calls"]]
    sample.status = Status(record["status"])
    sample.response_text = record["final"]
    timing = record.get("timing", {})
    sample.episode = EpisodeState(
        env_state=None, messages=list(record["transcript"]), turn_start=len(sample.response_ids),
        assistant_turns=record.get("assistant_turns", 0),
        parts={k: restore_value(v) for k, v in record.get("reward_parts", {}).items()},
        parse_failures=record.get("parse_failures", 0), tool_s=timing.get("tool_s", 0.0),
        sandbox_s=timing.get("sandbox_s", 0.0), env_s=timing.get("env_s", 0.0), ended_by=record.get("ended_by", ""),
        final_text=record["final"], retokenize_mismatch=record.get("retokenize_mismatch"), error=record.get("error"))


def _jsonable(info: dict) -> dict:
    """`Prompt.info` values that JSON can carry (the env on the server reads them, e.g. per-prompt records)."""
    import json

    out = {}
    for key, value in info.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def service_rollouts(run) -> ServiceRollouts:
    """The run's ServiceRollouts from `[rollout]` (service_url, service_api_key, request_timeout_s) and its
    environment (`run.episodes`, set when the run's samples are episodes)."""
    from rollwise.config import secret_value
    from rollwise.envs import env_name

    cfg = run.cfg
    episodes = getattr(run, "episodes", None)
    env = env_name(cfg.env, getattr(run.source, "default_env", None)) if episodes is not None else None
    max_tokens = getattr(episodes, "max_episode_tokens", cfg.env.max_episode_tokens)
    return ServiceRollouts(cfg.rollout.service_url, secret_value(cfg.rollout.service_api_key), run.tokenizer,
                           timeout_s=cfg.rollout.request_timeout_s, env=env, max_episode_tokens=max_tokens)
