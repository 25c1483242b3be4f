"""Score samples with a reward function: failures are marked and counted, never scored 0.

Scoring runs in the calling thread: math-verify's timeouts (and ours) use SIGALRM, which only works in the
main thread. Our per-sample limit is a SIGALRM timer where possible, plus a check of the elapsed time; a
math-verify call inside the reward function replaces that timer with its own (bounded) one.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from rollwise.config import RewardConfig
from rollwise.rewards.verifiers import REWARDS, RewardFn
from rollwise.types import RewardResult, Sample, Status

DEFAULT_TIMEOUT_S = 20.0
MAX_ERROR_CHARS = 200


class RewardTimeout(TimeoutError):
    """The reward function ran past its time limit."""


class RewardFailure(RuntimeError):
    """The reward function returned something unusable, or set `RewardResult.error`."""


@contextmanager
def time_limit(timeout_s: float | None) -> Iterator[None]:
    """Raise RewardTimeout in the block after `timeout_s` seconds (main thread with SIGALRM only).

    An outer timer (e.g. pytest-timeout) is saved and re-armed with its remaining time afterwards.
    """
    usable = timeout_s and timeout_s > 0 and hasattr(signal, "setitimer")
    if not usable or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"reward function ran longer than {timeout_s} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            remaining = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)


def checked_result(result: Any) -> RewardResult:
    """`result` if it is a usable RewardResult; RewardFailure / TypeError otherwise."""
    if not isinstance(result, RewardResult):
        raise TypeError(f"reward function returned {type(result).__name__}, expected RewardResult")
    if result.error is not None:
        raise RewardFailure(str(result.error))
    if isinstance(result.value, bool) or not isinstance(result.value, (int, float)) or not math.isfinite(result.value):
        raise ValueError(f"reward value {result.value!r} is not a finite number")
    for name, part in result.parts.items():
        if isinstance(part, bool) or not isinstance(part, (int, float)) or not math.isfinite(part):
            raise ValueError(f"reward part {name!r} = {part!r} is not a finite number")
    return result


def call_reward(fn: RewardFn, sample: Sample, timeout_s: float | None) -> RewardResult:
    """Run `fn(sample)` under the time limit and check what it returned."""
    start = time.monotonic()
    with time_limit(timeout_s):
        result = fn(sample)
    elapsed_s = time.monotonic() - start
    if timeout_s and elapsed_s > timeout_s:
        raise RewardTimeout(f"reward function took {elapsed_s:.1f} s, over the {timeout_s} s limit")
    return checked_result(result)


def _error_message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def score_sample(sample: Sample, fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Set the sample's reward, parts and `correct`; on failure mark it FAILED. True when it was scored."""
    try:
        result = call_reward(fn, sample, timeout_s)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # math-verify's TimeoutException derives from BaseException
        sample.status = Status.FAILED
        sample.reward, sample.reward_parts, sample.correct = None, {}, None
        sample.reward_error = _error_message(exc)
        return False
    sample.reward = float(result.value)
    sample.reward_parts = {k: float(v) for k, v in result.parts.items()}
    sample.reward_error = None
    if "correct" in sample.reward_parts:
        sample.correct = sample.reward_parts["correct"] > 0.5
    else:
        sample.correct = sample.reward > 0
    return True


def reward_metrics(scored: list[Sample], num_samples: int) -> dict[str, float]:
    """`reward/` metrics: mean, std, accuracy over scored samples; error count and fraction; part means."""
    errors = num_samples - len(scored)
    metrics = {"reward/errors": float(errors), "reward/error_frac": errors / num_samples if num_samples else 0.0}
    if not scored:
        return metrics
    values = [s.reward for s in scored if s.reward is not None]
    metrics["reward/mean"] = statistics.fmean(values)
    metrics["reward/std"] = statistics.pstdev(values)
    metrics["reward/accuracy"] = sum(bool(s.correct) for s in scored) / len(scored)
    names = sorted({name for s in scored for name in s.reward_parts})
    for name in names:
        parts = [s.reward_parts[name] for s in scored if name in s.reward_parts]
        metrics[f"reward/part/{name}"] = statistics.fmean(parts)
    return metrics


def score_samples(samples: list[Sample], fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """Score every sample in the calling thread; return `reward/` metrics (mean/std/accuracy omitted if none scored)."""
    scored = [s for s in samples if score_sample(s, fn, timeout_s)]
    return reward_metrics(scored, len(samples))


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a plugin 'pkg.module:fn'."""
    fn = REWARDS.get(name)
    if not callable(fn):
        raise TypeError(f"reward {name!r} is {type(fn).__name__}, not a function of a Sample")
    return fn


def build_reward_fn(cfg: RewardConfig, default_reward: str) -> RewardFn:
    """The configured reward (`reward.fn`, else the prompt source's default), plus `format_weight` * format part."""
    fn = get_reward_fn(cfg.fn or default_reward)
    weight = cfg.format_weight
    if weight == 0.0:
        return fn

    def with_format(sample: Sample) -> RewardResult:
        result = fn(sample)
        if not isinstance(result, RewardResult) or result.error is not None:
            return result
        bonus = weight * float(result.parts.get("format", 0.0))
        return RewardResult(value=result.value + bonus, parts=dict(result.parts), error=None)

    with_format.__name__ = f"{getattr(fn, '__name__', 'reward')}_with_format"
    return with_format
