"""`reward.fn = "judge"`: an LLM judge behind any OpenAI-compatible chat endpoint (vLLM, `rollwise serve`, a
hosted API), in the LLM-as-a-judge style of Zheng et al. 2023 (MT-Bench) and the `JudgeRubric` of verifiers.

Each sample becomes one `POST {url}/chat/completions` (temperature 0, `max_tokens`; `[reward.judge]`) whose user
message is `reward.judge.template` filled with `{question}` (the prompt's last user turn), `{reference}` (the
prompt's answer; `{answer}` is the same) and `{response}` (the policy's response), each as a block between its
own tags that the text inside cannot close (`rollwise.rewards.judge_verdict`). The judge's answer must end with
its one verdict line `Score: N` (alone on the last non-empty line, the only such line), N in 0..score_max,
and must have finished (`finish_reason` "stop"): the reward is N / score_max, part `judge`, correct at
`threshold` or above. Anything else (no verdict, a verdict not last, several verdict lines, an answer cut
off at `max_tokens`) is a failed judgement, never a score.

A step's samples are judged concurrently (`concurrency` requests in flight) through the batch hook
`score_many` of `rollwise.rewards.scoring`. Each sample has `reward.timeout_s`, retries included: a network
error, a timeout or HTTP 429 / 5xx is retried up to `retries` times with a short backoff; another HTTP
error (408 and 409 included), or an answer that fails as above, is not. A judgement that fails marks its sample
FAILED with the reason (`reward/errors`, `reward_error` in the samples log), never a silent 0; every sample of
`reward.max_failed_steps` steps failing stops the run (`RewardFailureGuard`).

The key: `reward.judge.api_key`, else `$ROLLWISE_JUDGE_API_KEY` (a secret: never written to config.toml), sent
as `Authorization: Bearer`; none when neither is set (a local vLLM). A key bound for a plain `http://` URL whose
host is not loopback gets one warning when the judge is built: it travels unencrypted.
"""

from __future__ import annotations

import ipaddress
import os
import string
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from pydantic import Field

from rollwise.config import RewardConfig, Secret, secret_value
from rollwise.config_methods import MethodOptions
from rollwise.rewards.judge_verdict import (
    DEFAULT_TEMPLATE,
    FIELDS,
    JudgeError,
    check_finished,
    fill,
    parse_score,
)
from rollwise.types import RewardResult, Sample

__all__ = ["DEFAULT_TEMPLATE", "JudgeError", "JudgeOptions", "JudgeReward", "config_errors", "judge", "parse_score"]

KEY_ENV = "ROLLWISE_JUDGE_API_KEY"
BACKOFF_S = 0.5  # before retry r (from 0): BACKOFF_S * 2**r, within the sample's time left
EXCERPT_CHARS = 160
_warned_urls: set[str] = set()


def retried(status: int) -> bool:
    """HTTP statuses worth another try: 429 (rate limit) and 5xx (the server's fault), nothing else."""
    return status == 429 or 500 <= status <= 599


def warn_plain_http(url: str, api_key: str | None) -> None:
    """Once per URL and process: a Bearer key bound for plain http:// on a host that is not loopback."""
    parts = urlsplit(url)
    if not api_key or parts.scheme != "http" or _is_loopback(parts.hostname or "") or url in _warned_urls:
        return
    _warned_urls.add(url)
    print(f"rollwise: warning: reward.judge.url {url!r} is plain http:// to {parts.hostname!r}, not loopback: "
          "the judge's key travels unencrypted with every request; use https://", file=sys.stderr, flush=True)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JudgeOptions(MethodOptions, section="reward", name="judge"):
    """`[reward.judge]` (with `reward.fn = "judge"`): an LLM judge behind an OpenAI-compatible chat endpoint."""

    url: str | None = Field(None, description="base URL of an OpenAI-compatible server, e.g. "
                            "'http://127.0.0.1:8000/v1' (vLLM, `rollwise serve`, a hosted API)")
    model: str | None = Field(None, description="model name sent in each request; None = the first model the "
                              "server lists at /models")
    api_key: Secret | None = Field(None, description="its Bearer token, a secret never written to config.toml; "
                                   "None = $ROLLWISE_JUDGE_API_KEY, else no token", json_schema_extra={"env": KEY_ENV})
    template: str | None = Field(None, description="the user message, with {question}, {reference} and {response}; "
                                 "it must ask for 'Score: N'; None = the built-in one (0-10)")
    max_tokens: int = Field(256, gt=0, description="tokens of one judgement at most (an answer cut off here is a "
                            "failed judgement, never a score)")
    concurrency: int = Field(8, ge=1, description="requests in flight at once (a step's samples are judged "
                             "concurrently)")
    retries: int = Field(2, ge=0, description="retries of a request that failed on the network, timed out or got "
                         "HTTP 429 / 5xx (not of an unparsable answer); reward.timeout_s bounds each sample, retries "
                         "included")
    score_max: float = Field(10.0, gt=0.0, description="the score scale; 'Score: N' becomes N / score_max, and N "
                             "outside 0..score_max is a failed judgement")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="a normalised score at or above this is correct")


