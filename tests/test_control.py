"""The Control stage on a real tiny engine: dynamic sampling refill, partial rollouts (abort, carry over,
continue under new weights, version spans), staleness metrics and the config rules of off-policy sources."""

from itertools import count

import pytest
import torch

from conftest import tiny_config
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import ConfigError
from rollwise.control import Controller, staleness_metrics
from rollwise.generate import TorchEngine
from rollwise.generate.groups import FINAL, StopRule, is_complete, new_groups
from rollwise.loop import StageTimer
from rollwise.rollout import LocalRollouts, run_groups
from rollwise.types import Prompt, RewardResult, Sample, SamplingParams, Status


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok, model


def prompt_stream(tok):
    """`n -> [(prompt, ids)]` with uids 0, 1, 2, ... in order."""
    counter = count()

    def next_prompts(n):
        out = []
        for _ in range(n):
            k = next(counter)
            out.append((Prompt(str(k), [{"role": "user", "content": f"q{k}"}]), tok(f"question {k}").input_ids))
        return out

    return next_prompts


def informative_every_third(sample: Sample) -> RewardResult:
    """Known rewards: a group of prompt uid k has variance iff k % 3 == 0 (its first sample scores 1)."""
    k = int(sample.prompt.uid)
    first = sample.info.setdefault("first", not informative_every_third.seen.get(k))
    informative_every_third.seen[k] = True
    return RewardResult(value=1.0 if (k % 3 == 0 and first) else 0.0)


informative_every_third.seen = {}


def controller(tiny, tmp_path, reward=informative_every_third, **overrides):
    tok, model = tiny
    cfg = tiny_config(tmp_path, **overrides)
    engine = TorchEngine(model, tok, max_batch_size=cfg.rollout.max_batch_size)
    return Controller(cfg, LocalRollouts(engine), prompt_stream(tok), reward), engine


def test_dynamic_sampling_refills_to_the_requested_informative_groups(tiny, tmp_path):
    informative_every_third.seen.clear()
    ctl, _ = controller(tiny, tmp_path, **{"control.dynamic_sampling": True, "control.max_sampling_rounds": 10,
                                            "rollout.max_new_tokens": 3})
    batch = ctl.collect(0, 0, StageTimer())
    uids = [int(g.prompt.uid) for g in batch.groups]
    assert len(uids) == 4 and all(k % 3 == 0 for k in uids)  # exactly prompts_per_step informative groups
    generated = int(batch.metrics["control/groups_generated"])
    dropped = round(batch.metrics["filter/zero_variance_frac"] * generated)
    surplus = int(batch.metrics["control/groups_surplus_dropped"])
    assert generated == ctl.next_group_id  # every prompt drawn was generated and scored
    assert dropped == sum(k % 3 != 0 for k in range(generated))  # the known uninformative ones
    assert generated - dropped - surplus == 4
    assert batch.metrics["control/sampling_rounds"] >= 2 and batch.metrics["control/batch_short"] == 0


def test_without_dynamic_sampling_one_round_leaves_the_batch_short(tiny, tmp_path):
    informative_every_third.seen.clear()
    ctl, _ = controller(tiny, tmp_path, **{"rollout.max_new_tokens": 3})
    batch = ctl.collect(0, 0, StageTimer())
    assert [int(g.prompt.uid) for g in batch.groups] == [0, 3]
    assert batch.metrics["control/sampling_rounds"] == 1 and batch.metrics["control/batch_short"] == 2
    assert batch.metrics["filter/zero_variance_frac"] == 0.5


def test_dynamic_sampling_stops_at_max_rounds(tiny, tmp_path):
    informative_every_third.seen.clear()
    ctl, _ = controller(tiny, tmp_path, reward=lambda s: RewardResult(0.0),
                        **{"control.dynamic_sampling": True, "control.max_sampling_rounds": 3,
                           "rollout.max_new_tokens": 2})
    batch = ctl.collect(0, 0, StageTimer())
    assert batch.groups == [] and batch.metrics["control/sampling_rounds"] == 3
    assert batch.metrics["filter/zero_variance_frac"] == 1.0 and batch.metrics["control/batch_short"] == 4


