"""Rollout strategies (`rollout.strategy`, rollwise/rollout_strategies/): `plain` is today's Generate stage bit
for bit; Forced Rethinking and ADHint by hand on a scripted engine, on the real torch engine (behaviour
log-probs of the continued tokens equal the trainer's), and in real tiny runs; their recipes; the errors at
--dry-run."""

from __future__ import annotations

import contextlib
import io
import json
from itertools import count
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.cli import app
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.loop import train
from rollwise.methods.base import MethodSetup, Stage, StepInput
from rollwise.rollout_strategies import ROLLOUT_STRATEGIES
from rollwise.rollout_strategies.adhint import ADHint, ADHintStrategy, hint_ratio, hint_text
from rollwise.rollout_strategies.rethink import RethinkStrategy
from rollwise.rollout_strategies.eepo import EEPOStrategy, response_logp
from rollwise.rollout_strategies.tandem import TandemStrategy
from rollwise.types import GenerationRequest, GenerationResult, Prompt, SamplingParams, Status
from rollwise.validate import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "seed"
EOS = 2


class ScriptedEngine:
    """Answers request k of each call with `script[call][k]` new tokens, log-prob -(token / 10) each; EOS
    ends a response. Keeps every request it got."""

    eos_ids = {EOS}

    def __init__(self, script: list[list[list[int]]]):
        self.script, self.calls = script, []

    def generate(self, requests, on_finish):
        new = self.script[len(self.calls)]
        self.calls.append(requests)
        for k, req in enumerate(requests):
            ids = list(req.response_ids) + new[k]
            logprobs = list(req.response_logprobs) + [-t / 10 for t in new[k]]
            status = Status.COMPLETED if new[k] and new[k][-1] == EOS else Status.TRUNCATED
            on_finish(GenerationResult(req.request_id, ids, logprobs, status,
                                       [(len(req.response_ids), len(ids), 0)], text=str(ids)))


def _groups(n_samples: int, answer: str | None = "7"):
    prompt = Prompt("p0", [{"role": "user", "content": "What is 3 + 4?"}], answer=answer)
    return new_groups([(prompt, [9, 9, 9])], n_samples, 0)


def test_every_strategy_with_options_declares_them_as_its_own_table():
    """A strategy's options are one MethodOptions model in its own module, registered with it ([rollout.<name>])."""
    from rollwise.config_methods import OPTION_MODELS

    for name, factory in ROLLOUT_STRATEGIES.items():
        model = getattr(factory, "options", None)
        if name == "plain":
            assert model is None
            continue
        assert model is not None and (model.section, model.name) == ("rollout", name)
        assert OPTION_MODELS[("rollout", name)] is model and model.__module__ == factory.__module__


def test_a_second_engines_work_is_counted_on_the_policy_engine():
    from rollwise.generate.torch_engine import EngineStats
    from rollwise.rollout_strategies import generate_on

    class Counting(ScriptedEngine):
        def __init__(self, script, generated):
            super().__init__(script)
            self.stats = EngineStats(generated_tokens=generated)

        def generate(self, requests, on_finish):
            super().generate(requests, on_finish)
            self.stats.generated_tokens += 3

    policy, junior = Counting([], 10), Counting([[[1, 2, EOS]]], 100)
    generate_on(junior, policy, [GenerationRequest(0, [9], SamplingParams())], lambda result: None)
    assert policy.stats.generated_tokens == 13 and junior.stats.generated_tokens == 103


# --- plain: the Generate stage as before --------------------------------------------------------------------

def _rows(model_dir, run_dir, monkeypatch=None, **overrides):
    cfg = tiny_config(model_dir, **{"eval.n": 0, "run.report": False, **overrides})
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, run_dir)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


