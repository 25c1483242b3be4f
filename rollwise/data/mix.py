"""A mixture of prompt sources (`[[data.mix]]` tables): each training prompt comes from one source, by weight.

    [[data.mix]]
    task = "reasoning_gym:chain_sum"     # or path = "my.jsonl"; any data key (options, eval_size, system_prompt...)
    options = {min_terms = 2, max_terms = 3}
    weight = 2.0
    [[data.mix]]
    task = "arith"
    name = "arith"                       # default: the dataset or task name, or the file's stem
    reward = "arith"                     # default: the source's own reward

Which source a position draws from is stratified, not independent coin flips: every source holds a credit,
each position adds weight_i / sum(weights) to every credit and draws from the source with the largest credit,
which then pays 1. Over any run of positions each source's count stays within one of its weighted share, so a
step of 8 prompts with weights 1:1 has 4 of each (per-source metrics every step) and a step with 3:1 has 6 and
2. The seed sets the starting credits (each in [0, 1), drawn from `random.Random(f"mix-{seed}")`), so seeds
interleave differently. Source i's own position is how many earlier positions drew from it: each source reads
its own stream in order, and a file source goes through its rows epoch by epoch.

Prompts carry `origin = name` (per-source reward metrics, per-source evaluation) and `info["mix_reward"]`, the
reward of their source, which the `mixture` reward (`rollwise.rewards.mixture`) dispatches to. Held-out prompts:
`eval.n` is split evenly across sources (each evaluates on its own held-out split; a source with fewer gives
what it has and the rest goes to the others), so a small-weight source is measured as precisely as a large one.

State (`state_dict`): the cursor (position, credits, per-source counts) and each source's own state, so a resumed
run continues the same order without replaying the assignment (it replays it from position 0 when asked out of
order: the order depends only on the seed, the weights and the position).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from rollwise.config import DataConfig
from rollwise.data.errors import DatasetError
from rollwise.types import Message, Prompt

MIX_REWARD = "mixture"  # rollwise.rewards.mixture: dispatches to info["mix_reward"]


class MixtureError(DatasetError):
    """A mixture source that cannot be built or mixed; the message names the [[data.mix]] table."""


class MixtureSource:
    """Several prompt sources drawn by weight (module docstring). `build(cfg, seed)` builds one source."""

    splits = ("prompt",)
    default_reward = MIX_REWARD

    def __init__(self, cfg: DataConfig, seed: int, build: Callable[[DataConfig, int], Any]) -> None:
        entries = list(cfg.mix)
        if len(entries) < 1:
            raise MixtureError("data.mix is empty: give at least one [[data.mix]] table")
        self.names = [e.name for e in entries]
        self.weights = [float(e.weight) for e in entries]
        self.system_prompts = [e.system_prompt for e in entries]
        self.sources = []
        for number, entry in enumerate(entries, 1):
            source = build(entry, seed)
            if getattr(source, "default_env", None) is not None:
                raise MixtureError(f'[[data.mix]] number {number} ("{entry.name}"): task {entry.task!r} runs in '
                                   "its own multi-turn environment; a mixture takes single-turn sources only")
            self.sources.append(source)
        self.rewards = [e.reward or s.default_reward for e, s in zip(entries, self.sources)]
        self.name = "mix(" + ", ".join(self.names) + ")"
        self.seed = seed
        total = sum(self.weights)
        self._shares = [w / total for w in self.weights]
        self._start = [random.Random(f"mix-{seed}").random() for _ in entries]
        self._reset()

    # -- training order -----------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._position = 0
        self._credits = list(self._start)
        self._counts = [0] * len(self.sources)

    def _advance(self) -> int:
        """Assign the cursor's position to a source; return the source's index."""
        credits = [c + s for c, s in zip(self._credits, self._shares)]
        best = max(range(len(credits)), key=lambda i: (credits[i], -i))
        credits[best] -= 1.0
        self._credits = credits
        self._counts[best] += 1
        self._position += 1
        return best

    def assign(self, position: int) -> tuple[int, int]:
        """(source index, that source's own position) of the mixture's training position `position`."""
        if position < 0:
            raise ValueError(f"{self.name}: position must be >= 0, got {position}")
        if position < self._position:
            self._reset()  # asked out of order: replay the assignment from the start (it depends on nothing else)
        while self._position < position:
            self._advance()
        index = self._advance()
        return index, self._counts[index] - 1

    def train_prompt(self, position: int) -> Prompt:
        """The training prompt at `position`, from the source the mixture assigns it to."""
        index, own = self.assign(position)
        return self._tag(index, self.sources[index].train_prompt(own))

    def _tag(self, index: int, prompt: Prompt) -> Prompt:
        """The prompt with its origin, its source's reward, a uid unique across sources and the table's system
        prompt (when the table sets one and the prompt has no system turn)."""
        messages: list[Message] = [dict(m) for m in prompt.messages]
        system = self.system_prompts[index]
        if system is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        name = self.names[index]
        return dataclasses.replace(prompt, uid=f"{name}/{prompt.uid}", messages=messages, origin=name,
                                   info={**prompt.info, "mix_reward": self.rewards[index]})

    # -- held-out prompts ---------------------------------------------------------------------------------
    @property
    def num_eval(self) -> int:
        return sum(self._available(s) for s in self.sources)

    @staticmethod
    def _available(source) -> int:
        return int(getattr(source, "num_eval", 0))

    def eval_counts(self, n: int) -> list[int]:
        """How many held-out prompts each source gives for `n`: an even split, capped by each source's held-out
        split, the rest spread over the sources that have more (earlier sources take a remainder first)."""
        if n < 0 or n > self.num_eval:
            raise ValueError(f"{self.name}: asked for {n} eval prompts but the sources' held-out splits hold "
                             f"{self.num_eval} together; lower eval.n or raise data.eval_size in [[data.mix]]")
        counts = [0] * len(self.sources)
        room = [self._available(s) for s in self.sources]
        left = n
        while left > 0:
            open_ = [i for i in range(len(counts)) if counts[i] < room[i]]
            share, extra = divmod(left, len(open_))
            for rank, i in enumerate(open_):
                take = min(room[i] - counts[i], share + (1 if rank < extra else 0))
                counts[i] += take
                left -= take
        return counts

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The held-out prompts of every source (`eval_counts`), source after source, each with its origin."""
        out = []
        for index, (source, count) in enumerate(zip(self.sources, self.eval_counts(n))):
            out += [self._tag(index, p) for p in source.eval_prompts(count)]
        return out

    def split_summary(self) -> str:
        parts = []
        for name, weight, source in zip(self.names, self.weights, self.sources):
            summary = source.split_summary() if hasattr(source, "split_summary") else f"task {source.name}"
            parts.append(f"{name} (weight {weight:g}): {summary}")
        return f"mixture of {len(parts)} sources, eval.n split evenly: " + " | ".join(parts)

    # -- curriculum and state -----------------------------------------------------------------------------
    def observe(self, groups: list) -> dict[str, float]:
        """A source's curriculum (`observe`) sees its own groups; its metrics come back as they are."""
        metrics: dict[str, float] = {}
        for name, source in zip(self.names, self.sources):
            observe = getattr(source, "observe", None)
            if observe is not None:
                metrics.update(observe([g for g in groups if g.prompt.origin == name]))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "weights": list(self.weights), "position": self._position,
                "credits": list(self._credits), "counts": list(self._counts),
                "sources": [s.state_dict() if hasattr(s, "state_dict") else None for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("names") != self.names or state.get("weights") != self.weights:
            raise MixtureError(f"the checkpoint's mixture is {state.get('names')} with weights {state.get('weights')}, "
                               f"the config's {self.names} with weights {self.weights}: resume with the run's own "
                               "[[data.mix]] tables (its config.toml)")
        self._position, self._credits = int(state["position"]), [float(c) for c in state["credits"]]
        self._counts = [int(c) for c in state["counts"]]
        for source, sub in zip(self.sources, state.get("sources", [])):
            if sub is not None and hasattr(source, "load_state_dict"):
                source.load_state_dict(sub)