def digit_reward(sample: Sample) -> RewardResult:
    return RewardResult(value=sum(ch.isdigit() for ch in sample.response_text) / max(1, len(sample.response_ids)))


def test_partial_rollouts_carry_unfinished_responses_and_lose_nothing(tiny, tmp_path):
    # a stop string makes lengths vary (a long tail); 2 x 2 groups started per step, 2 needed
    ctl, engine = controller(tiny, tmp_path, reward=digit_reward, **{
        "control.partial_rollouts": True, "control.over_provision": 2.0, "algo.is_correction": "tis_token",
        "algo.filter_zero_variance": False, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 3,
        "rollout.max_new_tokens": 40, "rollout.stop": ["e"]})
    seen: dict[int, Sample] = {}
    carried_any = continued = False
    forced = 0
    for step in range(6):
        engine.version = step  # a new policy version each step (weights unchanged: same tokens either way)
        batch = ctl.collect(step, step, StageTimer())
        assert len(batch.groups) == 2 and all(is_complete(g) for g in batch.groups)
        # max_staleness = 1: a response is carried once at most, then finished
        assert all(step - v <= 1 for g in batch.groups for s in g.samples for _, _, v in s.version_spans)
        assert all(step - v <= 0 for g in ctl.carried for s in g.samples for _, _, v in s.version_spans)
        forced += batch.metrics["control/groups_finished_for_staleness"]
        for g in batch.groups + ctl.carried + ctl.ready:
            for s in g.samples:
                seen[id(s)] = s
                lengths = [end - start for start, end, _ in s.version_spans]
                assert sum(lengths) == len(s.response_ids) == len(s.behaviour_logprobs)  # spans cover every token
                starts = [start for start, _, _ in s.version_spans]
                assert starts == sorted(starts) and all(v <= step for _, _, v in s.version_spans)
        carried_any |= any(s.status == Status.ABORTED and s.response_ids for g in ctl.carried for s in g.samples)
        continued |= any(len(s.version_spans) > 1 for g in batch.groups for s in g.samples)
    assert carried_any and continued and forced > 0
    # nothing generated is lost: every sampled token is in a sample we still hold
    assert engine.stats.generated_tokens == sum(len(s.response_ids) for s in seen.values())


def test_partial_continuation_equals_one_uninterrupted_run(tiny):
    """Greedy: responses aborted by the partial-rollout stop rule and continued in a later call (same weights,
    new version) have exactly the tokens and logprobs of an uninterrupted run, with one span per call."""
    tok, model = tiny
    prompts = prompt_stream(tok)(6)
    greedy = SamplingParams(max_new_tokens=24, temperature=0, stop=("e",))  # the stop string varies lengths
    reference = new_groups(prompts, 1, 0)
    run_groups(TorchEngine(model, tok), reference, greedy, count())
    engine = TorchEngine(model, tok)
    groups = new_groups(prompts, 1, 0)
    ids = count()
    stats = run_groups(engine, groups, greedy, ids, StopRule(1))
    aborted = [g for g in groups if g.samples[0].status == Status.ABORTED]
    assert stats.aborted == len(aborted) and any(g.samples[0].response_ids for g in aborted)
    engine.version = 1
    run_groups(engine, groups, greedy, ids)
    for g, ref in zip(groups, reference):
        s, r = g.samples[0], ref.samples[0]
        assert s.status in FINAL and s.response_ids == r.response_ids and s.status == r.status
        torch.testing.assert_close(torch.tensor(s.behaviour_logprobs), torch.tensor(r.behaviour_logprobs))
    for g in aborted:
        s = g.samples[0]
        if s.response_ids and s.version_spans[0][1] < len(s.response_ids):
            cut = s.version_spans[0][1]
            assert s.version_spans == [(0, cut, 0), (cut, len(s.response_ids), 1)]
    assert any(len(g.samples[0].version_spans) == 2 for g in aborted)


