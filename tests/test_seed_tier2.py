"""Seed methods, tier 2 (issue 23): `duet` (DUET), `rorecomp` (RoRecomp) and `hrr` (hindsight relabelling): the
allocation, selection, relabels and weights by hand, real tiny runs that show each mechanism acting on what is
trained, their errors at --dry-run, and their recipes (recipes/seed/) at --dry-run and for two steps on the tiny
model."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from helpers_tokenizer import tiny_tokenizer
from rollwise.cli import app
from rollwise.data.prompts import PromptEncoder
from rollwise.loop import train
from rollwise.methods.base import MethodSetup, Stage, StepInput
from rollwise.errors import UserError
from rollwise.methods.duet import DUET, DUET_STRATEGY, DuetStrategy, allocate
from rollwise.methods.hrr import HRR, arith_operand, relabel_arith
from rollwise.methods.rorecomp import RoRecomp, priority_split
from rollwise.types import Group, Prompt, Sample, Status
from rollwise.validate import load

SEED_RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "seed"
STAGE = Stage("rl", 0, 10, 0, 1)


def _sample(group_id: int, tokens: int, correct: bool, version: int = 0, text: str = "", prompt=None) -> Sample:
    prompt = prompt or Prompt(uid=f"p{group_id}", messages=[{"role": "user", "content": "q"}], answer="8")
    return Sample(prompt=prompt, prompt_ids=[1, 2], response_ids=[5] * tokens, behaviour_logprobs=[-1.0] * tokens,
                  loss_mask=[1] * tokens, status=Status.COMPLETED, group_id=group_id,
                  version_spans=[(0, tokens, version)], response_text=text, reward=float(correct), correct=correct)


def _quiet_train(cfg, run_dir) -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, run_dir)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


# --- DUET, by hand -----------------------------------------------------------------------------------------------

def test_allocation_is_dhondt_on_informativeness_within_min_and_max():
    # u = 0.25, 0, 0.16; min 2 each, 4 more: (u + 0.001) / (n + 1) picks 0 (.0837), 0 (.0628), 2 (.0537 > .0502), 0
    assert allocate([0.25, 0.0, 0.16], 10, 2, 5) == [5, 2, 3]
    assert allocate([0.25, 0.0, 0.16], 20, 2, 5) == [5, 5, 5]  # clipped to max x prompts
    assert allocate([0.25, 0.0, 0.16], 3, 2, 5) == [2, 2, 2]  # never below the minimum
    assert allocate([0.0, 0.0], 5, 2, 4) == [3, 2]  # equal: the first


def test_running_pass_rate_is_the_surrogate_and_sets_the_counts(make_config):
    cfg = make_config(**{"algo.method": "duet", "rollout.strategy": DUET_STRATEGY, "rollout.samples_per_prompt": 4,
                         "rollout.max_new_tokens": 10, "rollout.duet.budget_tokens": 60})
    strategy = DuetStrategy(cfg)
    seen = _arith(7, 1, "+", 8, "", gid=0).prompt
    done = [_sample(0, 4, c, prompt=seen) for c in (True, True, True, False)]
    strategy.observe([Group(0, seen, done)])
    assert strategy.prior(seen) == pytest.approx(0.625)  # 0.5 x 0.5 + 0.5 x 3/4
    other_plus, times = _arith(2, 3, "+", 5, "").prompt, _arith(2, 3, "*", 6, "").prompt
    assert strategy.prior(other_plus) == pytest.approx(0.625)  # its family (origin, op) was seen
    strategy.pass_rate = {seen.uid: 1.0}
    strategy.overall = 0.5
    # 60 tokens / 10 per rollout = 6 rollouts: the solved prompt (u = 0) keeps the minimum 2, the unknown one
    # (p = 0.5, u = 0.25) gets the other 2
    groups = [Group(0, seen, [_sample(0, 0, False, prompt=seen) for _ in range(4)]),
              Group(1, times, [_sample(1, 0, False, prompt=times) for _ in range(4)])]
    assert strategy.counts(groups) == [2, 4]


def test_duet_drops_aborted_responses_and_weights_survivors_by_inverse_survival(make_config):
    cfg = make_config(**{"algo.method": "duet", "rollout.strategy": DUET_STRATEGY})
    group = [_sample(0, 6, c) for c in (True, False, False, False)]
    for s, a in zip(group, (1.5, -0.5, -0.5, -0.5)):
        s.advantage = a
    group[2].info["duet_aborted"] = True
    out = DUET(MethodSetup(cfg)).prepare(StepInput(0, STAGE, [Group(0, group[0].prompt, group)], group))
    assert out.samples == [group[0], group[1], group[3]]  # the aborted one leaves the update
    assert [s.advantage for s in out.samples] == pytest.approx([2.0, -2 / 3, -2 / 3])  # x 4 / 3
    assert out.metrics["duet/trained_frac"] == 0.75 and out.metrics["duet/weight_mean"] == pytest.approx(4 / 3)


@pytest.mark.slow
def test_duet_spends_fewer_tokens_on_uneven_counts_and_aborts(tiny_model_dir, tmp_path):
    run = {"train.steps": 2, "eval.n": 0, "rollout.max_new_tokens": 12, "reward.fn": "toy_plugins:digit_fraction",
           "run.report": False}
    plain = _quiet_train(tiny_config(tiny_model_dir, **run), tmp_path / "rl")
    duet = _quiet_train(tiny_config(tiny_model_dir, **run, **{
        "algo.method": "duet", "rollout.strategy": DUET_STRATEGY, "rollout.duet.budget_tokens": 100,
        "rollout.duet.abort_tokens": 6, "rollout.duet.marker": "e"}), tmp_path / "duet")
    # 100 tokens buy 8 rollouts of the first round's 12 tokens: the minimum 2 x 4 prompts, not 4 x 4
    assert duet[0]["duet/rollouts"] == 8 and plain[0]["rollout/tokens"] > duet[0]["rollout/tokens"]
    assert duet[1]["duet/rollouts"] > 8 and duet[1]["duet/count_max"] > duet[1]["duet/count_min"]  # by informativeness
    assert all(r["duet/aborted_frac"] > 0 and r["duet/tokens_saved"] > 0 for r in duet)
    trained = [r for r in duet if r.get("train/loss") is not None]
    assert any(r["duet/trained_frac"] < 1 and r["duet/weight_mean"] > 1 for r in trained)


def test_the_duet_strategy_without_its_method_stops_at_start(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, **{"rollout.strategy": DUET_STRATEGY, "eval.n": 0})
    with pytest.raises(UserError, match="set algo.method = 'duet'"):
        _quiet_train(cfg, tmp_path / "x")


# --- RoRecomp, by hand -----------------------------------------------------------------------------------------

def test_priority_split_takes_short_correct_and_long_incorrect_by_the_group_median():
    # lengths 4, 10, 6, 8: median 7
    group = [_sample(0, 4, True), _sample(0, 10, True), _sample(0, 6, False), _sample(0, 8, False)]
    priority, rest = priority_split(group)
    assert [len(s.response_ids) for s in priority] == [4, 8]  # short-correct, long-incorrect
    assert [len(s.response_ids) for s in rest] == [10, 6]  # long-correct, short-incorrect
    # at the median itself both kinds are priority (odd group: lengths 3, 5, 9 -> median 5)
    priority, rest = priority_split([_sample(0, 5, True), _sample(0, 5, False), _sample(0, 9, True)])
    assert len(priority) == 2 and len(rest[0].response_ids) == 9


def test_compensation_batches_come_from_the_buffer_oldest_first_and_age_out(make_config):
    cfg = make_config(**{"algo.method": "rorecomp", "algo.rorecomp.compensation_size": 3, "algo.rorecomp.max_age": 4})
    method = RoRecomp(MethodSetup(cfg))

    def group(gid, version):
        return [_sample(gid, 4, True, version), _sample(gid, 10, True, version), _sample(gid, 6, False, version),
                _sample(gid, 8, False, version)]

    first = method.prepare(StepInput(0, STAGE, [], group(0, 0)))
    assert len(first.samples) == 2 and first.metrics["rorecomp/compensation_samples"] == 0
    assert first.metrics["rorecomp/buffer_size"] == 2 and first.metrics["rorecomp/priority_frac"] == 0.5
    assert first.metrics["rorecomp/priority_correct_len_mean"] == 4 and \
        first.metrics["rorecomp/priority_incorrect_len_mean"] == 8
    fresh = group(1, 1)
    second = method.prepare(StepInput(1, STAGE, [], fresh))
    # the buffer holds 4 >= 3: the two of step 0 and the first of step 1 join this update
    comp = second.samples[2:]
    assert [(s.group_id, len(s.response_ids)) for s in comp] == [(0, 10), (0, 6), (1, 10)]
    assert [s.replayed for s in comp] == [True, True, False]
    assert second.metrics["rorecomp/compensation_samples"] == 3 and second.metrics["rorecomp/buffer_size"] == 1
    assert second.record(second.samples[0]) == {"rorecomp": "priority"}
    assert second.record(fresh[1]) == {"rorecomp": "deferred"} and second.record(comp[0]) == {}
    # step 6: the one left from version 1 is 5 versions old (> max_age 4) and leaves
    later = method.prepare(StepInput(6, STAGE, [], []))
    assert later.metrics["rorecomp/buffer_size"] == 0 and later.samples == []
    assert method.state_dict()["buffer"] == []


# --- HRR, by hand ----------------------------------------------------------------------------------------------

class _Task:
    held_out: set[str] = set()

    def is_held_out(self, text, info):
        return text in self.held_out


def _arith(a, b, op, answer, response, gid=0):
    prompt = Prompt(uid=f"u{a}{op}{b}", messages=[{"role": "user", "content": f"{a} {op} {b} = ?"}],
                    answer=str(answer), source="arith:3", info={"a": a, "b": b, "op": op})
    s = _sample(gid, 4, False, text=response, prompt=prompt)
    s.reward, s.correct = (1.0, True) if response.endswith(f" {answer}.") else (0.0, False)
    return s


def test_arith_relabels_by_hand():
    assert arith_operand(7, "+", 10) == 3 and arith_operand(7, "+", 5) is None  # 7 + b = 5 has no b >= 0
    assert arith_operand(9, "-", 7) == 2 and arith_operand(9, "-", 12) is None and arith_operand(9, "-", -1) is None
    assert arith_operand(6, "*", 24) == 4 and arith_operand(6, "*", 20) is None and arith_operand(0, "*", 5) is None
    task = _Task()
    new = relabel_arith(task, _arith(7, 1, "+", 8, "I think The answer is 10."))
    assert new.messages == [{"role": "user", "content": "What is 7 + 3?"}] and new.answer == "10"
    assert new.info == {"a": 7, "b": 3, "op": "+", "relabelled_from": "u7+1"}
    assert relabel_arith(task, _arith(9, 4, "-", 5, "The answer is 7.")).answer == "7"  # 9 - 2
    assert relabel_arith(task, _arith(7, 1, "+", 8, "The answer is 8.")) is None  # right: nothing to relabel
    assert relabel_arith(task, _arith(7, 1, "+", 8, "no number")) is None  # no goal reached
    assert relabel_arith(task, _arith(6, 3, "*", 18, "The answer is 20.")) is None  # 6 x b = 20: no integer b
    cut = _arith(7, 1, "+", 8, "The answer is 10.")
    cut.status = Status.TRUNCATED  # a response that did not end reached no goal
    assert relabel_arith(task, cut) is None
    task.held_out = {"What is 7 + 3?"}  # a relabel that lands on a held-out prompt is never trained
    assert relabel_arith(task, _arith(7, 1, "+", 8, "The answer is 10.")) is None


def test_hrr_advantage_is_weight_times_relabelled_reward_minus_the_group_mean(make_config):
    cfg = make_config(**{"algo.method": "hrr", "algo.hrr.weight": 2.0, "algo.hrr.max_per_group": 3})
    method = HRR(MethodSetup(cfg, tokenizer=tiny_tokenizer(), encoder=PromptEncoder(tiny_tokenizer())))
    method.task = _Task()
    mixed = [_arith(7, 1, "+", 8, r) for r in ("The answer is 8.", "The answer is 10.", "nothing", "The answer is 9.")]
    failed = [_arith(5, 2, "-", 3, r, gid=1) for r in ("The answer is 4.", "The answer is 1.")]
    groups = [Group(0, mixed[0].prompt, mixed), Group(1, failed[0].prompt, failed)]
    out = method.prepare(StepInput(0, STAGE, groups, mixed + failed))
    twins = [s for s in out.samples if "hrr_goal" in s.info]
    # group 0: mean reward 1/4; "10" -> 7 + 3 and "9" -> 7 + 2, reward 1 under their goals: 2 x (1 - 0.25) = 1.5
    # group 1 (all failed, dropped as zero-variance): "4" -> 5 - 1, "1" -> 5 - 4: 2 x (1 - 0) = 2
    assert [(t.prompt.messages[0]["content"], t.reward, t.advantage) for t in twins] == [
        ("What is 7 + 3?", 1.0, 1.5), ("What is 7 + 2?", 1.0, 1.5), ("What is 5 - 1?", 1.0, 2.0),
        ("What is 5 - 4?", 1.0, 2.0)]
    assert twins[0].prompt_ids == PromptEncoder(tiny_tokenizer()).encode(twins[0].prompt)
    assert twins[0].response_ids == mixed[1].response_ids and mixed[1].prompt.answer == "8"  # the original is kept
    assert [s for s in out.samples if "hrr_goal" not in s.info] == mixed  # the uniform group's originals are left out
    assert out.metrics["hrr/relabelled"] == 4 and out.metrics["hrr/relabel_frac"] == pytest.approx(4 / 5)
    assert out.metrics["hrr/advantage_mean"] == pytest.approx(1.75)
    assert out.record(mixed[1]) == {"hrr_goal": "10"} and out.record(mixed[2]) == {}
    method.setup.cfg.algo.hrr = {**method.setup.cfg.algo.hrr, "max_per_group": 1}  # the first relabel of each group; "nothing" took no slot
    capped = method.prepare(StepInput(0, STAGE, groups, mixed + failed))
    assert [s.info["hrr_goal"] for s in capped.samples if "hrr_goal" in s.info] == ["10", "4"]


# --- real tiny runs ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_hrr_trains_on_steps_where_plain_grpo_has_nothing_to_learn(tiny_model_dir, tmp_path):
    # a stop string ends the random model's responses (truncated ones reach no goal)
    run = {"train.steps": 2, "eval.n": 0, "rollout.max_new_tokens": 16, "rollout.stop": ["e", "a"],
           "run.report": False}
    plain = _quiet_train(tiny_config(tiny_model_dir, **run), tmp_path / "rl")
    hrr = _quiet_train(tiny_config(tiny_model_dir, **run, **{"algo.method": "hrr"}), tmp_path / "hrr")
    # the random model answers no arith prompt: GRPO's zero-variance filter leaves nothing to train
    assert all(r["reward/accuracy"] == 0 and r["train/loss"] is None for r in plain)
    assert any(r["hrr/relabelled"] > 0 for r in hrr)
    for step, row in enumerate(hrr, 1):  # the same failures, relabelled with the numbers they computed, are trained
        assert (row["train/loss"] is not None) == (row["hrr/relabelled"] > 0)
        if row["hrr/relabelled"]:
            assert row["hrr/relabelled_reward_mean"] == 1.0 and row["train/loss"] < 0  # -(advantage 1) x ratio 1
            logged = [json.loads(line) for line in
                      (tmp_path / "hrr" / "samples" / f"step-{step}.jsonl").read_text().splitlines()]
            assert all(s["hrr_goal"] != s["answer"] for s in logged if "hrr_goal" in s)


@pytest.mark.slow
def test_rorecomp_trains_priority_responses_and_compensates_from_the_buffer(tiny_model_dir, tmp_path):
    # stop strings give the random model responses of varied length; digit_fraction > 0 counts as correct
    run = {"train.steps": 2, "eval.n": 0, "rollout.max_new_tokens": 12, "rollout.stop": ["e", "a"],
           "reward.fn": "toy_plugins:digit_fraction", "run.report": False, "run.samples_logged_per_step": 16}
    plain = _quiet_train(tiny_config(tiny_model_dir, **run), tmp_path / "rl")
    priority_only = _quiet_train(tiny_config(tiny_model_dir, **run, **{
        "algo.method": "rorecomp", "algo.rorecomp.compensation_size": 0}), tmp_path / "p")
    # until the first update both runs sample the same batch; RoRecomp trains only its priority responses
    first = next(i for i, r in enumerate(plain) if r.get("train/tokens") is not None)
    assert priority_only[first]["rollout/tokens"] == plain[first]["rollout/tokens"]
    assert 0 < priority_only[first]["rorecomp/priority_frac"] < 1
    assert 0 < priority_only[first]["train/tokens"] < plain[first]["train/tokens"]
    assert all(r["rorecomp/compensation_samples"] == 0 for r in priority_only)
    compensated = _quiet_train(tiny_config(tiny_model_dir, **run, **{
        "algo.method": "rorecomp", "algo.rorecomp.compensation_size": 2}), tmp_path / "c")
    assert compensated[first]["rorecomp/compensation_samples"] == 2  # the deferred ones return, 2 at a time
    assert priority_only[first]["train/tokens"] < compensated[first]["train/tokens"]
    logged = [json.loads(line) for line in
              (tmp_path / "c" / "samples" / f"step-{first + 1}.jsonl").read_text().splitlines()]
    assert {s.get("rorecomp") for s in logged} >= {"priority", "deferred"}


# --- errors at --dry-run, and the recipes ------------------------------------------------------------------------

def _dry_run(model_dir, **overrides):
    return CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(model_dir, **overrides)])


@pytest.mark.parametrize("overrides, message", [
    ({"algo.method": "duet"}, f"set rollout.strategy = {DUET_STRATEGY!r}"),
    ({"algo.method": "duet", "rollout.strategy": DUET_STRATEGY, "rollout.duet.abort_tokens": 8},
     "rollout.duet.abort_tokens = 8 is not below rollout.max_new_tokens = 8"),
    ({"algo.method": "duet", "rollout.strategy": DUET_STRATEGY, "rollout.duet.min_samples": 5},
     "rollout.duet.min_samples = 5 is above rollout.samples_per_prompt = 4"),
    ({"algo.method": "hrr", "data.task": "letters"}, "data.task = 'letters' has no relabel hook"),
    ({"algo.method": "hrr", "train.old_logprobs": "behaviour"}, "set train.old_logprobs = 'recompute'"),
    ({"algo.method": "hrr", "algo.is_correction": "tis_token"}, "set algo.is_correction = 'none'"),
    ({"algo.method": "rorecomp", "rollout.samples_per_prompt": 1, "algo.advantage": "gae"},
     "rollout.samples_per_prompt = 1: set it to 2"),
    ({"algo.method": "rorecomp", "algo.rorecomp.max_age": -1}, "algo.rorecomp.max_age"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(tiny_model_dir, overrides, message):
    result = _dry_run(tiny_model_dir, **overrides)
    assert result.exit_code == 2, result.output
    assert message in result.output


RECIPE_METRICS = {"duet": "duet/rollouts", "rorecomp": "rorecomp/priority_frac", "hrr": "hrr/relabel_frac"}


@pytest.mark.parametrize("name", sorted(RECIPE_METRICS))
def test_recipe_passes_dry_run(name, tiny_model_dir):
    gate = {"rollout.duet.abort_tokens": 4} if name == "duet" else {}  # below the tiny run's 8 new tokens
    result = CliRunner().invoke(app, ["train", str(SEED_RECIPES / f"{name}.toml"), "--dry-run",
                                      *tiny_overrides(tiny_model_dir, **gate)])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPE_METRICS))
def test_recipe_runs_two_steps_on_the_tiny_model(name, tiny_model_dir, tmp_path):
    overrides = {"eval.n": 4, "run.report": False, "run.name": None}
    if name == "duet":  # the tiny run generates 8 tokens: gate at 4, on a marker the random model writes
        overrides.update({"rollout.duet.abort_tokens": 4, "rollout.duet.marker": "e"})
    if name in ("rorecomp", "duet"):
        overrides["reward.fn"] = "toy_plugins:digit_fraction"  # reward variance on the random model
    cfg = load(SEED_RECIPES / f"{name}.toml", tiny_overrides(tiny_model_dir, **overrides))
    rows = _quiet_train(cfg, tmp_path / name)
    assert len(rows) == 2
    for row in rows:
        assert row[RECIPE_METRICS[name]] is not None and math.isfinite(row[RECIPE_METRICS[name]])
        assert row["train/loss"] is None or math.isfinite(row["train/loss"])
