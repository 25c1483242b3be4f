"""Reward shaping for tool use: `fn(rewards [N], lengths [N], group_ids [N], correct [N] bool, parts=None,
**options) -> shaped rewards [N]` float32.

Each function declares the keyword `parts: dict[str, Tensor [N]]`, so the loop hands it every sample's reward
parts (`rollwise.algo.shape_rewards`): the environment's per-episode sums `env/tool_calls`, `env/tool_errors`,
`env/parse_failures` and the verifier's `correct` and `format` (an optional `f1` is used as the answer score
where present). A missing part counts as 0, and `parts=None` (a direct call) means no part at all.
The loop passes `max_len` to every shaping; these functions ignore it.

Where a paper's exact formula could not be read from the material reachable while writing this (see each
docstring), the docstring says so and states the form implemented.
"""

from __future__ import annotations

import torch

from rollwise.algo.registries import SHAPING

Parts = dict[str, torch.Tensor]
TOOL_CALLS = "env/tool_calls"
TOOL_ERRORS = "env/tool_errors"
PARSE_FAILURES = "env/parse_failures"


def part(parts: Parts | None, key: str, like: torch.Tensor) -> torch.Tensor:
    """`parts[key]` as float32 `[N]` shaped like `like`, zeros when absent. ValueError naming the key on a bad shape."""
    if not parts or key not in parts:
        return torch.zeros_like(like, dtype=torch.float32)
    value = torch.as_tensor(parts[key], dtype=torch.float32)
    if value.shape != like.shape:
        raise ValueError(f"reward part {key!r} has shape {tuple(value.shape)}, expected {tuple(like.shape)} "
                         f"(one value per sample)")
    return value


def answer_score(rewards: torch.Tensor, parts: Parts | None) -> torch.Tensor:
    """The answer's score `[N]`: `parts["f1"]` when the verifier gives one, else the reward itself."""
    if parts and "f1" in parts:
        return part(parts, "f1", rewards)
    return rewards.to(torch.float32)


@SHAPING.register("cost_aware")
def cost_aware(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    parts: Parts | None = None,
    cost: float = 0.1,
    free_calls: int = 0,
    max_len: float | None = None,
) -> torch.Tensor:
    """Cost-Aware F1 (CAF) of GraphRAG-R1 (Yu et al. 2025, "GraphRAG-R1: Graph Retrieval-Augmented Generation
    with Process-Constrained Reinforcement Learning", arXiv 2507.23581): the answer's score discounted by
    the number of tool calls, so a right answer reached with fewer calls scores more.

    Implemented form: `r' = s * exp(-cost * max(0, n - free_calls))`, with `s` the answer score
    (`parts["f1"]` when present, else the reward) and `n = parts["env/tool_calls"]`.
    ASSUMPTION: the paper's abstract and the summaries reachable here describe CAF only in words (the
    F1 balanced against computational cost); its exact equation could not be read, so the multiplicative
    exponential discount is our choice. It keeps the ordering CAF is after: a wrong answer (s = 0) stays 0
    whatever it cost, and each extra call shrinks a right one by the factor `exp(-cost)`.
    `free_calls` calls are not discounted (set it to the calls a task needs, e.g. 1 for `lookup`).
    `lengths`, `group_ids`, `correct` and `max_len` are unused.
    """
    if cost < 0 or free_calls < 0:
        raise ValueError(f"cost_aware needs cost >= 0 and free_calls >= 0, got cost={cost}, free_calls={free_calls}")
    calls = part(parts, TOOL_CALLS, rewards)
    billed = (calls - free_calls).clamp(min=0)
    return answer_score(rewards, parts) * torch.exp(-cost * billed)


@SHAPING.register("pra")
def pra(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    parts: Parts | None = None,
    bonus: float = 0.1,
    decay: float = 0.5,
    only_correct: bool = False,
    max_len: float | None = None,
) -> torch.Tensor:
    """Progressive Retrieval Attenuation (PRA) of GraphRAG-R1 (Yu et al. 2025, arXiv 2507.23581): a bonus for
    calling the tool whose increment shrinks with every further call, so the first (essential) calls pay
    and piling on more pays ever less (against shallow retrieval without rewarding endless calls).

    Implemented form: the k-th call (k = 1..n) is worth `bonus * decay^(k-1)`, summed over the episode:

        r' = r + bonus * (1 - decay^n) / (1 - decay)        (r + bonus * n when decay = 1)

    with `n = parts["env/tool_calls"]`, bounded by `bonus / (1 - decay)` for decay < 1. `only_correct=True`
    pays the bonus only to correct answers (`correct`).
    ASSUMPTION: the paper names PRA as "the reward for each further retrieval decays"; its exact equation
    could not be read from the material reachable here, so the geometric decay is our choice.
    `lengths`, `group_ids` and `max_len` are unused.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"pra needs 0 <= decay <= 1, got decay={decay}")
    calls = part(parts, TOOL_CALLS, rewards)
    if decay == 1.0:
        total = bonus * calls
    else:
        total = bonus * (1.0 - torch.pow(torch.tensor(decay, device=calls.device), calls)) / (1.0 - decay)
    if only_correct:
        total = total * correct.to(torch.float32)
    return rewards.to(torch.float32) + total


@SHAPING.register("accumulative_tool")
def accumulative_tool(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    parts: Parts | None = None,
    per_call: float = 0.1,
    max_len: float | None = None,
) -> torch.Tensor:
    """Accumulative tool reward of PyVision-RL (Zhao et al. 2026, "PyVision-RL: Forging Open Agentic Vision
    Models via RL", arXiv 2602.20739), against interaction collapse (the policy learning to stop calling tools):

        r' = r + per_call * n * 1[correct]

    with `n = parts["env/tool_calls"]` (every executed call, including calls whose tool raised; unparseable
    attempts and calls to a tool the env does not have are not calls). Read from the authors' code
    (github.com/agents-x-project/PyVision-RL, `verl_agents`): each executed tool turn returns an env reward
    `tool_using_cumulative_reward_per_turn` (0.1 in their training scripts and README), summed over the episode
    and added to the outcome reward only when the answer is judged right. Our envs stop a turn at the call's closing tag, so one turn holds at most
    one call and calls = tool turns. `lengths`, `group_ids` and `max_len` are unused.
    """
    calls = part(parts, TOOL_CALLS, rewards)
    return rewards.to(torch.float32) + per_call * calls * correct.to(torch.float32)


@SHAPING.register("tool_format")
def tool_format(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    parts: Parts | None = None,
    weight: float = 0.1,
    max_len: float | None = None,
) -> torch.Tensor:
    """A format reward for well-formed tool use, in the spirit of the format terms of tool-use RL recipes
    (R1-style format rewards; GraphRAG-R1's cold-start stage trains format following first):

        r' = r + weight * 1[calls >= 1 and parse_failures == 0] - weight * parse_failures

    with `calls = parts["env/tool_calls"]` and `parse_failures = parts["env/parse_failures"]` (attempted calls
    that could not be parsed, e.g. an unclosed tag, or that name a tool the env does not have). Episodes without
    any call attempt are left as they are.
    `lengths`, `group_ids`, `correct` and `max_len` are unused.
    """
    calls = part(parts, TOOL_CALLS, rewards)
    failures = part(parts, PARSE_FAILURES, rewards)
    clean = ((calls >= 1) & (failures == 0)).to(torch.float32)
    return rewards.to(torch.float32) + weight * clean - weight * failures
