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
    teacher. Sample 0 is correct and confident (skip); sample 1 correct and unsure is impossible here (reward 0),
    samples 1-3 are wrong and unsure (self_distill: reward weight 0 in their own step)."""
    from rollwise.distill.step import ROUTES, route_samples

    g = group(gid, [1, 0, 0, 0])
    for i, s in enumerate(g.samples):
        s.correct = s.reward > 0
        s.full_logprobs = [-0.01] * 3 if i == 0 else [-1.5] * 3  # confidence 0.99 / 0.22 against 0.7
        s.teacher_logprobs = [-2.0] * 3
        s.teacher_topk = ([[-2.0]] * 3, [[5]] * 3)
    kept, _ = route_samples(g.samples, 0.7)
    assert [s.route for s in g.samples] == ["skip", "self_distill", "self_distill", "self_distill"]
    assert all(s.loss_weights == ROUTES["self_distill"] for s in kept)
    return g


def test_a_self_distill_sample_replayed_in_an_rl_step_trains_with_its_stored_reward_advantage():
    from rollwise.distill.terms import StepTerms
    from rollwise.train.batching import collate

    buf = buffer("hard_case", mix_ratio=0.25, max_uses=1)
    g = _routed_group()
    buf.add([g], version=0)
    replayed = buf.draw(version=1)
    assert len(replayed) == 3  # the skipped sample took no slot
    assert [s.advantage for s in replayed] == [-0.25] * 3
    assert all(s.replayed and s.route == "" and s.loss_weights == (1.0, 1.0, 0.0) for s in replayed)
    assert all(s.teacher_logprobs == [] and s.teacher_topk is None for s in replayed)  # old scores are not fresh
    mb = collate(replayed, pad_id=0)
    rl, _ = StepTerms(teacher=False).advantages(mb.full_logp, mb)  # an rl stage: the reward advantage, weight 1
    assert rl.tolist() == [-0.25] * 3
    opd, metrics = StepTerms(teacher=True, coef=1.0, reward_weight=0.5).advantages(mb.full_logp, mb)  # a teacher stage
    assert opd.tolist() == [-0.125] * 3 and metrics == {}  # reward_weight x advantage, no teacher term
    assert [s.route for s in g.samples][1:] == ["self_distill"] * 3  # the step's own samples keep their routes


def test_ssr_never_stores_skipped_samples_and_drawn_copies_do_not_write_back():
    buf = buffer("ssr", mix_ratio=1.0, max_uses=2)
    g = _routed_group()
    g.samples[0].advantage = 5.0  # the largest |advantage|: ssr would favour it, but it was skipped
    buf.add([g], version=0)
    assert len(buf.entries) == 3 and all(e.samples[0].route == "" for e in buf.entries)
    first = buf.draw(version=0, groups_dropped=1)
    for s in first:  # a later step decides something about the replayed samples
        s.loss_weights, s.route, s.teacher_logprobs = (0.0, 1.0, 0.0), "self_distill", [-1.0] * 3
    second = buf.draw(version=0, groups_dropped=1)
    assert second and all(s.loss_weights == (1.0, 1.0, 0.0) and s.route == "" and not s.teacher_logprobs
                          for s in second)


def test_a_group_of_only_skipped_samples_is_not_stored():
    buf = buffer("hard_case")
    g = _routed_group()
    for s in g.samples[1:]:
        s.route = "skip"
    buf.add([g], version=0)
    assert buf.entries == []


def test_samples_pickled_before_the_distillation_fields_replay_with_the_defaults():
    buf = buffer("hard_case", mix_ratio=0.25)
    g = group(0, [1, 0, 0, 0])
    for s in g.samples:
        for name in ("teacher_logprobs", "route", "loss_weights", "teacher_topk"):
            s.__dict__.pop(name, None)  # as unpickled from a checkpoint written before these fields
    buf.add([g], version=0)
    drawn = buf.draw(version=1)
    assert len(drawn) == 4 and all(s.loss_weights == (1.0, 1.0, 0.0) and s.teacher_logprobs == [] for s in drawn)
