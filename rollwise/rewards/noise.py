"""Verifier noise: false-positive / false-negative flips of any reward at set rates, for experiments on how
robust training is to an imperfect verifier (`reward.noise.fp`, `reward.noise.fn`, `reward.noise.seed`).

    clean verdict incorrect: with probability fp  -> reward 1.0, correct   (a false positive)
    clean verdict correct:   with probability fn  -> reward 0.0, incorrect (a false negative)

Issue 23's "verifier noise" item (the seeds study rewards from imperfect verifiers; no single paper's formula):
what is filled in here, and why:
- The noise is a binary verifier's: a flipped sample gets the reward of a plain 1 / 0 verifier, whatever the
  wrapped reward's scale; the clean verdict is `rollwise.rewards.calling.decide_correct` of the wrapped result.
- A flip is a pure function of (`seed`, the prompt's uid, the response text): reproducible, independent of
  batch order and worker count, and the same after a resume. Two identical responses to one prompt flip
  together (a verifier that errs on an input errs on it every time).
- Only training rewards are noisy: `rollwise.build` wraps the reward the Control stage scores with; held-out
  evaluation keeps the clean reward, so the effect on accuracy is measured against the truth.
- The clean outcome stays recorded as parts `clean_correct` and `clean_reward`; the flips are parts
  `noise_flipped_fp` / `noise_flipped_fn` (1 on a flipped sample), so the step rows carry
  `reward/part/noise_flipped_fp` and `_fn` (fraction of scored samples flipped) and `reward/part/clean_correct`
  (the clean accuracy) beside the noisy `reward/accuracy`.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from pydantic import Field

from rollwise.config import RewardConfig
from rollwise.config_methods import MethodOptions
from rollwise.rewards.calling import as_result, call_reward, decide_correct
from rollwise.types import RewardResult, Sample


def flip_draw(seed: int, sample: Sample) -> float:
    """A uniform number in [0, 1) fixed by (seed, prompt uid, response text)."""
    key = f"{seed}\x00{sample.prompt.uid}\x00{sample.response_text}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0 ** 64


def flip(result: RewardResult, draw: float, fp: float, fn: float) -> RewardResult:
    """The result after the noise of one sample whose draw is `draw` (see the module docstring)."""
    clean = decide_correct(result)
    flipped_fp = (not clean) and draw < fp
    flipped_fn = clean and draw < fn
    parts = {**result.parts, "clean_correct": 1.0 if clean else 0.0, "clean_reward": float(result.value),
             "noise_flipped_fp": float(flipped_fp), "noise_flipped_fn": float(flipped_fn)}
    if not (flipped_fp or flipped_fn):
        return replace(result, parts=parts)
    noisy = 1.0 if flipped_fp else 0.0
    if "correct" in parts:
        parts["correct"] = noisy
    return replace(result, value=noisy, parts=parts, correct=bool(flipped_fp))


class NoisyReward:
    """`inner` with verifier noise (see the module docstring). Batches through `inner.score_many` when it has
    one (worker processes, the judge, CME), else scores one sample at a time under `timeout_s`."""

    def __init__(self, inner: Any, fp: float, fn: float, seed: int = 0) -> None:
        if not (0.0 <= fp <= 1.0 and 0.0 <= fn <= 1.0):
            raise ValueError(f"reward.noise.fp = {fp} and reward.noise.fn = {fn} must lie in [0, 1]")
        self.inner, self.fp, self.fn, self.seed = inner, fp, fn, seed
        self.__name__ = f"noisy({getattr(inner, '__name__', type(inner).__name__)})"

    def __call__(self, sample: Sample) -> RewardResult:
        return self._noisy(sample, as_result(self.inner(sample)))

    def _noisy(self, sample: Sample, result: RewardResult) -> RewardResult:
        return flip(result, flip_draw(self.seed, sample), self.fp, self.fn)

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list[RewardResult | BaseException]:
        many = getattr(self.inner, "score_many", None)
        outcomes = many(samples, timeout_s) if callable(many) else [self._one(s, timeout_s) for s in samples]
        noisy: list[RewardResult | BaseException] = []
        for sample, outcome in zip(samples, outcomes):
            if isinstance(outcome, BaseException):
                noisy.append(outcome)
                continue
            try:
                noisy.append(self._noisy(sample, as_result(outcome)))
            except Exception as exc:  # a malformed return value: a failed reward, as without noise
                noisy.append(exc)
        return noisy

    def _one(self, sample: Sample, timeout_s: float | None) -> RewardResult | BaseException:
        try:
            return call_reward(self.inner, sample, timeout_s)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # math-verify's TimeoutException derives from BaseException
            return exc


class NoiseOptions(MethodOptions, section="reward", name="noise", always=True):
    """`[reward.noise]`: verifier noise, flips of the training reward (never of held-out evaluation), whatever
    reward.fn is."""

    fp: float = Field(0.0, ge=0.0, le=1.0, description="probability that an incorrect response is scored as correct "
                      "(reward 1, correct) in training")
    fn: float = Field(0.0, ge=0.0, le=1.0, description="probability that a correct response is scored as incorrect "
                      "(reward 0, not correct) in training")
    seed: int = Field(0, description="seed of the flips (a flip depends on the seed, the prompt and the response "
                      "text only)")


def training_reward(fn: Any, cfg: RewardConfig) -> Any:
    """The reward the Control stage trains on: `fn` with verifier noise when `[reward.noise]` fp or fn is above 0,
    else `fn` itself."""
    o = NoiseOptions.of(cfg)
    if o.fp == 0.0 and o.fn == 0.0:
        return fn
    return NoisyReward(fn, o.fp, o.fn, o.seed)
