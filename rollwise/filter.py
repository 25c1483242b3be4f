"""The Filter stage: group and sample filters returning `FilterResult(keep, reason)`.

Drop reasons are counted as `filter/<reason>` metrics.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from rollwise.registry import Registry
from rollwise.types import FilterResult, Group

GroupFilter = Callable[[Group], FilterResult]
GROUP_FILTERS: Registry = Registry("group filter")


@GROUP_FILTERS.register("all_failed")
def all_failed(group: Group) -> FilterResult:
    """Drop a group none of whose samples could be scored."""
    return FilterResult(keep=bool(group.usable()), reason="all_failed")


@GROUP_FILTERS.register("zero_variance")
def zero_variance(group: Group) -> FilterResult:
    """Drop a group whose usable rewards all equal each other: its GRPO advantages are all zero
    (DAPO's dynamic-sampling criterion, Yu et al. 2025)."""
    rewards = {s.reward for s in group.usable()}
    return FilterResult(keep=len(rewards) > 1, reason="zero_variance")


def apply_filters(groups: list[Group], names: list[str]) -> tuple[list[Group], Counter]:
    """Apply group filters in order; returns the kept groups and the number dropped per reason."""
    filters = [GROUP_FILTERS.get(n) for n in names]
    kept, dropped = [], Counter()
    for group in groups:
        for fn in filters:
            result = fn(group)
            if not result.keep:
                dropped[result.reason] += 1
                break
        else:
            kept.append(group)
    return kept, dropped
