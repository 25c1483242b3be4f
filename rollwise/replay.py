"""The Replay stage: keep samples that still teach and mix them into later batches.

- `hard_case` (ReRULE): groups whose mean reward is below `replay.hard_reward_threshold` and whose rewards still
  vary are stored whole and replayed, `round(mix_ratio x prompts_per_step)` groups per step, with their stored
  advantages.
- `ssr` (selective sample replay, VL-Rethinker, Wang et al. 2025): samples with |advantage| above
  `replay.min_abs_advantage` are stored one by one; when the filters drop zero-advantage groups from a batch,
  that many groups' worth of samples (at most `round(mix_ratio x prompts_per_step x samples_per_prompt)`) are
  drawn with probability proportional to |advantage|.

Entries older than `replay.max_age` policy versions (counted from the oldest token) are evicted, the oldest go
first when the buffer is over `replay.capacity`, and an entry leaves after `replay.max_uses` replays. Replayed
samples keep their behaviour log-probs and version spans, so the trainer's importance correction
(`algo.is_correction`) weighs them against the current policy.

What a step decided about a sample belongs to that step: Self-Routing's route and loss weights, the SFT mark and
the teacher's scores live in the step's marks (rollwise.distill.terms.StepMarks), never on the sample, and the
buffer does not store samples the method left out (routed `skip`). So a replayed sample trains with its stored
reward advantage in any later stage (a `self_distill` one too, whose reward weight was 0 in its own step), and in a
teacher stage it gets no teacher term: it is not re-scored, and old scores (of a live or EMA teacher that has moved
since) are never reused; the trainer gives unmarked samples the reward advantage alone (times
`distill.reward_weight`).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from rollwise.config import ReplayConfig
from rollwise.generate.groups import oldest_version
from rollwise.types import Group, Sample


@dataclass
class Entry:
    """A stored group (`hard_case`) or sample (`ssr`)."""

    samples: list[Sample]
    version: int  # policy version of its oldest token
    priority: float
    uses: int = 0


class ReplayBuffer:
    """`draw` before `add` each step, so a batch never replays its own samples.

    Args:
        cfg: the `[replay]` section.
        prompts_per_step, samples_per_prompt: the batch size that `mix_ratio` scales.
        seed: seed of the draws (its state is saved with `state_dict`).
    """

    def __init__(self, cfg: ReplayConfig, prompts_per_step: int, samples_per_prompt: int, seed: int = 0):
        self.cfg = cfg
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.entries: list[Entry] = []
        self.rng = random.Random(seed)
        self.counts = {"added": 0, "evicted_age": 0, "evicted_capacity": 0}

    @property
    def enabled(self) -> bool:
        return self.cfg.kind != "none"

    def evict(self, version: int) -> None:
        """Drop entries more than `max_age` versions older than `version`."""
        fresh = [e for e in self.entries if version - e.version <= self.cfg.max_age]
        self.counts["evicted_age"] += len(self.entries) - len(fresh)
        self.entries = fresh

    def draw(self, version: int, groups_dropped: int = 0) -> list[Sample]:
        """Samples to replay in the batch trained at `version`; `groups_dropped` = zero-advantage groups the
        filters removed from it (what `ssr` refills)."""
        if not self.enabled:
            return []
        self.evict(version)
        if self.cfg.kind == "hard_case":
            n = round(self.cfg.mix_ratio * self.prompts_per_step)
        else:
            cap = round(self.cfg.mix_ratio * self.prompts_per_step * self.samples_per_prompt)
            n = min(cap, groups_dropped * self.samples_per_prompt)
        picked = self._pick(min(n, len(self.entries)))
        for e in picked:
            e.uses += 1
        self.entries = [e for e in self.entries if e.uses < self.cfg.max_uses]
        self.counts["last_age_sum"] = sum(version - e.version for e in picked)
        self.counts["last_entries"] = len(picked)
        out = [copy.copy(s) for e in picked for s in e.samples]  # what this step does to them stays here
        for s in out:
            s.replayed = True
        return out

    def _pick(self, n: int) -> list[Entry]:
        """`n` distinct entries: uniformly (`hard_case`) or with probability proportional to priority (`ssr`)."""
        if n <= 0:
            return []
        if self.cfg.kind == "hard_case":
            return self.rng.sample(self.entries, n)
        pool, picked = list(self.entries), []
        for _ in range(n):  # weighted draws without replacement
            total = sum(e.priority for e in pool)
            point, acc = self.rng.random() * total, 0.0
            for i, e in enumerate(pool):
                acc += e.priority
                if acc >= point:
                    picked.append(pool.pop(i))
                    break
            else:
                picked.append(pool.pop())
        return picked

    def add(self, groups: list[Group], version: int, trained: list[Sample] | None = None) -> None:
        """Store what qualifies among this step's groups (advantages already set), as copies: what the step's
        method decided about a sample (teacher scores, routes, loss weights) lives in its marks, never on the
        sample. With `trained` (what the method kept for the update), a sample it left out (Self-Routing's
        `skip`) is not stored; `hard_case` judges the whole group and stores the rest of it."""
        if not self.enabled:
            return
        keep = None if trained is None else {id(s) for s in trained}
        for group in groups:
            samples = group.usable()
            kept = [copy.copy(s) for s in samples if keep is None or id(s) in keep]
            if self.cfg.kind == "hard_case":
                rewards = [s.reward for s in samples]
                if kept and len(set(rewards)) > 1 and sum(rewards) / len(rewards) < self.cfg.hard_reward_threshold:
                    self._store(Entry(kept, oldest_version(kept, version), 1.0))
            else:
                for s in kept:
                    if abs(s.advantage) > self.cfg.min_abs_advantage:
                        self._store(Entry([s], oldest_version([s], version), abs(s.advantage)))
        overflow = len(self.entries) - self.cfg.capacity
        if overflow > 0:  # the oldest go first (stable: insertion order among equal versions)
            order = sorted(range(len(self.entries)), key=lambda i: self.entries[i].version)
            gone = set(order[:overflow])
            self.entries = [e for i, e in enumerate(self.entries) if i not in gone]
            self.counts["evicted_capacity"] += overflow

    def _store(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.counts["added"] += 1

    def metrics(self) -> dict[str, float]:
        """`replay/*`: size, totals added and evicted, this step's replayed entries and their mean age."""
        if not self.enabled:
            return {}
        drawn = self.counts.get("last_entries", 0)
        return {
            "replay/size": float(len(self.entries)),
            "replay/added_total": float(self.counts["added"]),
            "replay/evicted_age_total": float(self.counts["evicted_age"]),
            "replay/evicted_capacity_total": float(self.counts["evicted_capacity"]),
            "replay/replayed_entries": float(drawn),
            "replay/replayed_age_mean": self.counts.get("last_age_sum", 0) / drawn if drawn else 0.0,
        }

    def state_dict(self) -> dict:
        return {"entries": self.entries, "rng": self.rng.getstate(), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.entries = state["entries"]
        self.rng.setstate(state["rng"])
        self.counts = dict(state["counts"])