@pytest.mark.slow
def test_plain_strategy_gives_the_same_metrics_as_the_generate_stage_without_strategies(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    seam = _rows(tiny_model_dir, tmp_path / "seam", **{"rollout.strategy": "plain"})
    monkeypatch.setattr("rollwise.build.build_strategy", lambda cfg, context: None)  # run_groups, as before
    before = _rows(tiny_model_dir, tmp_path / "before")
    timing = ("perf/", "_s", "time", "throughput", "per_s", "elapsed")
    for a, b in zip(seam, before, strict=True):
        keys = [k for k in a if not any(t in k for t in timing)]
        assert {k: a[k] for k in keys} == {k: b.get(k) for k in keys}
    assert seam[-1]["rollout/tokens"] > 0 and "train/loss" in seam[-1]


# --- Forced Rethinking ----------------------------------------------------------------------------------------

def test_rethink_appends_the_masked_trigger_in_place_of_eos_and_continues_by_hand():
    groups = _groups(2)
    # call 1: sample 0 ends with EOS (completed), sample 1 runs out of tokens (truncated: never rethought)
    # call 2: the continuation of sample 0 after the trigger
    engine = ScriptedEngine([[[5, 6, EOS], [4, 4, 4, 4]], [[7, EOS]]])
    strategy = RethinkStrategy([30, 31], fraction=1.0, new_tokens=5, eos_ids={EOS}, seed=0)
    strategy.run(engine, groups, SamplingParams(max_new_tokens=4), count())
    done, cut = groups[0].samples
    assert done.response_ids == [5, 6, 30, 31, 7, EOS]
    assert done.loss_mask == [1, 1, 0, 0, 1, 1]
    assert done.behaviour_logprobs == pytest.approx([-0.5, -0.6, 0.0, 0.0, -0.7, -0.2])
    assert done.status == Status.COMPLETED and done.info["rethink"]
    assert done.version_spans == [(0, 2, 0), (4, 6, 0)]  # the EOS dropped from the first span
    cont = engine.calls[1][0]
    assert cont.prompt_ids == [9, 9, 9] and cont.response_ids == [5, 6, 30, 31]
    assert cont.params.max_new_tokens == 4 + 5  # the continuation's own budget after the trigger
    assert cut.response_ids == [4, 4, 4, 4] and cut.loss_mask == [1] * 4 and "rethink" not in cut.info
    assert strategy.metrics() == {"rethink/samples_frac": 1.0, "rethink/trigger_tokens": 2.0,
                                  "rethink/continuation_tokens_mean": 2.0}


def test_rethink_fraction_zero_leaves_responses_alone_and_counts():
    groups = _groups(2)
    engine = ScriptedEngine([[[5, EOS], [6, EOS]]])
    strategy = RethinkStrategy([30], fraction=0.0, new_tokens=5, eos_ids={EOS}, seed=0)
    strategy.run(engine, groups, SamplingParams(max_new_tokens=4), count())
    assert [s.response_ids for s in groups[0].samples] == [[5, EOS], [6, EOS]] and len(engine.calls) == 1
    assert strategy.metrics()["rethink/samples_frac"] == 0.0


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory):
    """A tiny model that ends about a third of its 8-token responses with EOS (a random one almost never does):
    residual dimension 0 is a constant 50 that only the EOS row of the head reads."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = 0.4
    path = tmp_path_factory.mktemp("eos-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_rethink_on_the_torch_engine_keeps_behaviour_logprobs_equal_to_the_models(eos_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(eos_model_dir)
    model = AutoModelForCausalLM.from_pretrained(eos_model_dir).eval()
    engine = TorchEngine(model, tok, seed=1)
    trigger = tok.encode("\nWait, let me check.", add_special_tokens=False)
    strategy = RethinkStrategy(trigger, fraction=1.0, new_tokens=6, eos_ids={tok.eos_token_id}, seed=0)
    groups = _groups(16)
    prompt_ids = tok.encode("What is 3 + 4?")
    for s in groups[0].samples:
        s.prompt_ids = prompt_ids
    strategy.run(engine, groups, SamplingParams(max_new_tokens=8), count())
    rethought = [s for s in groups[0].samples if s.info.get("rethink")]
    assert len(rethought) >= 2
    for s in rethought:
        start = s.info["forced_spans"][0][0]
        assert s.response_ids[start:start + len(trigger)] == trigger
        assert s.loss_mask[start:start + len(trigger)] == [0] * len(trigger) and sum(s.loss_mask) > start
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        target = torch.tensor(s.response_ids)
        trainer = logp[len(s.prompt_ids) - 1:].gather(-1, target[:, None])[:, 0]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(s.behaviour_logprobs)[mask], trainer[mask], atol=1e-4)


@pytest.mark.slow
def test_a_rethink_run_trains_on_continued_responses_with_matching_logprobs(eos_model_dir, tmp_path):
    rows = _rows(eos_model_dir, tmp_path / "rethink", **{"rollout.strategy": "rethink", "rollout.rethink.fraction": 1.0,
                                                        "rollout.rethink.max_new_tokens": 6, "train.steps": 2,
                                                        "reward.fn": "toy_plugins:digit_fraction"})
    assert all(r["rethink/samples_frac"] == 1.0 for r in rows)
    assert all(r["rethink/continuation_tokens_mean"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-3 for r in rows)  # behaviour log-probs of trained tokens
    logged = [json.loads(line) for p in (tmp_path / "rethink" / "samples").glob("*.jsonl")
              for line in p.read_text().splitlines()]
    assert any("Wait, let me check." in s["response"] for s in logged)


# --- ADHint ---------------------------------------------------------------------------------------------------

def test_hint_ratio_and_hint_text_by_hand():
    assert hint_ratio(0.0, 0.5) == 0.5 and hint_ratio(0.75, 0.5) == pytest.approx(0.125)
    assert hint_ratio(1.0, 0.5) == 0.0
    assert hint_text(Prompt("a", [], answer="7")) == "The answer is 7."
    assert hint_text(Prompt("b", [], answer="7", info={"hint": "3 + 4 = 7"})) == "3 + 4 = 7"
    assert hint_text(Prompt("c", [])) is None


def test_adhint_hints_the_first_samples_and_learns_accuracy_from_the_unhinted_ones_by_hand():
    tok = tiny_tokenizer()
    hint = tok.encode("The answer is 7.", add_special_tokens=False)
    strategy = ADHintStrategy(tok, max_ratio=1.0, hinted_samples=2, momentum=0.5)
    groups = _groups(4)
    engine = ScriptedEngine([[[5, EOS]] * 4, [[6, EOS]] * 4])
    strategy.run(engine, groups, SamplingParams(max_new_tokens=4), count())
    n = round(0.5 * len(hint))  # prior 0.5 -> ratio 1.0 x (1 - 0.5)
    hinted, plain = groups[0].samples[:2], groups[0].samples[2:]
    for s in hinted:
        assert s.response_ids == hint[:n] + [5, EOS] and s.loss_mask == [0] * n + [1, 1]
        assert s.info["adhint_tokens"] == n
    assert all(s.response_ids == [5, EOS] and s.loss_mask == [1, 1] for s in plain)
    assert engine.calls[0][0].params.max_new_tokens == n + 4  # the hint does not eat the response's budget
    assert strategy.metrics()["adhint/ratio_mean"] == 0.5
    # the Score stage marks the samples: hinted ones right, unhinted ones half right
    for s in groups[0].samples:
        s.correct = True
    for s in plain[1:]:
        s.correct = False
    groups2 = _groups(4)
    strategy.run(engine, groups2, SamplingParams(max_new_tokens=4), count())
    # unhinted accuracy 0.5 (hinted samples ignored): 0.5 x 0.5 + 0.5 x 0.5 = 0.5 for p0, overall too
    assert strategy.accuracy["p0"] == pytest.approx(0.5) and strategy.overall == pytest.approx(0.5)
    for s in plain:
        s.correct = True
    strategy.observe(groups[:1])  # accuracy 1 now: 0.5 x 0.5 + 0.5 x 1.0
    assert strategy.accuracy["p0"] == pytest.approx(0.75)
    assert hint_ratio(strategy.prior(groups[0].prompt), 1.0) == pytest.approx(0.25)


def test_adhint_method_scales_the_advantage_of_hinted_responses_by_hand(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, **{"rollout.strategy": "adhint", "algo.method": "adhint",
                                         "rollout.adhint.weight": 0.25, "rollout.adhint.samples": 2})
    samples = _groups(4)[0].samples
    for s, adv, hinted in zip(samples, [1.0, -2.0, 0.5, -0.5], [True, True, False, False]):
        s.advantage, s.correct = adv, adv > 0
        if hinted:
            s.info["adhint_tokens"] = 3
    prepared = ADHint(MethodSetup(cfg)).prepare(StepInput(0, Stage("adhint", 0, 2, 0, 1), [], samples))
    assert [s.advantage for s in prepared.samples] == [0.25, -0.5, 0.5, -0.5]
    assert prepared.metrics["adhint/hinted_frac"] == 0.5
    assert prepared.metrics["adhint/hinted_accuracy"] == 0.5 and prepared.metrics["adhint/unhinted_accuracy"] == 0.5


@pytest.mark.slow
def test_an_adhint_run_hints_half_of_each_group_and_modulates_them(tiny_model_dir, tmp_path):
    rows = _rows(tiny_model_dir, tmp_path / "adhint", **{
        "rollout.strategy": "adhint", "algo.method": "adhint", "rollout.adhint.samples": 2,
        "rollout.adhint.max_ratio": 1.0, "reward.fn": "toy_plugins:digit_fraction", "train.steps": 2})
    assert all(r["adhint/ratio_mean"] > 0 and r["adhint/hint_tokens_mean"] >= 1 for r in rows)
    assert rows[0]["adhint/accuracy_prior"] == 0.5 and rows[1]["adhint/accuracy_prior"] != 0.5  # learned
    assert all(0 < r["adhint/hinted_frac"] <= 0.5 and r["adhint/advantage_scale"] == 0.5 for r in rows)
    logged = [json.loads(line) for p in (tmp_path / "adhint" / "samples").glob("*.jsonl")
              for line in p.read_text().splitlines()]
    assert any(s["response"].startswith("The") for s in logged)


# --- Tandem RL -------------------------------------------------------------------------------------------------

def test_tandem_alternates_senior_and_junior_segments_and_masks_the_juniors_by_hand():
    groups = _groups(1)
    senior = ScriptedEngine([[[5, 6]], [[3, 3]]])
    junior = ScriptedEngine([[[7, 8]], [[9, EOS]]])
    strategy = TandemStrategy(junior, segment_tokens=2, junior_prob=1.0, seed=0)
    strategy.run(senior, groups, SamplingParams(max_new_tokens=6), count())
    s = groups[0].samples[0]
    assert s.response_ids == [5, 6, 7, 8, 9, EOS] and s.status == Status.COMPLETED
    assert s.loss_mask == [1, 1, 0, 0, 0, 0]
    assert s.behaviour_logprobs == pytest.approx([-0.5, -0.6, 0.0, 0.0, 0.0, 0.0])
    assert len(senior.calls) == 1 and [r.response_ids for [r] in junior.calls] == [[5, 6], [5, 6, 7, 8]]
    assert [r.params.max_new_tokens for [r] in junior.calls] == [4, 6]  # one segment at a time, within the cap
    assert strategy.metrics() == {"tandem/junior_token_frac": pytest.approx(4 / 6), "tandem/segments_mean": 3.0,
                                  "tandem/junior_segment_frac": pytest.approx(2 / 3)}


def test_tandem_senior_continues_after_the_junior_with_the_juniors_tokens_in_context():
    groups = _groups(1)
    senior = ScriptedEngine([[[5, 6]], [[3, EOS]]])
    junior = ScriptedEngine([[[7, 8]]])
    strategy = TandemStrategy(junior, segment_tokens=2, junior_prob=0.5, seed=0)
    strategy.rng.random = iter([0.1, 0.9]).__next__  # segment 2: junior (0.1 < 0.5); segment 3: senior
    strategy.run(senior, groups, SamplingParams(max_new_tokens=8), count())
    s = groups[0].samples[0]
    assert s.response_ids == [5, 6, 7, 8, 3, EOS] and s.loss_mask == [1, 1, 0, 0, 1, 1]
    assert s.behaviour_logprobs == pytest.approx([-0.5, -0.6, 0.0, 0.0, -0.3, -0.2])
    assert senior.calls[1][0].response_ids == [5, 6, 7, 8]
    assert s.version_spans == [(0, 2, 0), (4, 6, 0)]


@pytest.fixture(scope="module")
def junior_model_dir(tmp_path_factory):
    """Another random tiny model (other weights, the same tokenizer)."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("junior-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_tandem_run_trains_only_the_seniors_tokens_with_matching_logprobs(junior_model_dir, tiny_model_dir, tmp_path):
    rows = _rows(tiny_model_dir, tmp_path / "tandem", **{
        "rollout.strategy": "tandem", "rollout.tandem.junior": str(junior_model_dir),
        "rollout.tandem.segment_tokens": 2,
        "rollout.tandem.junior_prob": 0.5, "reward.fn": "toy_plugins:digit_fraction", "train.steps": 2})
    assert all(0.1 < r["tandem/junior_token_frac"] < 0.7 and r["tandem/segments_mean"] > 2 for r in rows)
    # the senior's tokens, sampled in a context with the junior's, keep log-probs equal to the trainer's (the junior's
    # weights differ: its tokens, were they not masked, would be far off)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-3 for r in rows)


