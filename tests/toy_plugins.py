"""Plugin rewards for tests, loaded by dotted path (`reward.fn = "toy_plugins:digit_fraction"`).

`tests/` is put on `sys.path` by conftest.py (and on PYTHONPATH for CLI subprocesses).

- `digit_fraction`: dense, continuous reward a randomly initialised tiny model can climb with GRPO: the
  fraction of the response's tokens that decode to digits only. Groups almost always have variance.
- `slow_digit_fraction`: `digit_fraction` after sleeping `$ROLLWISE_TEST_REWARD_SLEEP` seconds (0 when unset),
  to slow a CLI run down enough to kill it mid-run.
- `flaky_digit_fraction`: the same, but raises on every response whose first token id is even, so about
  half the samples fail; the loop must count them (`reward/errors`) and leave them out of the statistics.
- `flaky_always_right`: 1.0 (correct) on every response it scores, raising on the same ones as above.
- `answer_matches` (returns a bool), `hang_in_c`, `crash_on_request`, `sleep_then_one` (return floats): rewards
  for the plain-value and worker-process tests of tests/test_rewards.py.
"""

from __future__ import annotations

import os
import time

from rollwise.types import RewardResult, Sample


def digit_fraction(sample: Sample) -> RewardResult:
    """Digit characters in the response text per response token (EOS included), capped at 1.

    A response made only of single-digit tokens scores 1; one with no digit scores 0; empty responses 0."""
    n_tokens = len(sample.response_ids)
    if n_tokens == 0:
        return RewardResult(value=0.0, parts={"digits": 0.0})
    digits = sum(ch.isdigit() for ch in sample.response_text)
    value = min(1.0, digits / n_tokens)
    return RewardResult(value=value, parts={"digits": float(digits)})


class FlakyRewardError(RuntimeError):
    """Raised on purpose by `flaky_digit_fraction`."""


def flaky_digit_fraction(sample: Sample) -> RewardResult:
    """`digit_fraction`, but raises for responses whose first token id is even (and for empty ones)."""
    if not sample.response_ids or sample.response_ids[0] % 2 == 0:
        raise FlakyRewardError(f"refusing to score a response starting with token {sample.response_ids[:1]}")
    return digit_fraction(sample)


def is_flaky_failure(response_ids: list[int]) -> bool:
    """True when `flaky_digit_fraction` raises for a response with these ids."""
    return not response_ids or response_ids[0] % 2 == 0


def slow_digit_fraction(sample: Sample) -> RewardResult:
    """`digit_fraction` after sleeping `$ROLLWISE_TEST_REWARD_SLEEP` seconds (no sleep when unset)."""
    delay = float(os.environ.get("ROLLWISE_TEST_REWARD_SLEEP", "0") or 0)
    if delay > 0:
        time.sleep(delay)
    return digit_fraction(sample)


def flaky_always_right(sample: Sample) -> RewardResult:
    """Correct (1.0) on every response it scores; raises where `flaky_digit_fraction` does."""
    if is_flaky_failure(sample.response_ids):
        raise FlakyRewardError(f"refusing to score a response starting with token {sample.response_ids[:1]}")
    return RewardResult(value=1.0, parts={"correct": 1.0})


# ---------------------------------------------------------------- plugins for tests/test_bad_inputs.py

def float_digit_fraction(sample: Sample) -> float:
    """`digit_fraction` as a plain float, the way TRL-style reward functions return it."""
    return digit_fraction(sample).value


def always_raises(sample: Sample) -> RewardResult:
    """A reward that raises on every sample."""
    raise FlakyRewardError("this reward always fails")


_NAN_LOSS_CALLS = {"n": 0}


def nan_loss(logp, old_logp, advantages, mask, **options):
    """The plain policy-gradient loss, times NaN on the first `$ROLLWISE_TEST_NAN_CALLS` calls (all when unset)."""
    import math

    import torch

    _NAN_LOSS_CALLS["n"] += 1
    limit = int(os.environ.get("ROLLWISE_TEST_NAN_CALLS", "0") or 0)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    per_token = -(logp * adv) * mask
    poison = limit <= 0 or _NAN_LOSS_CALLS["n"] <= limit
    return per_token * (math.nan if poison else 1.0), {"clip_frac": torch.tensor(0.0)}


def length_bonus(rewards, lengths, group_ids, correct, scale: float = 0.0, **options):
    """Reward shaping plugin: `rewards + scale * lengths` (0 by default: no change)."""
    return rewards + scale * lengths


# ---- plain-value and misbehaving rewards for tests/test_rewards.py (loaded by name in reward worker processes)


def answer_matches(sample: Sample) -> bool:
    """TRL-style: True when the stripped response equals the reference answer."""
    return sample.response_text.strip() == (sample.prompt.answer or "")


def hang_in_c(sample: Sample) -> float:
    """The response length as a float; a response containing "hang" runs a C loop (`sum` over a range) that
    holds the GIL for hours and never returns to the interpreter, so no signal handler can run."""
    if "hang" in sample.response_text:
        return float(sum(range(10**15)))
    return float(len(sample.response_text))


def crash_on_request(sample: Sample) -> float:
    """1.0; the process exits at once (as a segfaulting extension would) when the response contains "crash"."""
    if "crash" in sample.response_text:
        os._exit(3)
    return 1.0


def sleep_then_one(sample: Sample) -> float:
    """1.0 after sleeping `sample.info["sleep_s"]` seconds (0 when unset)."""
    time.sleep(float(sample.info.get("sleep_s", 0.0)))
    return 1.0


# -- a toy tool environment (tests/test_episodes_learning.py) ------------------------------------------------
class ToyToolEnv:
    """A turn that ends at one of the digits 7, 8, 9 is a "tool call": the tool answers `ok` and the episode
    goes on, up to `max_turns`; any other turn ends it. A random tiny model calls about once per three
    episodes; the reward `tool_call_fraction` pays for calls, so GRPO must raise it."""

    name = "toy_tool"
    stop = ("7", "8", "9")

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns

    def reset(self, prompt):
        return {"turn": 0}

    def step(self, state, text):
        from rollwise.envs.base import StepResult
        from rollwise.types import ToolCall

        state["turn"] += 1
        if not text.endswith(self.stop):
            return StepResult(done=True, reward_parts={"tool_calls": 0.0})
        call = ToolCall(name="digit", args={"text": text[-1]}, turn=state["turn"] - 1, result="ok")
        return StepResult(messages=[{"role": "tool", "content": "ok"}], reward_parts={"tool_calls": 1.0},
                          tool_calls=[call])


def toy_tool_env(cfg):
    return ToyToolEnv(cfg.max_turns)


def tool_call_fraction(sample: Sample) -> RewardResult:
    """Tool calls of the episode per allowed turn (the env's summed `tool_calls` part)."""
    calls = sample.episode.parts.get("tool_calls", 0.0)
    return RewardResult(value=calls / 3.0, parts={"calls": calls})


def even_id_fraction(sample: Sample) -> float:
    """The share of the response's token ids that are even: a reward that varies between the samples of a random
    model whatever its tokenizer decodes (benchmarks/gpu_check.py's random models)."""
    ids = sample.response_ids
    return sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0
