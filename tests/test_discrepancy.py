"""Control of the engine-vs-trainer discrepancy (`algo.method = "dcmdp"` / `"acrl"`): the formulas by hand, the
controllers through real runs on an fp8 engine against an fp32 trainer, resume, and the errors at --dry-run."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.algo.discrepancy import discrepancy, dual_ascent, fit_threshold, gap_mask, threshold_control
from rollwise.cli import app
from rollwise.generate.quantize import fake_quantize_, quantize_weight
from rollwise.loop import train
from rollwise.sync import default_max_diff

TARGET = 5e-4
# an fp8 engine against an fp32 trainer on a tiny model whose head is scaled up (sharper policy, a real gap:
# mismatch/k3 about 1.5e-3 at step 1)
RUN = {"train.steps": 8, "eval.n": 0, "reward.fn": "toy_plugins:even_id_fraction", "train.lr": 3e-4,
       "rollout.max_new_tokens": 16, "rollout.engine_options": {"weight_quant": "fp8"}}
# each method's own table ([algo.acrl], [algo.dcmdp]): only the run's method reads one
TABLES = {"acrl": {"algo.acrl.target": TARGET, "algo.acrl.threshold_min": 0.02}, "dcmdp": {"algo.dcmdp.target": TARGET}}


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    path = tmp_path_factory.mktemp("sharp-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _train_rows(model_dir, run_dir, resume=False, **overrides) -> list[dict]:
    cfg = tiny_config(model_dir, **{**RUN, **TABLES.get(overrides.get("algo.method"), {}), **overrides})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, run_dir, resume=resume)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


# --- the formulas, by hand ------------------------------------------------------------------------------------

def test_k3_and_abs_gap_per_token_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    engine = torch.log(torch.tensor([[0.25, 0.2, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # r = 2: 2 - 1 - ln 2; r = 1: 0; the masked token: 0
    assert discrepancy(trainer, engine, mask, "k3").tolist()[0] == pytest.approx([1 - math.log(2), 0.0, 0.0])
    assert discrepancy(trainer, engine, mask, "abs_gap").tolist()[0] == pytest.approx([math.log(2), 0.0, 0.0])
    with pytest.raises(ValueError, match="not one of k3, abs_gap"):
        discrepancy(trainer, engine, mask, "kl")


def test_dual_ascent_steps_by_hand():
    lam = dual_ascent(0.0, 0.03, target=0.01, lr=10.0, max_value=100.0)
    assert lam == pytest.approx(0.2)  # 0 + 10 x 0.02
    lam = dual_ascent(lam, 0.005, 0.01, 10.0, 100.0)
    assert lam == pytest.approx(0.15)  # 0.2 - 10 x 0.005
    lam = dual_ascent(lam, 0.0, 0.01, 10.0, 100.0)
    assert lam == pytest.approx(0.05)
    assert dual_ascent(lam, 0.0, 0.01, 10.0, 100.0) == 0.0  # clipped at 0, not -0.05
    assert dual_ascent(99.9, 1.0, 0.01, 10.0, 100.0) == 100.0  # clipped at dual_max


def test_gap_mask_and_the_fitted_threshold_by_hand():
    trainer = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    engine = torch.tensor([[0.1, -0.31, 0.29, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert gap_mask(trainer, engine, mask, 0.3).tolist() == [[1.0, 0.0, 1.0, 0.0]]
    gaps, values = torch.tensor([0.1, -0.2, 0.5, 0.05]), torch.tensor([0.01, 0.02, 0.3, 0.001])
    # by |gap|: 0.05, 0.1, 0.2, 0.5 with running means 0.001, 0.0055, 0.010333, 0.08275
    assert fit_threshold(gaps, values, 0.015) == pytest.approx(0.2)
    assert fit_threshold(gaps, values, 0.006) == pytest.approx(0.1)
    assert fit_threshold(gaps, values, 0.1) is None  # every token fits: no threshold needed
    assert fit_threshold(gaps, values, 0.0005) == 0.0  # not even the smallest gap fits
    assert threshold_control(2.0, 0.2, 1.0, 0.05, 2.0) == pytest.approx(0.2)
    assert threshold_control(2.0, 0.2, 0.5, 0.05, 2.0) == pytest.approx(math.sqrt(2.0 * 0.2))
    assert threshold_control(0.2, None, 1.0, 0.05, 2.0) == 2.0  # nothing to mask: back to the loosest
    assert threshold_control(0.2, 0.0, 1.0, 0.05, 2.0) == 0.05  # kept at the tightest


def test_int8_and_fp8_weights_by_hand():
    w = torch.tensor([[0.5, -1.27, 0.003], [2.0, 1.0, -0.3]])
    # int8, per row: scale = amax / 127 = 0.01 and 2 / 127
    assert quantize_weight(w, "int8")[0].tolist() == pytest.approx([0.5, -1.27, 0.0])
    s = 2.0 / 127
    assert quantize_weight(w, "int8")[1].tolist() == pytest.approx([2.0, round(1.0 / s) * s, round(-0.3 / s) * s])
    # fp8 e4m3 with scale amax / 448: 1.0 / (2 / 448) = 224 is exact; 0.3 / (2 / 448) = 67.2 lies in [64, 128), where
    # e4m3's 3 mantissa bits step by 8: it rounds to 64
    assert quantize_weight(w, "fp8")[1].tolist() == pytest.approx([2.0, 1.0, -64 * 2.0 / 448])
    with pytest.raises(ValueError, match="int4"):
        quantize_weight(w, "int4")


def test_a_quantized_engine_keeps_its_head_and_is_allowed_its_gap_by_the_sync_check():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), tie_word_embeddings=False)
    head = model.lm_head.weight.clone()
    q_proj = model.model.layers[0].self_attn.q_proj.weight.clone()
    assert fake_quantize_(model, "int8") == 7 * len(model.model.layers)  # q k v o gate up down, not the head
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, quantize_weight(q_proj, "int8"))
    assert default_max_diff(torch.float32) == 1e-2 and default_max_diff(torch.float32, "fp8") == 3.0


# --- the controllers through real runs -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_acrl_brings_the_trained_discrepancy_back_under_the_target_where_plain_rl_stays_above(
        tmp_path, sharp_model_dir, seed):
    """The same run (seed, engine, data) without control and with ACRL: the fp8 engine's gap puts the first step
    above the target in both; the uncontrolled run stays above for more steps, while ACRL's trained discrepancy
    is back under the target the step after each violation, by masking the tokens of largest gap."""
    plain = _train_rows(sharp_model_dir, tmp_path / "rl", **{"train.seed": seed})
    acrl = _train_rows(sharp_model_dir, tmp_path / "acrl", **{"train.seed": seed, "algo.method": "acrl"})
    plain_d = [r.get("mismatch/k3") for r in plain]  # None: a step with no trained token
    trained = [r.get("mismatch/acrl_trained_discrepancy") for r in acrl]
    assert plain_d[0] > TARGET and trained[0] > TARGET  # the rise above the tolerance, in both
    assert acrl[0]["mismatch/acrl_threshold"] == 2.0 and acrl[0]["mismatch/acrl_masked_frac"] == 0.0
    assert acrl[0]["mismatch/discrepancy"] == pytest.approx(plain_d[0], rel=1e-4)  # D is mismatch/k3, like with like
    assert acrl[1]["mismatch/acrl_threshold"] < 0.5 and acrl[1]["mismatch/acrl_masked_frac"] > 0.0
    above_plain = sum(d is not None and d > TARGET for d in plain_d)
    for step in range(len(trained) - 1):
        if trained[step] is not None and trained[step] > TARGET:
            assert trained[step + 1] is None or trained[step + 1] <= TARGET, (step, trained)
    assert sum(d is not None and d > TARGET for d in trained) < above_plain, (trained, plain_d)
    for row in acrl:
        if "mismatch/violation" in row:
            assert row["mismatch/violation"] == pytest.approx(row["mismatch/acrl_trained_discrepancy"] - TARGET)


def test_dcmdp_lambda_follows_dual_ascent_on_the_logged_discrepancy(tmp_path, sharp_model_dir):
    """`mismatch/lambda` of step t+1 = clip(lambda_t + dual_lr (D_t - target), 0, dual_max) on the logged D: it
    rises while D is above the tolerance and falls back to 0 inside it; a positive lambda changes the update."""
    rows = _train_rows(sharp_model_dir, tmp_path / "dcmdp", **{"algo.method": "dcmdp", "algo.dcmdp.dual_lr": 1000.0,
                                                                "algo.dcmdp.dual_max": 0.8})
    plain = _train_rows(sharp_model_dir, tmp_path / "rl")
    assert rows[0]["mismatch/lambda"] == 0.0
    for before, after in zip(rows, rows[1:]):
        d = before.get("mismatch/discrepancy")
        expected = before["mismatch/lambda"] if d is None else min(max(
            0.0, before["mismatch/lambda"] + 1000.0 * (d - TARGET)), 0.8)
        assert after["mismatch/lambda"] == pytest.approx(expected, abs=1e-9)
        if d is not None:
            assert before["mismatch/violation"] == pytest.approx(d - TARGET)
            assert d == pytest.approx(before["mismatch/k3"], rel=1e-4)
    lambdas = [r["mismatch/lambda"] for r in rows]
    assert max(lambdas) == 0.8  # above the tolerance: the multiplier grew to its cap
    assert rows[0]["reward/mean"] == plain[0]["reward/mean"]  # same first batch, lambda 0
    assert rows[2]["train/loss"] != pytest.approx(plain[2]["train/loss"])  # the penalty term trained


def test_the_dcmdp_penalty_pulls_the_trainer_toward_a_fixed_engine():
    """With the engine held fixed, gradient steps on `lambda x k3` alone lower the trainer's k3 against it: the
    self-correction signal DCMDP relies on."""
    from rollwise.methods.discrepancy import DiscrepancyTerms
    from rollwise.train.batching import MicroBatch

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, requires_grad=True)  # a free "trainer" [S, T, V]
    tokens = torch.randint(0, 11, (4, 6))
    engine = (torch.randn(4, 6, 11) * 2).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # [S, T]
    mask = torch.ones(4, 6)
    mb = MicroBatch.__new__(MicroBatch)
    mb.full_logp, mb.loss_mask, mb.current = engine, mask, torch.ones(4, 6, dtype=torch.bool)
    terms = DiscrepancyTerms("k3", 0.01, penalty=1.0)
    optimizer = torch.optim.SGD([logits], lr=0.5)

    def k3() -> float:
        logp = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        return float(discrepancy(logp.detach(), engine, mask).mean())

    start = k3()
    for _ in range(20):
        optimizer.zero_grad()
        logp = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        terms.extra_loss(logp, None, None, mb, lambda per_token, m: (per_token * m).sum() / m.sum()).backward()
        optimizer.step()
    assert k3() < 0.5 * start


def test_the_controllers_state_is_saved_and_a_resumed_run_goes_on_with_it(tmp_path, sharp_model_dir):
    settings = {"algo.method": "acrl", "train.steps": 4, "run.save_every_steps": 2}
    straight = _train_rows(sharp_model_dir, tmp_path / "straight", **settings)
    _train_rows(sharp_model_dir, tmp_path / "resumed", **{**settings, "train.steps": 2})
    resumed = _train_rows(sharp_model_dir, tmp_path / "resumed", resume=True, **settings)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2]["mismatch/acrl_threshold"] == straight[2]["mismatch/acrl_threshold"] < 2.0


# --- the names and the errors, at --dry-run -------------------------------------------------------------------

def _dry_run(model_dir, **overrides):
    args = ["train", "--dry-run", *tiny_overrides(model_dir, **overrides)]
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("method", ["acrl", "dcmdp"])
def test_both_names_resolve_at_dry_run(tiny_model_dir, method):
    result = _dry_run(tiny_model_dir, **{"algo.method": method})
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("overrides, message", [
    ({"algo.method": "dcmpd"}, "algo.method = 'dcmpd' is not a known method"),
    ({"algo.method": "acrl", "train.old_logprobs": "behaviour"}, "set train.old_logprobs = 'recompute'"),
    ({"algo.method": "acrl", "algo.acrl.threshold_min": 3.0}, "algo.acrl.threshold_min = 3 is above"),
    ({"rollout.engine_options": {"weight_quant": "int4"}}, "weight_quant = 'int4' is not one of int8, fp8"),
    ({"rollout.engine_options": {"weight_quant": "int8"}, "control.mode": "async", "algo.is_correction": "tis_token"},
     "weight_quant is not applied by the async engine process"),
    ({"algo.method": "dcmdp", "teacher.weights": "."}, "algo.method = 'dcmdp' is the method of a run without"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(tiny_model_dir, overrides, message):
    result = _dry_run(tiny_model_dir, **overrides)
    assert result.exit_code == 2, result.output
    assert message in result.output