# --- EEPO ------------------------------------------------------------------------------------------------------

def test_response_logp_is_the_mean_log_prob_of_the_unmasked_response_tokens_by_hand():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    s = _groups(1)[0].samples[0]
    s.prompt_ids, s.response_ids, s.loss_mask = [5, 6, 7], [8, 9, 10], [1, 0, 1]
    short = _groups(1)[0].samples[0]
    short.prompt_ids, short.response_ids, short.loss_mask = [5], [11], [1]
    with torch.no_grad():
        got = response_logp(model, [s, short], pad_id=0)
        logp = torch.log_softmax(model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0].float(), -1)
        want = (logp[2, 8] + logp[4, 10]) / 2  # token 9 is masked out
        want_short = torch.log_softmax(model(torch.tensor([[5, 11]])).logits[0].float(), -1)[0, 11]
    assert got.tolist() == pytest.approx([float(want), float(want_short)], abs=1e-5)


class RecordingEngine(ScriptedEngine):
    def __init__(self, script):
        super().__init__(script)
        self.version, self.pushed = 3, []

    def update_weights(self, state, version):
        self.pushed.append((sorted(state), version))


def test_eepo_samples_the_first_half_from_the_policy_and_the_second_from_the_unlearned_copy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    groups = _groups(3)  # ceil(3 / 2) = 2 samples from the policy, 1 from the copy
    engine = RecordingEngine([[[5, EOS], [6, EOS]]])
    explorer = RecordingEngine([[[7, 8, EOS]]])
    strategy = EEPOStrategy(policy, explorer, unlearn_steps=3, unlearn_lr=1e-2, pad_id=0)
    strategy.run(engine, groups, SamplingParams(max_new_tokens=4), count())
    assert [s.response_ids for s in groups[0].samples] == [[5, EOS], [6, EOS], [7, 8, EOS]]
    assert groups[0].samples[2].behaviour_logprobs == pytest.approx([-0.7, -0.8, -0.2])  # the copy's own
    names, version = explorer.pushed[0]
    assert version == 3 and names == sorted(n for n, _ in policy.named_parameters())
    m = strategy.metrics()
    assert m["eepo/unlearn_logp_after"] < m["eepo/unlearn_logp_before"] - 0.1  # the first half suppressed
    with torch.no_grad():  # the policy itself is untouched
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), fresh.parameters()))
    assert m["eepo/distinct_frac_first"] == 1.0 and m["eepo/distinct_frac_second"] == 1.0


