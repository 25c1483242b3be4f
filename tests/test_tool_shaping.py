"""Tool-use reward shaping (rollwise/algo/tool_shaping.py) against hand-computed values."""

import inspect
import math

import pytest
import torch

from rollwise import algo
from rollwise.algo.tool_shaping import accumulative_tool, cost_aware, pra, tool_format

LENGTHS = torch.tensor([10.0, 20.0, 30.0, 40.0])
GROUPS = torch.tensor([0, 0, 1, 1])
TOOL_SHAPINGS = ("cost_aware", "pra", "accumulative_tool", "tool_format")


def calls(*n: float, **more: list[float]) -> dict[str, torch.Tensor]:
    parts = {"env/tool_calls": torch.tensor(n, dtype=torch.float32)}
    parts.update({f"env/{k}": torch.tensor(v, dtype=torch.float32) for k, v in more.items()})
    return parts


def close(out: torch.Tensor, expected: list[float]) -> None:
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_cost_aware_discounts_by_calls() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    correct = rewards > 0
    out = cost_aware(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3))
    close(out, [1.0, math.exp(-0.1), 0.0, math.exp(-0.3)])  # 1, 0.904837, 0 (wrong stays 0), 0.740818
    free = cost_aware(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3), free_calls=1, cost=0.5)
    close(free, [1.0, 1.0, 0.0, math.exp(-1.0)])  # 3 calls, 1 free: exp(-0.5 * 2)


def test_cost_aware_uses_f1_when_present() -> None:
    parts = {**calls(0, 2, 1, 0), "f1": torch.tensor([0.5, 0.8, 0.0, 1.0])}
    out = cost_aware(torch.ones(4), LENGTHS, GROUPS, torch.ones(4, dtype=torch.bool), parts=parts, cost=0.25)
    close(out, [0.5, 0.8 * math.exp(-0.5), 0.0, 1.0])


def test_pra_bonus_decays_per_call() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    correct = rewards > 0
    out = pra(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3))  # bonus 0.1, decay 0.5
    close(out, [0.0, 1.1, 0.15, 1.175])  # 0; 0.1; 0.1 + 0.05; 0.1 + 0.05 + 0.025
    gated = pra(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3), only_correct=True)
    close(gated, [0.0, 1.1, 0.0, 1.175])
    linear = pra(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3), bonus=0.2, decay=1.0)
    close(linear, [0.0, 1.2, 0.4, 1.6])
    with pytest.raises(ValueError, match="decay"):
        pra(rewards, LENGTHS, GROUPS, correct, parts=calls(0, 1, 2, 3), decay=1.5)


def test_accumulative_tool_pays_calls_of_correct_answers_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = accumulative_tool(rewards, LENGTHS, GROUPS, rewards > 0, parts=calls(3, 2, 0, 1))
    close(out, [1.3, 0.0, 1.0, 0.0])
    out = accumulative_tool(rewards, LENGTHS, GROUPS, rewards > 0, parts=calls(3, 2, 0, 1), per_call=0.25)
    close(out, [1.75, 0.0, 1.0, 0.0])


def test_tool_format_rewards_clean_calls_and_charges_parse_failures() -> None:
    parts = calls(1, 0, 2, 1, parse_failures=[0, 0, 1, 2])
    out = tool_format(torch.zeros(4), LENGTHS, GROUPS, torch.zeros(4, dtype=torch.bool), parts=parts)
    close(out, [0.1, 0.0, -0.1, -0.2])
    out = tool_format(torch.ones(4), LENGTHS, GROUPS, torch.ones(4, dtype=torch.bool), parts=parts, weight=0.5)
    close(out, [1.5, 1.0, 0.5, 0.0])


def test_missing_parts_count_as_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    correct = rewards > 0
    close(cost_aware(rewards, LENGTHS, GROUPS, correct), [1.0, 0.0, 1.0, 0.0])
    close(pra(rewards, LENGTHS, GROUPS, correct, parts={}), [1.0, 0.0, 1.0, 0.0])
    close(accumulative_tool(rewards, LENGTHS, GROUPS, correct, parts={"correct": rewards}), [1.0, 0.0, 1.0, 0.0])
    close(tool_format(rewards, LENGTHS, GROUPS, correct), [1.0, 0.0, 1.0, 0.0])


def test_a_part_of_the_wrong_shape_names_the_key() -> None:
    with pytest.raises(ValueError, match="env/tool_calls"):
        cost_aware(torch.ones(4), LENGTHS, GROUPS, torch.ones(4, dtype=torch.bool), parts=calls(1, 2))


@pytest.mark.parametrize("name", TOOL_SHAPINGS)
def test_registered_and_fed_parts_by_the_loop_entry_point(name: str) -> None:
    fn = algo.SHAPING.get(name)
    assert "parts" in inspect.signature(fn).parameters and inspect.getdoc(fn)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    correct = rewards > 0
    parts = calls(2, 1, 0, 3, parse_failures=[0, 1, 0, 0])
    # the loop passes max_len to every shaping and parts as a keyword (rollwise.algo.shape_rewards)
    via_loop = algo.shape_rewards(name, rewards, LENGTHS, GROUPS, correct, parts=parts, max_len=48)
    direct = fn(rewards, LENGTHS, GROUPS, correct, parts=parts)
    torch.testing.assert_close(via_loop, direct)
    assert not torch.equal(via_loop, rewards)  # the parts reached it
