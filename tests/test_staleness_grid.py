"""The partial-rollout staleness bound holds by construction, over a grid of `control.over_provision`,
`control.max_staleness` and response-length distributions, and nothing generated is lost uncounted.

Most cases drive `Controller.collect` with `ScriptedEngine`, a deterministic engine implementing the `Engine`
protocol whose response lengths are drawn from a chosen distribution: these tests check the controller's
bookkeeping (which groups are continued, finished, batched, kept or dropped), not the engine, so the engine
only has to be faithful to the protocol (continuous batching, abort at the next token, one version span per
call). One case per bound runs the real `TorchEngine` on a tiny random model. The trainer is simulated as the
loop does it: after each step, `rollouts.push_weights(model, version + 1)`.

Checked for every step: every trained token is at most `max_staleness` versions older than the trainer,
every batch holds exactly `prompts_per_step` complete groups, no group is trained twice, older groups go into
the batch before younger ready ones, and engine tokens = trained + carried + ready + counted dropped.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Callable

import pytest
import torch

from conftest import tiny_config
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.control import Controller
from rollwise.generate import EngineCaps, TorchEngine
from rollwise.generate.groups import is_complete, oldest_version
from rollwise.loop import StageTimer
from rollwise.rollout import LocalRollouts
from rollwise.types import GenerationRequest, GenerationResult, Group, Prompt, RewardResult, Status

MAX_NEW_TOKENS = 32
LengthFn = Callable[[int, random.Random], int]  # (prompt number, rng) -> response length in tokens

LENGTHS: dict[str, LengthFn] = {
    "uniform": lambda k, rng: rng.randint(4, 12),
    # every fourth prompt makes the engine write far longer responses (some hit MAX_NEW_TOKENS: truncated)
    "long_tail": lambda k, rng: rng.randint(24, 40) if k % 4 == 0 else rng.randint(2, 6),
    "bimodal": lambda k, rng: rng.randint(2, 4) if rng.random() < 0.5 else rng.randint(16, 20),
}


@dataclass
class ScriptedStats:
    generated_tokens: int = 0


@dataclass
class _Running:
    req: GenerationRequest
    ids: list[int]
    start_len: int
    length: int


class ScriptedEngine:
    """A deterministic `Engine` (rollwise/generate/base.py) for controller tests.

    Continuous batching like `TorchEngine`: up to `max_batch_size` requests decode in lockstep, one token each
    per decode step, in admission order; `on_finish` runs as each finishes and may `abort` the others, which
    stop after their next token (a request aborted before admission returns at once with its tokens). A new
    response draws its length from `length_of(prompt number, rng)` (the prompt number is `prompt_ids[0]`) and
    writes it as its first token, so a continued response keeps its length. Log-probs are all -1.0.
    """

    caps = EngineCaps(continue_aborted=True)

    def __init__(self, length_of: LengthFn, seed: int = 0, max_batch_size: int = 16):
        self.version = 0
        self.stats = ScriptedStats()
        self.length_of, self.rng, self.max_batch_size = length_of, random.Random(seed), max_batch_size
        self._aborted: set[int] = set()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.version = version

    def abort(self, request_ids: list[int]) -> None:
        self._aborted.update(request_ids)

    def close(self) -> None:
        pass

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        results: dict[int, GenerationResult] = {}

        def finish(seq: _Running, status: Status) -> None:
            spans = [(seq.start_len, len(seq.ids), self.version)] if len(seq.ids) > seq.start_len else []
            result = GenerationResult(seq.req.request_id, list(seq.ids), [-1.0] * len(seq.ids), status, spans)
            results[seq.req.request_id] = result
            if on_finish is not None:
                on_finish(result)

        waiting, active = deque(requests), []
        while waiting or active:
            while waiting and len(active) < self.max_batch_size:
                req = waiting.popleft()
                seq = _Running(req, list(req.response_ids), len(req.response_ids),
                               req.response_ids[0] if req.response_ids else 0)
                if seq.start_len >= req.params.max_new_tokens:
                    finish(seq, Status.TRUNCATED)
                elif req.request_id in self._aborted:
                    finish(seq, Status.ABORTED)
                else:
                    active.append(seq)
            for seq in list(active):
                if not seq.ids:
                    seq.length = max(1, self.length_of(seq.req.prompt_ids[0], self.rng))
                seq.ids.append(seq.length if not seq.ids else 1)
                self.stats.generated_tokens += 1
                status = (Status.COMPLETED if len(seq.ids) >= seq.length
                          else Status.TRUNCATED if len(seq.ids) >= seq.req.params.max_new_tokens
                          else Status.ABORTED if seq.req.request_id in self._aborted else None)
                if status is not None:
                    active.remove(seq)
                    finish(seq, status)
        self._aborted.difference_update(results)
        return [results[r.request_id] for r in requests]


def numbered_prompts(encode: Callable[[int], list[int]]):
    """`n -> [(prompt, ids)]`, prompt uids 0, 1, 2, ... in order."""
    counter = count()

    def next_prompts(n):
        return [(Prompt(str(k), [{"role": "user", "content": f"q{k}"}]), encode(k))
                for k in (next(counter) for _ in range(n))]

    return next_prompts


def length_reward(sample) -> RewardResult:
    return RewardResult(value=float(len(sample.response_ids)))


def partial_config(tmp_path, over_provision: float, max_staleness: int, **extra):
    return tiny_config(tmp_path, **{
        "control.partial_rollouts": True, "control.over_provision": over_provision,
        "control.max_staleness": max_staleness, "algo.is_correction": "tis_token",
        "algo.filter_zero_variance": False, "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": MAX_NEW_TOKENS, **extra})


def tokens(groups: list[Group]) -> int:
    return sum(len(s.response_ids) for g in groups for s in g.samples)


def drive(ctl: Controller, rollouts: LocalRollouts, model, steps: int) -> dict[str, float]:
    """Run `steps` steps as the loop does, checking the bound and the token balance after each one."""
    bound, target = ctl.cfg.control.max_staleness, ctl.cfg.rollout.prompts_per_step
    trained_ids: set[int] = set()
    totals = dict.fromkeys(["trained_tokens", "dropped_tokens", "dropped_groups", "forced", "aborted",
                            "old_tokens"], 0.0)
    for step in range(steps):
        version = step  # run.step before the increment
        batch = ctl.collect(step, version, StageTimer())
        assert len(batch.groups) == target and all(is_complete(g) for g in batch.groups), step
        assert batch.metrics["filter/all_failed_frac"] == 0
        for s in (s for g in batch.groups for s in g.samples):
            assert sum(end - start for start, end, _ in s.version_spans) == len(s.response_ids)
            assert all(0 <= version - v <= bound for _, _, v in s.version_spans), (step, s.version_spans)
            totals["old_tokens"] += sum(end - start for start, end, v in s.version_spans if v < version)
        ids = {g.group_id for g in batch.groups}
        assert not ids & trained_ids, f"step {step}: a group was trained twice"
        trained_ids |= ids
        if ctl.ready:  # older groups go into the batch first
            batch_newest = max(oldest_version(g.samples, version) for g in batch.groups)
            assert batch_newest <= min(oldest_version(g.samples, version) for g in ctl.ready)
        # what waits is still trainable at the next version
        assert all(version + 1 - oldest_version(g.samples, version) <= bound for g in ctl.ready + ctl.carried)
        totals["trained_tokens"] += tokens(batch.groups)
        totals["dropped_tokens"] += batch.metrics["control/tokens_stale_dropped"]
        totals["dropped_groups"] += batch.metrics["control/groups_stale_dropped"]
        totals["forced"] += batch.metrics["control/groups_finished_for_staleness"]
        totals["aborted"] += batch.metrics["control/responses_aborted"]
        held = tokens(ctl.carried) + tokens(ctl.ready)
        assert rollouts.engine.stats.generated_tokens == totals["trained_tokens"] + held + totals["dropped_tokens"]
        rollouts.push_weights(model, version + 1)
    return totals


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("max_staleness", [1, 2, 3])
@pytest.mark.parametrize("over_provision", [1.0, 1.5, 2.0, 3.0])
def test_staleness_bound_and_token_balance_over_the_grid(tmp_path, over_provision, max_staleness, lengths):
    cfg = partial_config(tmp_path, over_provision, max_staleness)
    rollouts = LocalRollouts(ScriptedEngine(LENGTHS[lengths], seed=max_staleness))
    ctl = Controller(cfg, rollouts, numbered_prompts(lambda k: [k]), length_reward)
    totals = drive(ctl, rollouts, torch.nn.Module(), steps=8)
    if over_provision == 1.0:  # nothing started beyond the batch: fully on-policy, nothing carried or dropped
        assert totals["aborted"] == totals["old_tokens"] == totals["dropped_groups"] == 0
    else:  # the mechanism was exercised: responses aborted, continued and trained under a later version
        assert totals["aborted"] > 0 and totals["old_tokens"] > 0


def test_due_groups_beyond_the_batch_are_dropped_before_more_compute(tmp_path):
    """Hand-worked: 2 groups needed, 6 started (over_provision 3), max_staleness 1, 2 samples per group (of
    equal length). Prompts 0 and 1 need 2 tokens, every later one 10. Step 0: groups 0 and 1 finish at token 2 and the other
    four are aborted at 2 tokens each (version 0). Step 1: all four are due (age 1) but 2 slots exist: groups 2
    and 3 (ties on tokens: lower id) are finished and trained, groups 4 and 5 (8 tokens) are dropped before
    the round; the 4 new groups (6-9) decode beside them and are aborted when they finish, at 8 tokens."""
    cfg = partial_config(tmp_path, 3.0, 1, **{"rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2})
    rollouts = LocalRollouts(ScriptedEngine(lambda k, rng: 2 if k < 2 else 10))
    ctl = Controller(cfg, rollouts, numbered_prompts(lambda k: [k]), length_reward)
    first = ctl.collect(0, 0, StageTimer())
    assert [g.group_id for g in first.groups] == [0, 1]
    assert [(g.group_id, len(g.samples[0].response_ids)) for g in ctl.carried] == [(2, 2), (3, 2), (4, 2), (5, 2)]
    rollouts.push_weights(torch.nn.Module(), 1)
    second = ctl.collect(1, 1, StageTimer())
    assert [g.group_id for g in second.groups] == [2, 3]
    assert [s.version_spans for g in second.groups for s in g.samples] == [[(0, 2, 0), (2, 10, 1)]] * 4
    assert second.metrics["control/groups_stale_dropped"] == 2 and second.metrics["control/tokens_stale_dropped"] == 8
    assert second.metrics["control/groups_finished_for_staleness"] == 2
    assert sorted(g.group_id for g in ctl.carried) == [6, 7, 8, 9] and ctl.ready == []
    assert all(g.samples[0].version_spans == [(0, 8, 1)] for g in ctl.carried)


def test_a_due_group_is_finished_even_when_ready_groups_fill_the_batch(tmp_path):
    """Hand-worked: max_staleness 2, 2 groups needed, over_provision 2.5 (5 started), 2 samples each (of equal length). Lengths:
    prompts 2 and 3 take 4 tokens, prompt 4 takes 30, every other one 2.
    Step 0: groups 0, 1 finish at token 2; 2, 3, 4 are aborted at 2 tokens (version 0).
    Step 1: 2, 3, 4 continue beside new groups 5, 6; at the next 2 tokens 2 and 3 finish, 5 and 6 finish
    with them, 4 is aborted again. The batch is the oldest, 2 and 3; 5 and 6 wait in `ready`.
    Step 2: 5 and 6 would fill the batch, but 4 is 2 versions old (due): a round runs for it alone, no new
    group starts, and 4 goes into the batch first; 6 waits (1 version old, trainable at version 3)."""
    cfg = partial_config(tmp_path, 2.5, 2, **{"rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2})
    rollouts = LocalRollouts(ScriptedEngine(lambda k, rng: {2: 4, 3: 4, 4: 30}.get(k, 2)))
    ctl = Controller(cfg, rollouts, numbered_prompts(lambda k: [k]), length_reward)
    model = torch.nn.Module()
    batches = []
    for version in range(3):
        batches.append(ctl.collect(version, version, StageTimer()))
        rollouts.push_weights(model, version + 1)
    assert [[g.group_id for g in b.groups] for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert [b.metrics["control/groups_finished_for_staleness"] for b in batches] == [0, 0, 1]
    assert batches[2].groups[0].samples[0].version_spans == [(0, 2, 0), (2, 4, 1), (4, 30, 2)]
    assert ctl.next_group_id == 7 and ctl.carried == [] and [g.group_id for g in ctl.ready] == [6]
    assert sum(b.metrics["control/groups_stale_dropped"] for b in batches) == 0


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    return tok, tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.mark.parametrize("over_provision, max_staleness", [(3.0, 1), (2.0, 2)])
def test_staleness_bound_with_the_real_engine(tiny, tmp_path, over_provision, max_staleness):
    """The tiny random model with a stop string (lengths vary widely: a long tail) and real weight pushes."""
    tok, model = tiny
    cfg = partial_config(tmp_path, over_provision, max_staleness, **{
        "rollout.stop": ["e"], "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 16})
    rollouts = LocalRollouts(TorchEngine(model, tok, max_batch_size=cfg.rollout.max_batch_size))
    ctl = Controller(cfg, rollouts, numbered_prompts(lambda k: tok(f"question {k}").input_ids), length_reward)
    totals = drive(ctl, rollouts, model, steps=5)
    assert totals["aborted"] > 0 and totals["old_tokens"] > 0 and totals["forced"] > 0