@pytest.mark.slow
def test_an_eepo_run_unlearns_and_trains_the_second_half_as_off_policy(tiny_model_dir, tmp_path):
    common = {"rollout.strategy": "eepo", "reward.fn": "toy_plugins:digit_fraction", "train.steps": 2,
              "algo.is_correction": "tis_token"}
    rows = _rows(tiny_model_dir, tmp_path / "eepo", **common, **{"rollout.eepo.unlearn_steps": 2,
                                                              "rollout.eepo.unlearn_lr": 1e-2})
    assert all(r["eepo/unlearn_logp_after"] < r["eepo/unlearn_logp_before"] for r in rows)
    assert all(r["mismatch/logprob_abs_diff_max"] > 0.05 for r in rows)  # behaviour = the copy's log-probs
    flat = _rows(tiny_model_dir, tmp_path / "flat", **common, **{"rollout.eepo.unlearn_steps": 0})
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-3 for r in flat)  # no unlearning: the copy is the policy


# --- recipes and errors ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["rethink", "adhint", "tandem", "eepo"])
def test_seed_recipe_runs_two_steps_on_the_tiny_model(name, tiny_model_dir, tmp_path):
    cfg = load(RECIPES / f"{name}.toml", tiny_overrides(tiny_model_dir, **{
        "reward.fn": "toy_plugins:digit_fraction", "eval.n": 4, "run.report": False, "run.name": None}))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(f"{name}/" in " ".join(r) for r in rows)


