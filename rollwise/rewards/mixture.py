"""The reward of a mixture (`[[data.mix]]`): each prompt is scored by its own source's reward.

`rollwise.data.mix.MixtureSource` stamps every prompt with `origin` (its source's name) and
`info["mix_reward"]`, the reward that source uses (the table's `reward`, else the source's default). The
`mixture` reward looks that name up (`REWARDS`, or a plugin 'pkg.mod:fn') and returns its result unchanged, so
partial credit, parts and `correct` are the source's own.

Built by `build_reward_fn` (through `from_config`), it is a `MixtureReward`: a source reward that is built from
`[reward]` settings (the LLM judge) is built once from them, and `score_many` hands each source's samples of a
batch to that source's own batch hook (the judge's concurrent requests), everything else one by one. Called
bare (in a `reward.isolate` worker process, which loads rewards by name), `mixture_reward` dispatches by name;
`rollwise.names` refuses settings-built source rewards with `reward.isolate` at --dry-run.
"""

from __future__ import annotations

from rollwise.config import RewardConfig
from rollwise.rewards.calling import as_result, get_reward_fn
from rollwise.types import RewardResult, Sample


def source_reward_name(sample: Sample) -> str:
    """The reward name of the sample's mixture source (`Prompt.info["mix_reward"]`)."""
    name = sample.prompt.info.get("mix_reward")
    if not name:
        raise ValueError(f"prompt {sample.prompt.source or sample.prompt.uid!r} (origin {sample.prompt.origin!r}) "
                         "carries no mixture reward (info['mix_reward']): the 'mixture' reward scores prompts of "
                         "[[data.mix]] sources only")
    return str(name)


def mixture_reward(sample: Sample) -> RewardResult:
    """The reward of the prompt's mixture source, looked up by name (rewards without settings only)."""
    return as_result(get_reward_fn(source_reward_name(sample))(sample))


class MixtureReward:
    """`mixture_reward` with each source's reward built as `build_reward_fn` builds a run's reward (see the
    module docstring). `close()` closes the source rewards that hold connections or threads."""

    __name__ = "mixture"

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._built: dict[str, object] = {}

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> "MixtureReward":
        return cls(cfg)

    def reward_of(self, name: str):
        """Source reward `name`, built once (from the `[reward]` settings when it takes them)."""
        if name not in self._built:
            fn = get_reward_fn(name)
            configure = getattr(fn, "from_config", None)
            self._built[name] = configure(self.cfg) if configure is not None else fn
        return self._built[name]

    def __call__(self, sample: Sample) -> RewardResult:
        return as_result(self.reward_of(source_reward_name(sample))(sample))

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list:
        """Each sample's returned value or exception, in order: a source's samples together through its batch hook when
        it has one (`rollwise.rewards.scoring.batch_scorer`), else one call each within `timeout_s`."""
        from rollwise.rewards.scoring import batch_scorer, call_in_process

        outcomes: list[RewardResult | BaseException | None] = [None] * len(samples)
        by_source: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            try:
                by_source.setdefault(source_reward_name(sample), []).append(i)
            except ValueError as exc:
                outcomes[i] = exc
        for name, members in by_source.items():
            fn = self.reward_of(name)
            many = batch_scorer(fn)
            subset = [samples[i] for i in members]
            results = many(subset, timeout_s) if many is not None else \
                [call_in_process(fn, s, timeout_s) for s in subset]
            for i, result in zip(members, results, strict=True):
                outcomes[i] = result  # checked by the caller (rollwise.rewards.scoring.score_batch)
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        for fn in self._built.values():
            close = getattr(fn, "close", None)
            if callable(close):
                close()


mixture_reward.from_config = MixtureReward.from_config  # type: ignore[attr-defined]
