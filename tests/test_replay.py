"""Replay buffers: what `hard_case` and `ssr` store, how much they replay (mix ratio), age and capacity
eviction, use counts, and that a checkpointed buffer draws the same as the original."""

import pytest

from rollwise.config import ReplayConfig
from rollwise.replay import ReplayBuffer
from rollwise.types import Group, Prompt, Sample, Status


def group(gid: int, rewards: list[float], version: int = 0, advantages: list[float] | None = None) -> Group:
    prompt = Prompt(str(gid), [])
    samples = []
    for i, r in enumerate(rewards):
        s = Sample(prompt, [1, gid], [5, 6, 7], [-0.1] * 3, [1] * 3, Status.COMPLETED, gid,
                   version_spans=[(0, 3, version)], reward=r)
        s.advantage = advantages[i] if advantages else r - sum(rewards) / len(rewards)
        samples.append(s)
    return Group(gid, prompt, samples)


def buffer(kind: str, **options) -> ReplayBuffer:
    return ReplayBuffer(ReplayConfig(kind=kind, **options), prompts_per_step=4, samples_per_prompt=4, seed=0)


def test_hard_case_keeps_low_reward_groups_that_still_vary():
    buf = buffer("hard_case", hard_reward_threshold=0.5)
    buf.add([group(0, [1, 0, 0, 0]),   # mean 0.25, varies: hard case
             group(1, [1, 1, 1, 0]),   # mean 0.75: not hard
             group(2, [0, 0, 0, 0]),   # no variance: teaches nothing
             group(3, [0.5, 0, 0, 0])], version=0)
    assert sorted(e.samples[0].group_id for e in buf.entries) == [0, 3]
    assert all(len(e.samples) == 4 for e in buf.entries)


def test_hard_case_replays_mix_ratio_times_prompts_per_step_groups_once():
    buf = buffer("hard_case", mix_ratio=0.5, max_uses=1)
    buf.add([group(g, [1, 0, 0, 0]) for g in range(5)], version=0)
    first = buf.draw(version=1)
    assert len(first) == 2 * 4  # round(0.5 * 4) groups of 4 samples
    assert all(s.replayed for s in first)
    second = buf.draw(version=1)
    assert len(second) == 2 * 4 and not {id(s) for s in first} & {id(s) for s in second}  # each used once
    assert len(buf.draw(version=1)) == 4  # one group left
    assert buf.draw(version=1) == [] and buf.metrics()["replay/size"] == 0


def test_entries_older_than_max_age_are_evicted():
    buf = buffer("hard_case", max_age=2, mix_ratio=1.0, max_uses=10)
    buf.add([group(0, [1, 0, 0, 0], version=0)], version=0)
    buf.add([group(1, [1, 0, 0, 0], version=1)], version=1)
    assert len(buf.draw(version=2)) == 8  # ages 2 and 1: both still within max_age
    drawn = buf.draw(version=3)  # group 0 is now 3 versions old
    assert {s.group_id for s in drawn} == {1}
    assert buf.metrics()["replay/evicted_age_total"] == 1
    assert buf.metrics()["replay/replayed_age_mean"] == 2.0


def test_age_counts_from_the_oldest_token_of_a_continued_response():
    buf = buffer("hard_case", max_age=1, mix_ratio=1.0)
    g = group(0, [1, 0, 0, 0], version=3)
    g.samples[0].version_spans = [(0, 1, 1), (1, 3, 3)]  # began under version 1
    buf.add([g], version=3)
    assert buf.entries[0].version == 1
    assert buf.draw(version=3) == []  # 2 versions old


def test_ssr_stores_nonzero_advantage_samples_and_refills_only_dropped_groups():
    buf = buffer("ssr", mix_ratio=0.5, min_abs_advantage=0.1)
    buf.add([group(0, [1, 0, 0, 0], advantages=[1.5, -0.5, -0.5, -0.05])], version=0)
    assert sorted(e.priority for e in buf.entries) == [0.5, 0.5, 1.5]  # |A| <= 0.1 is not kept
    assert buf.draw(version=1, groups_dropped=0) == []  # a full batch needs no replay
    buf.add([group(1, [1, 0, 0, 0], advantages=[1.0] * 4), group(2, [1, 0, 0, 0], advantages=[1.0] * 4)], 1)
    drawn = buf.draw(version=2, groups_dropped=1)
    assert len(drawn) == 4  # one dropped group's worth of samples
    drawn = buf.draw(version=2, groups_dropped=4)
    assert len(drawn) == 7  # capped by what is left (cap = round(0.5 * 4 * 4) = 8)


def test_ssr_draws_in_proportion_to_abs_advantage():
    counts = {"big": 0, "small": 0}
    for seed in range(400):
        buf = ReplayBuffer(ReplayConfig(kind="ssr", mix_ratio=1.0), 4, 4, seed=seed)
        buf.add([group(0, [1, 0], advantages=[3.0, 1.0])], version=0)
        (s,) = buf.draw(version=0, groups_dropped=1)[:1]
        counts["big" if s.advantage == 3.0 else "small"] += 1
    assert counts["big"] / 400 == pytest.approx(0.75, abs=0.06)