@pytest.mark.parametrize("name", ["rethink", "adhint", "tandem", "eepo"])
def test_seed_recipe_passes_dry_run(name):
    result = CliRunner().invoke(app, ["train", str(RECIPES / f"{name}.toml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f'strategy = "{name}"' in result.output


def test_a_strategy_on_a_multi_turn_task_stops_at_start_with_one_line(tiny_model_dir, tmp_path):
    from rollwise.config import ConfigError

    cfg = tiny_config(tiny_model_dir, **{"data.task": "calc", "rollout.strategy": "rethink", "eval.n": 0,
                                         "data.max_prompt_tokens": 1024})
    with pytest.raises(ConfigError, match="set rollout.strategy = 'plain' or a single-turn task"):
        with contextlib.redirect_stdout(io.StringIO()):
            train(cfg, tmp_path / "calc")


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.strategy": "rethnk"}, "unknown rollout strategy 'rethnk'; registered: adhint, duet, eepo, plain, rethink, tandem, tree"),
    ({"rollout.strategy": "rethink", "control.mode": "async"}, "set control.mode = 'sync'"),
    ({"rollout.strategy": "rethink", "control.partial_rollouts": True}, "control.partial_rollouts = false"),
    ({"rollout.strategy": "rethink", "rollout.stop": ["."]}, "set rollout.stop = []"),
    ({"rollout.strategy": "rethink", "rollout.rethink.fraction": 1.5}, "rollout.rethink.fraction"),
    ({"rollout.strategy": "adhint"}, "algo.method = 'adhint' (their gradient modulation) go together"),
    ({"algo.method": "adhint"}, "go together"),
    ({"rollout.strategy": "tandem", "rollout.tandem.segment_tokens": 0}, "rollout.tandem.segment_tokens"),
    ({"rollout.strategy": "tandem", "lora.rank": 4}, "name the junior's model directory in rollout.tandem.junior"),
    ({"rollout.strategy": "eepo", "lora.rank": 4}, "set lora.rank = 0 and train.backend = 'local'"),
    ({"rollout.strategy": "adhint", "algo.method": "adhint", "rollout.adhint.samples": 4},
     "set it below rollout.samples_per_prompt"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(tiny_model_dir, overrides, message):
    result = CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(tiny_model_dir, **overrides)])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


# --- resume ----------------------------------------------------------------------------------------------------


def _resumed_rows(model_dir, run_dir, **settings) -> list[dict]:
    _rows(model_dir, run_dir, **{**settings, "train.steps": 2})
    cfg = tiny_config(model_dir, **{"eval.n": 0, "run.report": False, **settings})
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, run_dir, resume=True)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, keys", [
    ("adhint", ["adhint/accuracy_prior", "adhint/ratio_mean", "adhint/hinted_frac"]),
    ("rethink", ["rethink/samples_frac", "rethink/continuation_tokens_mean"]),
])
def test_a_resumed_run_goes_on_with_the_strategys_state(strategy, keys, tiny_model_dir, eos_model_dir, tmp_path):
    """A strategy's running rates (ADHint) and its own RNG (rethink's choice of responses) are in the checkpoint:
    steps 3 and 4 of a run resumed at step 2 equal those of the uninterrupted run."""
    settings = {"rollout.strategy": strategy, "reward.fn": "toy_plugins:digit_fraction", "train.steps": 4,
                "run.save_every_steps": 2}
    if strategy == "adhint":
        model_dir = tiny_model_dir
        settings.update({"algo.method": "adhint", "rollout.adhint.samples": 2, "rollout.adhint.max_ratio": 1.0})
    else:
        model_dir = eos_model_dir
        settings.update({"rollout.rethink.fraction": 0.5, "rollout.rethink.max_new_tokens": 4})
    straight = _rows(model_dir, tmp_path / "straight", **settings)
    resumed = _resumed_rows(model_dir, tmp_path / "resumed", **settings)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in keys:
        assert [r[key] for r in resumed[2:]] == [r[key] for r in straight[2:]], key