def test_staleness_metrics_hand_computed():
    def sample(spans):
        n = spans[-1][1]
        return Sample(Prompt("p", []), [1], [0] * n, [0.0] * n, [1] * n, Status.COMPLETED, 0, version_spans=spans)

    # at version 5: 4 tokens of age 0, 2 of age 1 (version 4), 3 of age 3 (version 2), 1 of age 5
    samples = [sample([(0, 2, 4), (2, 6, 5)]), sample([(0, 3, 2), (3, 4, 0)])]
    m = staleness_metrics(samples, 5)
    assert m["control/off_policy_token_frac"] == pytest.approx(6 / 10)
    assert m["control/staleness_mean"] == pytest.approx((2 * 1 + 3 * 3 + 1 * 5) / 10)
    assert m["control/staleness_max"] == 5
    assert m["control/age_tokens_frac/0"] == pytest.approx(0.4)
    assert m["control/age_tokens_frac/1"] == pytest.approx(0.2)
    assert m["control/age_tokens_frac/2"] == 0.0
    assert m["control/age_tokens_frac/3+"] == pytest.approx(0.4)
    assert m["control/samples_mixed_versions"] == 2


@pytest.mark.parametrize("override, needle", [
    ({"control.partial_rollouts": True}, "algo.is_correction"),
    ({"replay.kind": "ssr"}, "algo.is_correction"),
    ({"control.mode": "async"}, "algo.is_correction"),
    ({"control.mode": "async", "control.partial_rollouts": True, "algo.is_correction": "tis_token"}, "'sync' only"),
    ({"replay.kind": "hard_case", "algo.is_correction": "tis_token", "algo.advantage": "gae",
      "rollout.samples_per_prompt": 1}, "replays stored outcome advantages"),
    ({"control.over_provision": 0.5}, "control.over_provision"),
    ({"control.partial_rollouts": True, "algo.is_correction": "tis_token", "control.max_staleness": 0},
     "max_staleness must be at least 1"),
])
def test_off_policy_sources_need_a_correction(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny_config(tmp_path, **override)
    # async without staleness is on-policy: no correction needed
    tiny_config(tmp_path, **{"control.mode": "async", "control.max_staleness": 0})


def test_loop_replays_hard_cases_into_later_batches(make_config, tmp_path):
    import contextlib
    import io

    from conftest import read_rows
    from rollwise.loop import train

    cfg = make_config(**{"reward.fn": "toy_plugins:digit_fraction", "replay.kind": "hard_case",
                         "replay.hard_reward_threshold": 2.0, "replay.mix_ratio": 0.5, "replay.max_age": 1,
                         "algo.is_correction": "tis_token", "train.steps": 4, "run.samples_logged_per_step": 64})
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert rows[0]["replay/replayed_entries"] == 0  # nothing stored before the first batch
    later = rows[1:]
    assert all(r["replay/replayed_entries"] == 2 for r in later)  # round(0.5 x 4) groups every later step
    assert all(r["replay/replayed_frac"] == pytest.approx(8 / (8 + 4 * r["control/batch_groups"])) for r in later)
    assert all(0 < r["control/off_policy_token_frac"] and r["control/staleness_max"] <= 1 for r in later)
    logged = (tmp_path / "run" / "samples" / "step-3.jsonl").read_text()
    assert '"replayed": true' in logged and '"policy_versions": [1]' in logged


def test_max_time_s_stops_the_run_early(make_config, tmp_path):
    import contextlib
    import io

    from rollwise.loop import train

    cfg = make_config(**{"train.steps": 50, "train.max_time_s": 1e-6})
    with contextlib.redirect_stdout(io.StringIO()) as out:
        summary = train(cfg, tmp_path / "run")
    assert summary["steps"] == 1 and "train.max_time_s" in out.getvalue()