def test_capacity_evicts_the_oldest_first():
    buf = buffer("hard_case", capacity=2)
    for v in range(4):
        buf.add([group(v, [1, 0, 0, 0], version=v)], version=v)
    assert [e.version for e in buf.entries] == [2, 3]
    assert buf.metrics()["replay/evicted_capacity_total"] == 2


def test_state_dict_round_trip_draws_the_same():
    a = buffer("ssr", mix_ratio=1.0)
    a.add([group(g, [1, 0, 0, 0], advantages=[1.0, 2.0, 3.0, 4.0]) for g in range(3)], version=0)
    b = buffer("ssr", mix_ratio=1.0)
    b.load_state_dict(a.state_dict())
    da, db = a.draw(0, groups_dropped=1), b.draw(0, groups_dropped=1)
    assert [(s.group_id, s.advantage) for s in da] == [(s.group_id, s.advantage) for s in db]


def test_none_keeps_nothing():
    buf = buffer("none")
    buf.add([group(0, [1, 0, 0, 0])], version=0)
    assert buf.entries == [] and buf.draw(1, groups_dropped=4) == [] and buf.metrics() == {}


# ------------------------------------------------------- what a step decided stays with that step (issue 19)


def _routed_group(gid: int = 0):
    """A teacher-stage group after Self-Routing: rewards 1, 0, 0, 0 (advantages 0.75, -0.25 x 3), scored by the
    teacher. Sample 0 is correct and confident (skip); samples 1-3 are wrong and unsure (self_distill: reward
    weight 0 in their own step). Returns (group, the samples kept for the update, the step's marks)."""
    from rollwise.distill.routing import ROUTES, route_samples
    from rollwise.distill.terms import StepMarks

    g, marks = group(gid, [1, 0, 0, 0]), StepMarks()
    for i, s in enumerate(g.samples):
        s.correct = s.reward > 0
        s.full_logprobs = [-0.01] * 3 if i == 0 else [-1.5] * 3  # confidence 0.99 / 0.22 against 0.7
        marks.logprobs[id(s)] = [-2.0] * 3
    kept, _ = route_samples(g.samples, 0.7, marks)
    assert [marks.routes[id(s)] for s in g.samples] == ["skip", "self_distill", "self_distill", "self_distill"]
    assert all(marks.weight(s) == ROUTES["self_distill"] for s in kept)
    return g, kept, marks


def test_a_self_distill_sample_replayed_in_an_rl_step_trains_with_its_stored_reward_advantage():
    """What Self-Routing decided (reward weight 0) lives in that step's marks: the replayed copies carry none of
    it, so a later rl step trains them on their stored reward advantage, and a teacher step gives them the reward
    advantage times reward_weight and no teacher term (they are not re-scored)."""
    from rollwise.distill.terms import StepMarks, StepTerms
    from rollwise.train.batching import collate

    buf = buffer("hard_case", mix_ratio=0.25, max_uses=1)
    g, kept, marks = _routed_group()
    buf.add([g], version=0, trained=kept)
    replayed = buf.draw(version=1)
    assert len(replayed) == 3  # the skipped sample took no slot
    assert [s.advantage for s in replayed] == [-0.25] * 3 and all(s.replayed for s in replayed)
    assert not any(id(s) in marks.logprobs or id(s) in marks.weights for s in replayed)  # copies: unmarked
    mb = collate(replayed, pad_id=0)
    rl = StepTerms(teacher=False, marks=StepMarks()).advantages(mb.full_logp, mb)  # the reward advantage, weight 1
    assert rl.tolist() == [-0.25] * 3
    terms = StepTerms(teacher=True, coef=1.0, reward_weight=0.5, marks=StepMarks())  # a teacher stage
    assert terms.advantages(mb.full_logp, mb).tolist() == [-0.125] * 3  # reward_weight x advantage
    assert terms.metrics() == {}  # no teacher term: nothing scored
    assert [marks.routes[id(s)] for s in g.samples][1:] == ["self_distill"] * 3  # the step's own marks stand


def test_ssr_never_stores_skipped_samples_and_drawn_copies_do_not_write_back():
    buf = buffer("ssr", mix_ratio=1.0, max_uses=2)
    g, kept, _ = _routed_group()
    g.samples[0].advantage = 5.0  # the largest |advantage|: ssr would favour it, but it was skipped
    buf.add([g], version=0, trained=kept)
    assert len(buf.entries) == 3 and all(e.samples[0].advantage == -0.25 for e in buf.entries)
    first = buf.draw(version=0, groups_dropped=1)
    for s in first:  # a later step changes the replayed samples
        s.advantage, s.train_reward = 9.0, 9.0
    second = buf.draw(version=0, groups_dropped=1)
    assert second and all(s.advantage == -0.25 and s.train_reward is None for s in second)


def test_a_group_of_only_skipped_samples_is_not_stored():
    buf = buffer("hard_case")
    g, _, _ = _routed_group()
    buf.add([g], version=0, trained=[])  # the method kept none of them
    assert buf.entries == []
