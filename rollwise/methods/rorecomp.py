"""`rorecomp`: Rollout Response Recomposition (RoRecomp; "RoRecomp: ... guides models toward concise reasoning by
strategically recomposing the training data", the RoRecomp paper among the seeds).

The paper splits each step's responses into two kinds of batch:

- a priority batch from the online batch: the short-correct and the long-incorrect responses, whose advantages
  (positive on short, negative on long) give the update a clear gradient toward brevity;
- compensation batches of the remaining responses, drawn from a replay buffer, so the update still sees long
  correct and short incorrect responses and the policy does not collapse.

What the abstract leaves open, and what is filled in here:

- "short" and "long" are relative to the response's own group (the lengths of one prompt's responses are
  comparable; across prompts they are not): a correct response is short when its length is at most the median
  length of its group's usable responses, an incorrect one is long when its length is at least that median. A
  group's other responses go to the compensation buffer.
- advantages stay those of the full online group (the Filter stage computes them before the method sees the
  batch), so recomposition changes which responses train, not their advantages.
- rollwise makes one update per step, so a compensation batch joins the step's priority batch in the same update
  once the buffer holds `algo.rorecomp.compensation_size` responses (the oldest first), instead of a separate
  update; entries older than `algo.rorecomp.max_age` policy versions are evicted (the trainer's importance
  correction, `algo.is_correction`, weighs the stale ones). `compensation_size = 0` trains priority
  batches only (the ablation without compensation).

Metrics per step: `rorecomp/priority_frac` (share of the step's fresh responses in the priority batch),
`rorecomp/priority_correct_len_mean` and `rorecomp/priority_incorrect_len_mean` (response tokens),
`rorecomp/compensation_samples` (joined this update), `rorecomp/buffer_size`. A logged fresh sample the method
saw records `rorecomp` = `priority` or `deferred` (to the buffer); the buffer is saved in checkpoints.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

from rollwise.generate.groups import oldest_version
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.types import Sample


@dataclass
class Deferred:
    """A response left out of its step's priority batch, waiting in the compensation buffer."""

    sample: Sample
    version: int  # policy version of its oldest token


def priority_split(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(priority, rest) of one group's samples: correct ones with length <= the group's median length and
    incorrect ones with length >= it (lengths in response tokens)."""
    if not samples:
        return [], []
    median_tokens = statistics.median(len(s.response_ids) for s in samples)
    priority, rest = [], []
    for s in samples:
        n = len(s.response_ids)
        short_correct = bool(s.correct) and n <= median_tokens
        long_incorrect = not s.correct and n >= median_tokens
        (priority if short_correct or long_incorrect else rest).append(s)
    return priority, rest


def _mean_len(samples: list[Sample]) -> float:
    return sum(len(s.response_ids) for s in samples) / len(samples) if samples else 0.0


class RoRecompOptions(MethodOptions, section="algo", name="rorecomp"):
    """`[algo.rorecomp]`."""

    compensation_size: int = Field(16, ge=0, description="responses of a compensation batch (from the buffer of "
                                   "those left out of priority batches) joined to an update once the buffer holds "
                                   "that many; 0 = priority batches only")
    max_age: int = Field(4, ge=0, description="buffered responses older than this many policy versions are evicted")


class RoRecomp(Method):
    """Priority batches from the online batch, compensation batches from a buffer of the rest."""

    options = RoRecompOptions

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.buffer: list[Deferred] = []
        self.tags: dict[int, str] = {}  # id(sample) -> "priority" / "deferred", for the step's sample log

    @classmethod
    def checks(cls, cfg) -> list[str]:
        if cfg.rollout.samples_per_prompt < 2:
            return [f"algo.method = 'rorecomp' compares the lengths of a prompt's responses; "
                    f"rollout.samples_per_prompt = {cfg.rollout.samples_per_prompt}: set it to 2 or more"]
        return []

    def prepare(self, step: StepInput) -> Prepared:
        a = self.setup.cfg.algo
        by_group: dict[int, list[Sample]] = {}
        for s in step.samples:
            by_group.setdefault(s.group_id, []).append(s)
        priority: list[Sample] = []
        deferred: list[Sample] = []
        for samples in by_group.values():
            picked, rest = priority_split(samples)
            priority += picked
            deferred += rest
        self.buffer += [Deferred(s, oldest_version([s], step.step)) for s in deferred]
        self.buffer = [d for d in self.buffer if step.step - d.version <= self.opts.max_age]
        compensation: list[Sample] = []
        size = self.opts.compensation_size
        if size > 0 and len(self.buffer) >= size:
            self.buffer.sort(key=lambda d: d.version)  # stable: the oldest first
            drawn, self.buffer = self.buffer[:size], self.buffer[size:]
            compensation = [copy.copy(d.sample) for d in drawn]
            for s in compensation:
                s.replayed = s.replayed or s.group_id not in by_group
        self.tags = {**{id(s): "deferred" for s in deferred}, **{id(s): "priority" for s in priority}}
        correct = [s for s in priority if s.correct]
        metrics = {
            "rorecomp/priority_frac": len(priority) / len(step.samples) if step.samples else 0.0,
            "rorecomp/priority_correct_len_mean": _mean_len(correct),
            "rorecomp/priority_incorrect_len_mean": _mean_len([s for s in priority if not s.correct]),
            "rorecomp/compensation_samples": float(len(compensation)),
            "rorecomp/buffer_size": float(len(self.buffer)),
        }
        return Prepared(priority + compensation, metrics=metrics, record=self.record)

    def record(self, sample: Sample) -> dict:
        tag = self.tags.get(id(sample))
        return {} if tag is None else {"rorecomp": tag}

    def state_dict(self) -> dict:
        return {"buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = list(state.get("buffer", []))
