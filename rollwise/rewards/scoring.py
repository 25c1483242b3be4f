"""Score samples with a reward function: failures are marked and counted, never scored 0.

A reward function takes a `Sample` and returns a `RewardResult(value, parts, error, correct, info)`, or just the
value: a float, an int or a bool (as TRL-style rewards do; numpy scalars and 0-d tensors too). A bool scores
1.0 / 0.0 with part `correct`. `sample.correct` is the result's `correct` when it says (True / False); else a
`correct` part > 0.5 when there is one; else `value > 0`. A reward never writes to the sample: what it wants
kept goes in `RewardResult.info`, merged into `sample.info` here (so it survives `reward.isolate` too). NaN /
Inf, a raised exception or a set `error` mark the sample FAILED with a one-line `reward_error` and the full
`reward_traceback`; it is counted in `reward/errors` and left out of the statistics and the update.

Time limits: `rollwise.rewards.calling` (in-process, what a SIGALRM timer can and cannot stop) and
`rollwise.rewards.isolate` (worker processes, killed past the limit).

Batch hook: a reward object with `score_many(samples, timeout_s) -> [RewardResult | BaseException]` (in order,
`timeout_s` per sample) scores a whole batch in one call: `IsolatedReward` spreads it over worker processes, the
LLM judge (`rollwise.rewards.judge`) sends its requests concurrently. A plain function is called one sample at a
time. Settings hook: a registered reward with `from_config(reward_cfg)` is built from the `[reward]` section by
`build_reward_fn` (and `config_errors(reward_cfg)` says at --dry-run what is wrong with them).

A run where every reward of `reward.max_failed_steps` steps in a row failed stops: `RewardFailureGuard`.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from rollwise.errors import UserError
from rollwise.config import RewardConfig
from rollwise.rewards.calling import (
    as_result,
    call_reward,
    decide_correct,
    error_text,
    get_reward_fn,
    traceback_text,
    with_format_weight,
)
from rollwise.rewards.isolate import IsolatedReward
from rollwise.rewards.verifiers import RewardFn
from rollwise.types import RewardResult, Sample, Status

DEFAULT_TIMEOUT_S = 20.0  # RewardConfig.timeout_s's default, for callers without a config
MAX_ERROR_CHARS = 200


class EnvironmentFailure(RuntimeError):
    """An episode's environment raised: the sample is marked failed like a crashing reward (and counted)."""


class RewardsFailingError(UserError, RuntimeError):
    """Every reward of `reward.max_failed_steps` steps in a row failed; `.traceback` is the first failure's."""

    def __init__(self, message: str, traceback_text: str | None) -> None:
        super().__init__(message)
        self.traceback = traceback_text


def _error_message(exc: BaseException) -> str:
    text = error_text(exc)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def mark_failed(sample: Sample, exc: BaseException) -> None:
    """Mark the sample FAILED: no reward, a one-line `reward_error` and the full `reward_traceback`."""
    sample.status = Status.FAILED
    sample.reward, sample.reward_parts, sample.correct = None, {}, None
    sample.reward_error = _error_message(exc)
    sample.reward_traceback = traceback_text(exc)


def apply_result(sample: Sample, result: RewardResult) -> None:
    """Set the sample's reward, parts, `correct` (`decide_correct`) and merge `result.info` into `sample.info`."""
    sample.reward = float(result.value)
    sample.reward_parts = {k: float(v) for k, v in result.parts.items()}
    episode = getattr(sample, "episode", None)
    if episode is not None:  # the environment's per-episode parts, for shaping (rollwise.envs.episode)
        sample.reward_parts.update({f"env/{k}": float(v) for k, v in episode.parts.items()})
    sample.reward_error, sample.reward_traceback = None, None
    sample.correct = decide_correct(result)
    sample.info.update(result.info)


def is_isolated(fn: Any) -> bool:
    return isinstance(fn, IsolatedReward)


