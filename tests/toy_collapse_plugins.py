"""Plugin rewards for tests/test_collapse_watch.py (`reward.fn = "toy_collapse_plugins:always_one"`).

- `always_one`: every response's extracted answer is "1" and always wrong: the answers collapse onto one.
- `right_then_wrong`: every response correct while sampled by policy versions 0 and 1, wrong from version 2 on
  (by `version_spans`): held-out accuracy 1.0 at steps 0 and 1, then 0.0; the answer is the response's own text.
"""

from __future__ import annotations

from rollwise.types import RewardResult, Sample


def always_one(sample: Sample) -> RewardResult:
    """Wrong, with the answer "1" whatever the response says."""
    return RewardResult(value=0.0, parts={"correct": 0.0}, correct=False, info={"answer": "1"})


def right_then_wrong(sample: Sample) -> RewardResult:
    """Correct when the response's first token was sampled by policy version 0 or 1."""
    version = sample.version_spans[0][2] if sample.version_spans else 0
    ok = version < 2
    return RewardResult(value=float(ok), parts={"correct": float(ok)}, correct=ok)


def majority_from_version_1(sample: Sample) -> RewardResult:
    """A weak model at version 0 that answers the prior from version 1 on, on references "1" / "2": version 0
    answers "1" to the "1" prompts whose question ends in an even digit and "3" to every other prompt; version 1
    on answers "1" to everything. On 6 "1" prompts (3 even) and 2 "2" prompts: version 0 plain 3/8, balanced
    (3/6 + 0/2) / 2 = 0.25; version 1 plain 6/8, balanced (6/6 + 0/2) / 2 = 0.5, with every reply "1"."""
    version = sample.version_spans[0][2] if sample.version_spans else 0
    reference = str(sample.prompt.answer)
    if version >= 1:
        answer = "1"
    else:
        even = int(sample.prompt.messages[-1]["content"].rstrip("?")[-1]) % 2 == 0
        answer = "1" if reference == "1" and even else "3"
    ok = answer == reference
    return RewardResult(value=float(ok), parts={"correct": float(ok)}, correct=ok, info={"answer": answer})