def config_errors(cfg: RewardConfig) -> list[str]:
    """What stops the judge's settings from working (checked at --dry-run)."""
    errors = []
    o = JudgeOptions.of(cfg)
    if not o.url:
        errors.append("reward.fn = 'judge' needs reward.judge.url: the base URL of an OpenAI-compatible server, "
                      "e.g. 'http://127.0.0.1:8000/v1'")
    elif not o.url.startswith(("http://", "https://")):
        errors.append(f"reward.judge.url = {o.url!r} must start with http:// or https://")
    template = o.template if o.template is not None else DEFAULT_TEMPLATE
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return errors + [f"reward.judge.template is not a valid template ({exc}); write braces as {{{{ }}}}"]
    unknown = sorted(names - set(FIELDS))
    if unknown:
        errors.append(f"reward.judge.template uses {{{unknown[0]}}}; valid fields: "
                      f"{', '.join('{' + f + '}' for f in FIELDS)} (write a literal brace as {{{{ or }}}})")
    if "response" not in names:
        errors.append("reward.judge.template must contain {response}: the judge cannot grade what it does not see")
    if "Score:" not in template:
        errors.append("reward.judge.template must ask for the verdict as the last line of the judge's answer, "
                      "'Score: N' (only that line is read)")
    return errors


@dataclass
class JudgeReward:
    """The judge: callable on one sample (raises on failure) and `score_many` for a batch (concurrent).

    `close()` ends its HTTP connections and threads (the run calls it at the end)."""

    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    template: str = DEFAULT_TEMPLATE
    max_tokens: int = 64
    concurrency: int = 8
    retries: int = 2
    score_max: float = 10.0
    threshold: float = 0.5
    timeout_s: float = 20.0  # per sample when called on one (score_many takes the caller's)
    _client: httpx.Client | None = field(default=None, init=False, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    __name__ = "judge"

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> "JudgeReward":
        """The judge of the `[reward.judge]` settings (see the module docstring)."""
        o = JudgeOptions.of(cfg)
        api_key = secret_value(o.api_key) or os.environ.get(KEY_ENV) or None
        warn_plain_http(o.url.rstrip("/"), api_key)
        return cls(url=o.url.rstrip("/"), model=o.model, api_key=api_key,
                   template=o.template if o.template is not None else DEFAULT_TEMPLATE,
                   max_tokens=o.max_tokens, concurrency=o.concurrency, retries=o.retries,
                   score_max=o.score_max, threshold=o.threshold, timeout_s=cfg.timeout_s)

    def __call__(self, sample: Sample) -> RewardResult:
        return self.judge(sample, self.timeout_s)

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list[RewardResult | BaseException]:
        """Each sample's result or the exception its judgement failed with, in order; `concurrency` requests
        in flight, `timeout_s` per sample from the moment its first request starts."""
        pool = self._executor()
        futures = [pool.submit(self._outcome, s, timeout_s or self.timeout_s) for s in samples]
        try:
            return [f.result() for f in futures]
        except BaseException:  # Ctrl-C: drop what has not started (a running request ends within its timeout)
            for f in futures:
                f.cancel()
            raise

    def judge(self, sample: Sample, timeout_s: float) -> RewardResult:
        """One judgement within `timeout_s` seconds (retries included); JudgeError on failure."""
        deadline = time.monotonic() + timeout_s
        text = self._ask(self.render(sample), deadline, timeout_s)
        score = parse_score(text, self.score_max)
        correct = score >= self.threshold
        return RewardResult(value=score, parts={"judge": score, "correct": float(correct)}, correct=correct,
                            info={"judge_answer": text[:500]})

    def render(self, sample: Sample) -> str:
        """The judge's user message for `sample`."""
        prompt = sample.prompt
        question = next((m["content"] for m in reversed(prompt.messages) if m.get("role") == "user"), "")
        reference = prompt.answer
        if reference is None and ("{reference}" in self.template or "{answer}" in self.template):
            raise JudgeError(f"prompt {prompt.source or prompt.uid!r} has no reference answer for the judge template")
        return fill(self.template, str(question), "" if reference is None else str(reference), sample.response_text)

    def close(self) -> None:
        with self._lock:
            pool, client, self._pool, self._client = self._pool, self._client, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    # -- HTTP -------------------------------------------------------------------------------------------
    def _outcome(self, sample: Sample, timeout_s: float) -> RewardResult | BaseException:
        try:
            return self.judge(sample, timeout_s)
        except Exception as exc:
            return exc

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="rollwise-judge")
            return self._pool

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
                self._client = httpx.Client(headers=headers, limits=limits)
            return self._client

    def _served_model(self, deadline: float, timeout_s: float) -> str:
        """`[reward.judge] model`, else the first model of GET /models (asked once)."""
        if self.model is None:
            answer = self._request("GET", "/models", None, deadline, timeout_s)
            models = answer.get("data") or []
            if not models or "id" not in models[0]:
                raise JudgeError(f"{self.url}/models lists no model; set reward.judge.model")
            self.model = str(models[0]["id"])
        return self.model

    def _ask(self, content: str, deadline: float, timeout_s: float) -> str:
        body = {"model": self._served_model(deadline, timeout_s), "max_tokens": self.max_tokens,
                "temperature": 0.0, "messages": [{"role": "user", "content": content}]}
        answer = self._request("POST", "/chat/completions", body, deadline, timeout_s)
        try:
            choice = answer["choices"][0]
            text, reason = str(choice["message"]["content"] or ""), choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise JudgeError(f"the judge server's answer has no choices[0].message.content: "
                             f"{_excerpt(str(answer))}") from None
        check_finished(reason, text, self.max_tokens)
        return text

    def _request(self, method: str, path: str, body: dict | None, deadline: float, timeout_s: float) -> dict:
        """The JSON answer of one call, retried on network errors, timeouts and 429 / 5xx within `deadline`."""
        last, sent = "", 0
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sent += 1
            try:
                answer = self._http().request(method, self.url + path, json=body, timeout=left)
            except httpx.TimeoutException:
                last = f"no answer within reward.timeout_s={timeout_s:g} s"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if answer.status_code < 400:
                    try:
                        return answer.json()
                    except ValueError:
                        raise JudgeError(f"the judge server answered {path} with no JSON: "
                                         f"{_excerpt(answer.text)}") from None
                last = f"HTTP {answer.status_code}: {_excerpt(_error_message(answer))}"
                if not retried(answer.status_code):
                    hint = " (reward.judge.api_key or $ROLLWISE_JUDGE_API_KEY)" if answer.status_code == 401 else ""
                    raise JudgeError(f"judge {self.url}{path}: {last}{hint}")
            if attempt < self.retries:
                time.sleep(max(0.0, min(BACKOFF_S * 2**attempt, deadline - time.monotonic())))
        if not sent:
            raise JudgeError(f"judge {self.url}{path}: no request was sent, reward.timeout_s={timeout_s:g} s had "
                             "run out before it")
        raise JudgeError(f"judge {self.url}{path} failed after {sent} attempt(s) within "
                         f"reward.timeout_s={timeout_s:g} s: {last}")


def _error_message(answer: httpx.Response) -> str:
    try:
        error = answer.json().get("error")
        return str(error.get("message") if isinstance(error, dict) else error or answer.text)
    except (ValueError, AttributeError):
        return answer.text


def _excerpt(text: str) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "...")


def judge(sample: Sample) -> RewardResult:
    """reward.fn = "judge": an LLM judge over HTTP, built from the `reward.judge_*` settings by
    `build_reward_fn` (`judge.from_config`); called bare it has no server to ask and fails saying so."""
    raise JudgeError("the judge reward is built from reward.judge.url and the other [reward.judge] settings: "
                     "use rollwise.rewards.build_reward_fn(cfg.reward, ...)")


judge.from_config = JudgeReward.from_config  # type: ignore[attr-defined]
judge.config_errors = config_errors  # type: ignore[attr-defined]
judge.options = JudgeOptions  # type: ignore[attr-defined]
