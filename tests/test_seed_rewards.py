"""Seed methods on rewards and data (issue 23): CME, verifier noise, MOA, SGRPO and MemReward. The formulas by hand, each
mechanism through a real tiny run (its metrics in the rows, its effect on the advantages trained), the errors at
--dry-run, and the recipes (recipes/seed/) at --dry-run and for two steps on the tiny model."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from helpers_tokenizer import tiny_tokenizer
from rollwise.algo.moa import moa
from rollwise.algo.advantages import grpo
from rollwise.cli import app
from rollwise.loop import train
from rollwise.methods.sgrpo import diversity_credits, distinct_n, ngrams, set_credits, split_sets
from rollwise.rewards.cme import CMEReward
from rollwise.rewards.memreward import MemReward, bigrams, is_labelled, jaccard, propagate, similarity_graph
from rollwise.rewards.noise import NoisyReward, flip, flip_draw
from rollwise.types import Prompt, RewardResult, Sample, Status
from rollwise.validate import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "seed"
QUIET = {"eval.n": 0, "run.report": False}


def _sample(text: str = "1 2", ids: list[int] | None = None, uid: str = "p0", group: int = 0) -> Sample:
    prompt = Prompt(uid=uid, messages=[{"role": "user", "content": "What is 1 + 1?"}], answer="2")
    ids = ids if ids is not None else [5, 6]
    return Sample(prompt=prompt, prompt_ids=[1, 2], response_ids=ids, behaviour_logprobs=[0.0] * len(ids),
                  loss_mask=[1] * len(ids), status=Status.COMPLETED, group_id=group, response_text=text)


def _run(tmp_path, name: str, **overrides) -> tuple[list[dict], list[dict]]:
    """Train rows and logged samples (every step) of a tiny run."""
    cfg = load(None, tiny_overrides(_model_dir(), **{**QUIET, **overrides}))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    logged = [json.loads(line) for f in sorted((tmp_path / name / "samples").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    return rows, logged


_MODEL_DIR: list[Path] = []


def _model_dir() -> Path:
    return _MODEL_DIR[0]


@pytest.fixture(autouse=True)
def _remember_model(tiny_model_dir):
    if not _MODEL_DIR:
        _MODEL_DIR.append(tiny_model_dir)


def _dry_run(overrides: dict, recipe: Path | None = None):
    args = ["train", "--dry-run", *([str(recipe)] if recipe else []), *tiny_overrides(_model_dir(), **overrides)]
    return CliRunner().invoke(app, args)


# --- plugins for the runs (named 'test_seed_rewards:fn') ------------------------------------------------------

def constant_one(sample: Sample) -> RewardResult:
    """Every response scores 1: GRPO alone has no signal."""
    return RewardResult(value=1.0, parts={"correct": 1.0})


def two_rubrics(sample: Sample) -> RewardResult:
    """Two parts that disagree: digit characters, and brevity (1 / (1 + characters))."""
    text = sample.response_text
    digits, brief = float(sum(c.isdigit() for c in text)), 1.0 / (1.0 + len(text))
    return RewardResult(value=digits + brief, parts={"digits": digits, "brief": brief})


# --- CME ------------------------------------------------------------------------------------------------------

class UniformModel(torch.nn.Module):
    """A verifier whose next-token distribution is uniform over `vocab` tokens: every token has log-prob -log V."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_cme_is_minus_log_vocab_under_a_uniform_verifier():
    tok = tiny_tokenizer()
    vocab = len(tok)
    reward = CMEReward("stub", loaded=(UniformModel(vocab), tok))
    out = reward.score_many([_sample("12 + 3"), _sample("7")], None)
    assert [r.value for r in out] == pytest.approx([-math.log(vocab)] * 2)
    assert out[0].parts == {"cme_logp": pytest.approx(-math.log(vocab))} and out[0].correct is None