def batch_scorer(fn: Any):
    """The reward's batch hook `score_many(samples, timeout_s)` (see the module docstring); None when it scores
    one sample per call."""
    many = getattr(fn, "score_many", None)
    return many if callable(many) else None


def score_sample(sample: Sample, fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Set the sample's reward, parts and `correct`; on failure mark it FAILED. True when it was scored."""
    return bool(score_batch([sample], fn, timeout_s))


def score_batch(samples: list[Sample], fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[Sample]:
    """Score every sample (in the calling thread, or in `fn`'s worker processes); return those scored.

    A reward with a batch hook (`batch_scorer`: an `IsolatedReward`'s workers, the judge's concurrent requests)
    gets all samples in one call; `timeout_s` holds per sample."""
    failed_env = {i: exc for i, exc in ((i, env_failure(s)) for i, s in enumerate(samples)) if exc is not None}
    todo = [s for i, s in enumerate(samples) if i not in failed_env]
    many = batch_scorer(fn)
    if many is not None:  # raises only for what is not a sample's failure (a worker cannot load the reward)
        outcomes = [_checked(o) for o in many(todo, timeout_s)] if todo else []
        if len(outcomes) != len(todo):
            raise RuntimeError(f"{getattr(fn, '__name__', type(fn).__name__)}.score_many returned {len(outcomes)} "
                               f"outcomes for {len(todo)} samples")
    else:
        outcomes = [call_in_process(fn, s, timeout_s) for s in todo]
    outcomes = iter(outcomes)
    outcomes = [failed_env[i] if i in failed_env else next(outcomes) for i in range(len(samples))]
    scored = []
    for sample, outcome in zip(samples, outcomes):
        if isinstance(outcome, RewardResult):
            apply_result(sample, outcome)
            scored.append(sample)
        else:
            mark_failed(sample, outcome)
    return scored


def env_failure(sample: Sample) -> EnvironmentFailure | None:
    """Why the sample's episode cannot be scored: its environment raised, or gave a part that is NaN / Inf
    (summed into `env/<part>` for shaping, it would reach the update); None when it can."""
    episode = getattr(sample, "episode", None)
    if episode is None:
        return None
    if episode.error:
        return EnvironmentFailure(episode.error)
    bad = sorted(k for k, v in episode.parts.items() if not math.isfinite(float(v)))
    if bad:
        return EnvironmentFailure(f"the environment's reward parts {bad} are not finite numbers "
                                  f"({', '.join(f'{k}={episode.parts[k]!r}' for k in bad)})")
    return None


def _checked(outcome: Any) -> RewardResult | BaseException:
    """A batch hook's outcome: an exception as it is, anything else checked as a reward's return value."""
    if isinstance(outcome, BaseException):
        return outcome
    try:
        return as_result(outcome)
    except Exception as exc:
        return exc


def call_in_process(fn: RewardFn, sample: Sample, timeout_s: float | None) -> RewardResult | BaseException:
    """One call of `fn` in this process within `timeout_s`: its result, or the exception it failed with."""
    try:
        return call_reward(fn, sample, timeout_s)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # math-verify's TimeoutException derives from BaseException
        return exc


def reward_metrics(scored: list[Sample], num_samples: int) -> dict[str, float]:
    """`reward/` metrics: mean, std, accuracy over scored samples; error count and fraction; part means; and
    per mixture source (`Prompt.origin`, `[[data.mix]]`) `reward/<source>/accuracy`, `/mean` and `/samples`
    over that source's scored samples (a source with none this step has no row)."""
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
    origins = sorted({s.prompt.origin for s in scored if s.prompt.origin})
    for origin in origins:
        mine = [s for s in scored if s.prompt.origin == origin]
        metrics[f"reward/{origin}/mean"] = statistics.fmean(s.reward for s in mine if s.reward is not None)
        metrics[f"reward/{origin}/accuracy"] = sum(bool(s.correct) for s in mine) / len(mine)
        metrics[f"reward/{origin}/samples"] = float(len(mine))
    return metrics


def score_samples(samples: list[Sample], fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """Score every sample (see `score_batch`); return `reward/` metrics (mean/std/accuracy omitted if none scored)."""
    return reward_metrics(score_batch(samples, fn, timeout_s), len(samples))


class RewardFailureGuard:
    """Stops a run whose rewards all fail: `observe` raises RewardsFailingError once every reward of
    `max_failed_steps` steps in a row failed (`reward.max_failed_steps`). A step in which one sample was scored
    resets the count; a step with no samples leaves it as it is. The error quotes the streak's first failure.

    State (`state_dict` / `load_state_dict`): the streak and its first failure, so a resumed run keeps counting.
    """

    def __init__(self, max_failed_steps: int) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"reward.max_failed_steps must be at least 1, got {max_failed_steps}")
        self.max_failed_steps = max_failed_steps
        self.streak = 0
        self.first_error: str | None = None
        self.first_traceback: str | None = None

    def observe(self, step: int, samples_scored: int, samples_failed: int,
                first_failed_sample: Sample | None) -> None:
        """Count step `step`: `samples_scored` rewards succeeded, `samples_failed` failed (the first of them
        `first_failed_sample`). Raises RewardsFailingError when the streak of all-failed steps reaches the limit."""
        if samples_scored > 0:
            self.streak, self.first_error, self.first_traceback = 0, None, None
            return
        if samples_failed == 0:
            return
        if self.streak == 0:
            sample = first_failed_sample
            self.first_error = (sample.reward_error if sample is not None else None) or "unknown reward error"
            self.first_traceback = sample.reward_traceback if sample is not None else None
        self.streak += 1
        if self.streak >= self.max_failed_steps:
            raise RewardsFailingError(
                f"reward: every reward failed for {self.streak} steps in a row (step {step}): {self.first_error}; "
                "fix reward.fn (the traceback of that first failure follows)",
                self.first_traceback)

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "first_error": self.first_error, "first_traceback": self.first_traceback}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.first_error, self.first_traceback = state.get("first_error"), state.get("first_traceback")


def build_reward_fn(cfg: RewardConfig, default_reward: str) -> RewardFn:
    """The configured reward (`reward.fn`, else the prompt source's default), plus `format_weight` * format part.

    With `reward.isolate`, an `IsolatedReward` (worker process; call `.close()` at the end of the run) that
    loads the reward by name in the worker; the name is resolved here first, so a typo fails at once."""
    name = cfg.fn or default_reward
    fn = get_reward_fn(name)
    if cfg.isolate:
        return IsolatedReward(name, cfg.format_weight, timeout_s=cfg.timeout_s)
    configure = getattr(fn, "from_config", None)  # a reward with settings in [reward] (the judge)
    if configure is not None:
        errors = reward_setting_errors(cfg)
        if errors:
            raise RewardSettingsError(errors[0])
        fn = configure(cfg)
    return fn if cfg.format_weight == 0.0 else with_format_weight(fn, cfg.format_weight)


class RewardSettingsError(UserError, ValueError):
    """A reward's `[reward]` settings cannot work (e.g. the judge without reward.judge.url)."""


def reward_setting_errors(cfg: RewardConfig, name: str | None = None) -> list[str]:
    """What is wrong with the settings of reward `name` (default `reward.fn`; a `[[data.mix]]` source's reward
    otherwise), checked at --dry-run: its own `config_errors(cfg)`, and `reward.isolate` with a reward built from
    settings (a worker process loads rewards by name only). An unknown name gives none here: name resolution
    reports it."""
    name = cfg.fn if name is None else name
    if name is None:
        return []
    try:
        fn = get_reward_fn(name)
    except Exception:
        return []
    if getattr(fn, "from_config", None) is None:
        return []
    check = getattr(fn, "config_errors", None)
    errors = list(check(cfg)) if check is not None else []
    if cfg.isolate:
        errors.append(f"reward {name!r} is built from its reward.* settings and bounds its own calls; "
                      "reward.isolate loads a reward by name in a worker process: set reward.isolate = false")
    return errors
