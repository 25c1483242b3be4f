"""Plugin rewards for the evaluation tests (`reward.fn = "toy_eval_plugins:quota_correct"`), with a correctness
the test controls.

- `quota_correct`: for a prompt whose answer is A, the first c = |A| mod (QUOTA_K + 1) calls are correct and
  every later one is wrong. `evaluate` scores a prompt's K sampled responses before its greedy one, so with
  `rollwise eval --k QUOTA_K` prompt A has exactly c correct samples of K (and a wrong greedy one). Call
  `reset_quota()` before each evaluation.
- `peak_at_step_2`: correctness by the policy version that sampled the response (`version_spans`), rising then
  collapsing: a prompt is correct at version v when its bucket (crc32 of its uid mod 4) is below
  LEVELS[v] (LEVELS = 1, 2, 4, 2, 1, 1, ...): all correct at version 2, about a quarter to a half elsewhere.
"""

from __future__ import annotations

import zlib

from rollwise.types import RewardResult, Sample

QUOTA_K = 4
_calls: dict[str, int] = {}


def reset_quota() -> None:
    _calls.clear()


def quota_of(answer: str) -> int:
    """How many of a prompt's QUOTA_K samples `quota_correct` marks correct."""
    return abs(int(answer)) % (QUOTA_K + 1)


def quota_correct(sample: Sample) -> RewardResult:
    """Correct on the first `quota_of(answer)` calls for the prompt (by uid), wrong on the others."""
    uid = sample.prompt.uid
    _calls[uid] = _calls.get(uid, 0) + 1
    ok = _calls[uid] <= quota_of(sample.prompt.answer)
    return RewardResult(value=float(ok), parts={"correct": float(ok)}, correct=ok)


LEVELS = (1, 2, 4, 2, 1)


def bucket(uid: str) -> int:
    return zlib.crc32(uid.encode()) % 4


def peak_at_step_2(sample: Sample) -> RewardResult:
    """Correct when the prompt's bucket is below LEVELS[version] (the version of the response's first token)."""
    version = sample.version_spans[0][2] if sample.version_spans else 0
    level = LEVELS[version] if version < len(LEVELS) else LEVELS[-1]
    ok = bucket(sample.prompt.uid) < level
    return RewardResult(value=float(ok), parts={"correct": float(ok)}, correct=ok)