def test_cme_batches_equal_single_scores_and_a_verifier_sets_only_correct(tiny_model_dir):
    texts = ["1 2 3 4 5 6", "9", "The answer is 2.", "2 2"]
    batched = CMEReward(str(tiny_model_dir), batch_size=3, verifier="arith")
    one = CMEReward(str(tiny_model_dir), batch_size=1, loaded=batched._model())
    a = batched.score_many([_sample(t) for t in texts], None)
    b = one.score_many([_sample(t) for t in texts], None)
    assert [r.value for r in a] == pytest.approx([r.value for r in b], abs=1e-5)  # padding does not leak
    # by hand for the last text: log_softmax over the verifier's logits at the response positions
    model, tok = batched._model()
    p_ids, r_ids = batched.encode(_sample(texts[3]))
    ids = torch.tensor([p_ids + r_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    hand = float(logp[len(p_ids) - 1:].gather(-1, ids[0, len(p_ids):, None]).mean())
    assert a[3].value == pytest.approx(hand, abs=1e-5) and a[3].value < 0
    assert [r.correct for r in a] == [False, False, True, True]  # the arith verdict, not the value
    assert isinstance(batched.score_many([_sample("   ")], None)[0], ValueError)  # empty: a counted failure


@pytest.mark.slow
def test_a_cme_run_trains_on_the_verifiers_likelihood_without_labels(tmp_path, tiny_model_dir):
    rows, logged = _run(tmp_path, "cme", **{"reward.fn": "cme", "reward.cme.model": str(tiny_model_dir),
                                             "reward.cme.verifier": "toy_plugins:digit_fraction",
                                             "rollout.samples_per_prompt": 2, "run.samples_logged_per_step": 99})
    assert len(rows) == 2
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/part/cme_logp"]) and row["reward/mean"] < 0
    by_prompt = defaultdict(list)
    for s in logged:
        by_prompt[s["prompt"]].append(s)
    pairs = [p for p in by_prompt.values() if len(p) == 2 and p[0]["reward"] != p[1]["reward"]]
    assert pairs
    for a, b in pairs:  # the continuous likelihood is what the update follows: the likelier response is pushed up
        assert (a["advantage"] > b["advantage"]) == (a["reward"] > b["reward"])
        assert a["reward"] not in (0.0, 1.0)


# --- verifier noise --------------------------------------------------------------------------------------------

def test_flips_by_hand():
    wrong, right = RewardResult(0.0, {"correct": 0.0}, correct=False), RewardResult(1.0, {"correct": 1.0}, correct=True)
    fp = flip(wrong, draw=0.1, fp=0.2, fn=0.0)
    assert (fp.value, fp.correct, fp.parts["correct"]) == (1.0, True, 1.0)
    assert fp.parts["noise_flipped_fp"] == 1.0 and fp.parts["clean_correct"] == 0.0 and fp.parts["clean_reward"] == 0.0
    fn = flip(right, draw=0.1, fp=0.0, fn=0.2)
    assert (fn.value, fn.correct, fn.parts["noise_flipped_fn"], fn.parts["clean_correct"]) == (0.0, False, 1.0, 1.0)
    kept = flip(right, draw=0.3, fp=1.0, fn=0.2)  # a correct one is never a false positive
    assert (kept.value, kept.correct, kept.parts["noise_flipped_fp"], kept.parts["noise_flipped_fn"]) == (1.0, True, 0, 0)


def test_flip_rates_and_determinism():
    samples = [_sample(f"answer {i}", uid=f"p{i % 7}") for i in range(4000)]
    noisy = NoisyReward(lambda s: 0.0, fp=0.3, fn=0.0, seed=1)
    out = noisy.score_many(samples, None)
    rate = sum(r.parts["noise_flipped_fp"] for r in out) / len(out)
    assert 0.27 < rate < 0.33
    again = NoisyReward(lambda s: 0.0, fp=0.3, fn=0.0, seed=1).score_many(list(reversed(samples)), None)
    assert [r.value for r in reversed(again)] == [r.value for r in out]  # order-free, reproducible
    assert flip_draw(1, samples[0]) != flip_draw(2, samples[0])
    assert isinstance(noisy.score_many([_sample()], None)[0], RewardResult)
    broken = NoisyReward(lambda s: 1 / 0, fp=0.3, fn=0.3).score_many([_sample()], None)
    assert isinstance(broken[0], ZeroDivisionError)  # a failing reward stays a failure, never a flipped score


def test_a_noisy_run_counts_flips_keeps_the_clean_verdict_and_evaluates_clean(tmp_path):
    rows, _ = _run(tmp_path, "noise", **{"reward.fn": "toy_plugins:digit_fraction", "reward.noise.fp": 0.5,
                                          "reward.noise.fn": 0.5, "eval.n": 4, "eval.every_steps": 1})
    assert len(rows) == 2
    flipped = sum(r["reward/part/noise_flipped_fp"] + r["reward/part/noise_flipped_fn"] for r in rows)
    assert flipped > 0
    for r in rows:  # noisy accuracy = clean - false negatives + false positives
        assert r["reward/accuracy"] == pytest.approx(r["reward/part/clean_correct"] - r["reward/part/noise_flipped_fn"]
                                                     + r["reward/part/noise_flipped_fp"])
    evals = [r for r in read_rows(tmp_path / "noise") if r["kind"] == "eval"]
    assert evals and not any("noise" in k for r in evals for k in r)


# --- MOA -------------------------------------------------------------------------------------------------------

def test_moa_by_hand_differs_from_a_weighted_sum():
    group = torch.tensor([0, 0, 0, 0])
    parts = {"correct": torch.tensor([1.0, 0.0, 0.0, 0.0]), "format": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    adv = moa(torch.zeros(4), group, parts=parts, weights={"correct": 1.0, "format": 0.5})
    # correct: mean 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5]; format: mean 0.5, std 1/sqrt(3) -> +-sqrt(3)/2
    h = math.sqrt(3) / 2
    assert adv.tolist() == pytest.approx([1.5 + 0.5 * h, -0.5 + 0.5 * h, -0.5 - 0.5 * h, -0.5 - 0.5 * h], abs=1e-5)
    summed = grpo(parts["correct"] + 0.5 * parts["format"], group)
    # the weighted sum puts sample 2 at its group's mean (advantage 0); per-objective normalisation below it
    assert float(summed[1]) == pytest.approx(0.0, abs=1e-6) and float(adv[1]) == pytest.approx(-0.0670, abs=1e-4)
    plain = moa(torch.tensor([1.0, 0.0, 2.0, 2.0]), group, parts=parts, weights={"reward": 1.0})
    assert plain.tolist() == pytest.approx(grpo(torch.tensor([1.0, 0.0, 2.0, 2.0]), group).tolist(), abs=1e-6)
    unscaled = moa(torch.zeros(4), group, parts=parts, weights={"correct": 1.0}, scale=False)
    assert unscaled.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="algo.moa.weights names reward part 'rubric'"):
        moa(torch.zeros(4), group, parts=parts, weights={"rubric": 1.0})
    with pytest.raises(ValueError, match="algo.moa.weights names reward part 'format'"):
        moa(torch.zeros(4), group, parts={"format": torch.tensor([1.0, float("nan"), 0, 0])}, weights={"format": 1.0})


def test_a_moa_run_trains_on_per_rubric_normalised_advantages(tmp_path):
    rows, logged = _run(tmp_path, "moa", **{"reward.fn": "test_seed_rewards:two_rubrics", "algo.advantage": "moa",
                                             "algo.moa.weights": {"digits": 1.0, "brief": 1.0},
                                             "rollout.samples_per_prompt": 2, "run.samples_logged_per_step": 99})
    assert len(rows) == 2
    by_prompt = defaultdict(list)
    for s in logged:
        by_prompt[s["prompt"]].append(s)
    checked = 0
    for pair in (p for p in by_prompt.values() if len(p) == 2):
        parts = [two_rubrics(_sample(s["response"])).parts for s in pair]
        expected = moa(torch.zeros(2), torch.tensor([0, 0]), weights={"digits": 1.0, "brief": 1.0},
                       parts={k: torch.tensor([p[k] for p in parts]) for k in ("digits", "brief")})
        assert [s["advantage"] for s in pair] == pytest.approx(expected.tolist(), abs=1e-4)
        checked += 1
    assert checked


# --- SGRPO -----------------------------------------------------------------------------------------------------

def test_sgrpo_credits_by_hand():
    assert ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)] and ngrams([1], 2) == []
    assert distinct_n([[(1, 2), (2, 3)], [(1, 2), (2, 3)]]) == 0.5
    # A and B duplicate each other (bigrams 12, 23), C is new (45, 56): D = 4 distinct / 6 = 2/3.
    # Leave-one-out: D without A = 4/4 = 1 (c_A = -1/3 -> 0), the same for B; without C 2/4 (c_C = 1/6).
    # The set's reward 3 x 2/3 = 2 all goes to C.
    credits, whole = set_credits([[1, 2, 3], [1, 2, 3], [4, 5, 6]], 2)
    assert whole == pytest.approx(2 / 3) and credits == pytest.approx([0.0, 0.0, 2.0])
    # all distinct: every c_i = 1 - 1 = 0 -> each gets D = 1
    assert set_credits([[1, 2], [3, 4]], 2) == ([1.0, 1.0], 1.0)
    assert split_sets([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    samples = [_sample(ids=ids, group=g) for g, ids in [(0, [1, 2]), (0, [1, 2]), (0, [3, 4]), (0, [5, 6])]]
    credits, set_d = diversity_credits(samples, sets=2, n=2)  # sets {[1,2],[1,2]} (D 1/2) and {[3,4],[5,6]} (D 1)
    assert set_d == [0.5, 1.0] and credits == pytest.approx([0.5, 0.5, 1.0, 1.0])


def test_sgrpo_trains_groups_whose_utility_is_uniform_on_their_diversity(tmp_path):
    overrides = {"reward.fn": "test_seed_rewards:constant_one", "run.samples_logged_per_step": 99}
    rows, logged = _run(tmp_path, "sgrpo", **{**overrides, "algo.method": "sgrpo", "algo.sgrpo.sets": 2,
                                              "algo.sgrpo.ngram": 1})
    assert len(rows) == 2
    for row in rows:
        assert row["sgrpo/uniform_utility_groups"] == 4 and 0 < row["sgrpo/set_diversity_mean"] <= 1
    assert all("sgrpo_credit" in s for s in logged)
    assert any(abs(s["advantage"]) > 0.1 for s in logged)  # GRPO would give every one of these 0
    plain_rows, plain = _run(tmp_path, "rl", **overrides)
    assert plain and all(s["advantage"] == 0 for s in plain) and "sgrpo/credit_mean" not in plain_rows[0]


# --- MemReward -------------------------------------------------------------------------------------------------

def test_label_propagation_by_hand():
    assert jaccard(bigrams([1, 2, 3]), bigrams([2, 3, 4])) == pytest.approx(1 / 3)  # {23} of {12, 23, 34}
    # nodes: L1 (y = 1), L2 (y = 0), U linked 0.6 to L1 and 0.2 to L2: F = (0.6 + eps prior) / (0.8 + eps)
    w = torch.tensor([[0, 0, 0.6], [0, 0, 0.2], [0.6, 0.2, 0]], dtype=torch.float64)
    f = propagate(w, torch.tensor([True, True, False]), torch.tensor([1.0, 0.0, 9.0]), prior=0.5, eps=1e-3)
    assert f.tolist() == pytest.approx([1.0, 0.0, (0.6 + 0.5e-3) / (0.8 + 1e-3)])
    # a chain L (y = 1) - U1 - U2, weights 1: U1 = (1 + U2) / 2 and U2 = U1 without a prior -> both 1
    w = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=torch.float64)
    f = propagate(w, torch.tensor([True, False, False]), torch.tensor([1.0, 0, 0]), prior=0.0, eps=1e-9)
    assert f.tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    isolated = propagate(torch.zeros(2, 2, dtype=torch.float64), torch.tensor([True, False]),
                         torch.tensor([1.0, 0.0]), prior=0.25)
    assert isolated[1] == pytest.approx(0.25)  # like nothing: the memory's mean
    assert similarity_graph([bigrams([1, 2, 3])] * 12, neighbours=3).count_nonzero(dim=1).max() <= 11
    labelled = sum(is_labelled(0, _sample(uid=f"q{i}"), 0.2) for i in range(3000)) / 3000
    assert 0.17 < labelled < 0.23


def test_memreward_propagates_to_unlabelled_prompts_and_remembers_labelled_ones():
    oracle = lambda s: RewardResult(float(s.response_ids[0] == 7), {"correct": float(s.response_ids[0] == 7)})
    reward = MemReward(oracle, fraction=0.5, seed=0)
    uids = [f"q{i}" for i in range(40)]
    lab = next(u for u in uids if is_labelled(0, _sample(uid=u), 0.5))
    unl = next(u for u in uids if not is_labelled(0, _sample(uid=u), 0.5))
    batch = [_sample(ids=[7, 1, 2, 3], uid=lab), _sample(ids=[8, 4, 5, 6], uid=lab),
             _sample(ids=[7, 1, 2, 3, 9], uid=unl), _sample(ids=[8, 4, 5, 6, 9], uid=unl)]
    out = reward.score_many(batch, None)
    assert [r.value for r in out[:2]] == [1.0, 0.0] and [r.parts["memreward_labelled"] for r in out] == [1, 1, 0, 0]
    assert out[2].value > 0.9 and out[3].value < 0.1  # each like the labelled rollout it resembles
    assert out[2].correct and not out[3].correct and out[3].parts["oracle_correct"] == 0.0
    assert out[2].parts["memreward_abs_error"] == pytest.approx(1.0 - out[2].value)
    assert len(reward.memory) == 2  # the labelled ones; the next batch propagates from them alone
    later = reward.score_many([_sample(ids=[8, 4, 5, 6, 9, 9], uid=unl)], None)
    assert later[0].value < 0.1


def test_memreward_runs_at_20_percent_labels_and_rows_measure_it(tmp_path):
    rows, _ = _run(tmp_path, "memreward", **{"reward.fn": "toy_plugins:digit_fraction", "reward.memreward.label_fraction": 0.2,
                                              "rollout.prompts_per_step": 8, "train.steps": 2})
    assert len(rows) == 2
    assert 0 < sum(r["reward/part/memreward_labelled"] for r in rows) / 2 < 0.6
    assert all(r["reward/part/memreward_abs_error"] >= 0 for r in rows)
    assert any(r["reward/mean"] != pytest.approx(r["reward/part/oracle_reward"]) for r in rows)


# --- errors at --dry-run, and the recipes -----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ({"reward.fn": "cme"}, "reward.fn = 'cme' needs reward.cme.model"),
    ({"reward.fn": "cme", "reward.cme.model": "/no/such/model"}, "reward.cme.model = '/no/such/model' is not a model"),
    ({"reward.fn": "cme", "reward.cme.model": ".", "reward.cme.verifier": "nope"}, "reward.cme.verifier = 'nope'"),
    ({"reward.noise.fp": 1.5}, "reward.noise.fp"),
    ({"algo.advantage": "moa"}, "algo.advantage = 'moa' needs algo.moa.weights"),
    ({"algo.moa.weights": {"correct": 1.0}}, "[algo.moa] is set but algo.method = 'rl' and algo.advantage = 'grpo'"),
    ({"algo.advantage": "moa", "algo.moa.weights": {"correct": -1.0}}, "must be finite and >= 0"),
    ({"algo.method": "sgrpo", "algo.sgrpo.sets": 3}, "algo.sgrpo.sets = 3 must divide"),
    ({"algo.method": "sgrpo", "algo.advantage": "gae"}, "algo.method = 'sgrpo' recomputes outcome advantages"),
    ({"reward.memreward.label_fraction": 0.0}, "reward.memreward.label_fraction"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(overrides, message, tiny_model_dir):
    if overrides.get("reward.cme.model") == ".":
        overrides = {**overrides, "reward.cme.model": str(tiny_model_dir)}
    result = _dry_run(overrides)
    assert result.exit_code == 2, result.output
    assert message in result.output


RECIPE_RUNS = {  # the tiny model stands in for the verifier; dense rewards give the tiny groups variance
    "cme": {"reward.cme.model": "TINY"},
    "noise": {"reward.fn": "toy_plugins:digit_fraction"},
    "moa": {"reward.fn": "test_seed_rewards:two_rubrics", "algo.moa.weights": {"digits": 1.0, "brief": 0.5}},
    "sgrpo": {"reward.fn": "toy_plugins:digit_fraction"},
    "memreward": {"reward.fn": "toy_plugins:digit_fraction", "rollout.prompts_per_step": 8},
}
EXPECTED_KEYS = {"cme": "reward/part/cme_logp", "noise": "reward/part/noise_flipped_fp", "moa": "train/loss",
                 "sgrpo": "sgrpo/credit_mean", "memreward": "reward/part/memreward_abs_error"}


def test_every_seed_recipe_of_this_group_is_covered():
    assert set(RECIPE_RUNS) <= {p.stem for p in RECIPES.glob("*.toml")}


@pytest.mark.parametrize("name", sorted(RECIPE_RUNS))
def test_seed_recipe_passes_dry_run_and_runs_two_steps(name, tmp_path, tiny_model_dir):
    overrides = {k: (str(tiny_model_dir) if v == "TINY" else v) for k, v in RECIPE_RUNS[name].items()}
    overrides.update({"eval.n": 4, "run.report": False, "run.name": None})
    result = _dry_run(overrides, RECIPES / f"{name}.toml")
    assert result.exit_code == 0, result.output
    cfg = load(RECIPES / f"{name}.toml", tiny_overrides(tiny_model_dir, **overrides))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row[EXPECTED_KEYS[name]]), (name, row)
        # memreward: an unlabelled group like no labelled rollout gets the prior for all (no variance, no update)
        assert (name == "memreward" and row["train/loss"] is None) or math.isfinite(row["train/loss"]), (name, row)
    assert any(row["train/loss"] is not None for row in rows)
