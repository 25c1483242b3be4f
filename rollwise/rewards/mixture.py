"""The reward of a mixture (`[[data.mix]]`): each prompt is scored by its own source's reward.

`rollwise.data.mix.MixtureSource` stamps every prompt with `origin` (its source's name) and
`info["mix_reward"]`, the reward that source uses (the table's `reward`, else the source's default). This reward
looks that name up (`REWARDS`, or a plugin 'pkg.mod:fn') and returns its result unchanged, so partial credit,
parts and `correct` are the source's own; the name travels with the prompt, so it works in reward worker
processes (`reward.isolate`) too.
"""

from __future__ import annotations

from rollwise.rewards.calling import as_result, get_reward_fn
from rollwise.types import RewardResult, Sample


def mixture_reward(sample: Sample) -> RewardResult:
    """The reward of the prompt's mixture source (`Prompt.info["mix_reward"]`, set by [[data.mix]])."""
    name = sample.prompt.info.get("mix_reward")
    if not name:
        raise ValueError(f"prompt {sample.prompt.source or sample.prompt.uid!r} (origin {sample.prompt.origin!r}) "
                         "carries no mixture reward (info['mix_reward']): the 'mixture' reward scores prompts of "
                         "[[data.mix]] sources only")
    return as_result(get_reward_fn(str(name))(sample))
