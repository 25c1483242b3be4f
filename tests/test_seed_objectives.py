"""Seed methods, objectives (issue 23): HARGO, EchoRL, the progress advantage and layer subsets.

The math by hand, then real tiny runs that show each mechanism acts (its metrics in the rows, its effect on the
advantages or on the weights trained), the errors at --dry-run, and the recipes in recipes/seed/ (dry-run and two
steps on the tiny model)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from helpers_model import tiny_llama
from rollwise.algo.progress import progress, step_index
from rollwise.cli import app
from rollwise.loop import train
from rollwise.methods.echorl import EchoTerms, all_success, echo_clip_mask
from rollwise.methods.hargo import _confidence, hargo_weights, reward_contrast
from rollwise.methods.progress import ProgressTerms
from rollwise.train.trainable import TrainableError, apply_trainable, parse_layers
from rollwise.types import Group, Prompt, RewardResult, Sample, Status
from rollwise.validate import load

SEED = Path(__file__).resolve().parents[1] / "recipes" / "seed"
BASE = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 0, "run.report": False, "run.name": None}


def always_right(sample: Sample) -> RewardResult:
    """Every response verified correct: every group is all-success (GRPO's advantages are all 0)."""
    return RewardResult(value=1.0, parts={"correct": 1.0}, correct=True)


def _run(model_dir, run_dir, **overrides) -> list[dict]:
    cfg = tiny_config(model_dir, **{**BASE, **overrides})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, run_dir)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


def _samples(run_dir, step: int) -> list[dict]:
    lines = (Path(run_dir) / "samples" / f"step-{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


# --- HARGO -------------------------------------------------------------------------------------------------------

def test_hargo_contrast_and_confidence_by_hand():
    # group 0: rewards 1,0,0,0: std = sqrt(3)/4, D = 2 std = 0.8660; group 1: 1,0 -> std 0.5, D = 1 (capped)
    d = reward_contrast(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert d.tolist() == pytest.approx([math.sqrt(3) / 2] * 4 + [1.0, 1.0])
    # geometric mean of 0.5 and 0.25 over the trained tokens (the third is masked out): sqrt(0.125)
    assert _confidence(torch.log(torch.tensor([0.5, 0.25, 0.9])), [1, 1, 0]) == pytest.approx(math.sqrt(0.125))


def test_hargo_weights_by_hand():
    a = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    d = torch.tensor([1.0, 1.0, 0.25, 0.25, 0.0])
    c = torch.tensor([0.5, 0.8, 0.2, 0.1, 0.3])
    w, m = hargo_weights(a, d, c, alpha=1.0, gamma=1.0, temperature=1.0)
    # u = 1 - C for A > 0, C for A < 0: 0.5, 0.8, 0.8, 0.1; M = A (1 + D)(1 + u)
    assert m.tolist()[:4] == pytest.approx([3.0, -3.6, 2.25, -1.375])
    z = [3.0 / 2.55625, 3.6 / 2.55625, 2.25 / 2.55625, 1.375 / 2.55625]  # |M| / mean |M| (mean 10.225 / 4)
    expected = [4 * math.exp(v) / sum(math.exp(x) for x in z) for v in z]
    assert w.tolist() == pytest.approx(expected + [0.0], rel=1e-5)
    assert float(w[:4].mean()) == pytest.approx(1.0)
    # a confident mistake (C = 0.8) outweighs an unsure one (C = 0.1) in a lower-contrast group
    assert w[1] > w[0] > w[2] > w[3]
    flat, _ = hargo_weights(a, d, c, 1.0, 1.0, temperature=1e6)
    assert flat.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0], abs=1e-4)  # large temperature: GRPO


@pytest.mark.slow
def test_hargo_run_reweights_the_grpo_advantages(tiny_model_dir, tmp_path):
    run = {"train.steps": 1, "run.samples_logged_per_step": 16}
    grpo = _run(tiny_model_dir, tmp_path / "grpo", **run)
    rows = _run(tiny_model_dir, tmp_path / "hargo", **run, **{"algo.method": "hargo"})
    row = rows[0]
    for key in ("hargo/confidence_mean", "hargo/contrast_mean", "hargo/weight_max", "hargo/weight_min"):
        assert math.isfinite(row[key]), key
    assert 0 < row["hargo/confidence_mean"] < 1 and row["hargo/weight_max"] > row["hargo/weight_min"]
    assert grpo[0]["train/loss"] != pytest.approx(row["train/loss"])
    # same seed, same first batch: every trained advantage is GRPO's times the sample's recorded weight
    base = {(s["prompt"], s["response"]): s["advantage"] for s in _samples(tmp_path / "grpo", 1)}
    mine = _samples(tmp_path / "hargo", 1)
    assert {(s["prompt"], s["response"]) for s in mine} == set(base)
    nonzero = [s for s in mine if base[(s["prompt"], s["response"])] != 0]
    assert len(nonzero) >= 2 and len({round(s["hargo_weight"], 4) for s in nonzero}) > 1
    for s in nonzero:
        assert s["advantage"] == pytest.approx(s["hargo_weight"] * base[(s["prompt"], s["response"])], rel=1e-4)
        assert 0 < s["hargo_confidence"] < 1


# --- EchoRL ------------------------------------------------------------------------------------------------------

def test_echo_clip_is_the_lowest_entropy_window_by_hand():
    entropy = torch.tensor([[3.0, 1.0, 0.5, 2.0, 0.2, 4.0],
                            [0.1, 9.0, 0.3, 0.2, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
                         [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]])
    # row 0: n = 5, k = ceil(0.4 x 5) = 2; windows 4.0, 1.5, 2.5, 2.2 -> positions 1, 2
    # row 1: trained positions 0, 2, 3, 4 (n = 4, k = 2); windows 0.4, 0.5, 5.2 -> positions 0 and 2 (skips the gap)
    clip = echo_clip_mask(entropy, mask, 0.4)
    assert clip.tolist() == [[0, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]]


def _sample(correct, status=Status.COMPLETED, gid=0) -> Sample:
    return Sample(prompt=Prompt(uid="p", messages=[]), prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0],
                  loss_mask=[1], status=status, group_id=gid, correct=correct, reward=1.0 if correct else 0.0)


def test_all_success_groups():
    assert all_success(Group(0, None, [_sample(True), _sample(True)]))
    assert all_success(Group(0, None, [_sample(True), _sample(True), _sample(None, Status.FAILED)]))
    assert not all_success(Group(0, None, [_sample(True), _sample(False)]))
    assert not all_success(Group(0, None, [_sample(True)]))  # one sample verifies nothing about a group


def test_echo_terms_loss_by_hand():
    a, b = _sample(True), _sample(True)
    mb = SimpleNamespace(samples=[a, b], loss_mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.8, 0.1], [0.9, 0.9, 0.9, 1.0]])).requires_grad_(True)
    entropy = torch.tensor([[2.0, 1.0, 0.1, 3.0], [0.5, 0.5, 0.5, 0.0]])
    terms = EchoTerms({id(a)}, coef=0.5, frac=0.5)  # b is not an echo sample
    terms.start()
    token_sum = lambda per_token, m: (per_token * m).sum() / 7  # token_mean over the batch's 7 trained tokens
    loss = terms.extra_loss(logp, None, None, mb, token_sum, entropy=entropy)
    # row 0: k = 2, windows 3.0, 1.1, 3.1 -> tokens 1, 2: -(ln 0.25 + ln 0.8) / 7 x 0.5
    assert float(loss.detach()) == pytest.approx(-0.5 * (math.log(0.25) + math.log(0.8)) / 7, rel=1e-6)
    loss.backward()
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0
    m = terms.metrics()
    assert m["echorl/clip_tokens"] == 2 and m["echorl/clip_entropy_mean"] == pytest.approx(0.55)
    assert m["echorl/echo_entropy_mean"] == pytest.approx(1.525)


@pytest.mark.slow
def test_echorl_trains_all_success_groups_that_grpo_leaves_alone(tiny_model_dir, tmp_path):
    run = {"train.steps": 2, "reward.fn": "test_seed_objectives:always_right", "algo.method": "echorl",
           "run.save_every_steps": 2, "train.lr": 1e-2}
    rows = _run(tiny_model_dir, tmp_path / "echo", **run)
    for row in rows:
        assert row["echorl/echo_groups"] == 4 and row["echorl/echo_samples"] == 16
        assert row["echorl/clip_tokens"] > 0
        assert row["echorl/clip_entropy_mean"] < row["echorl/echo_entropy_mean"]  # the clip is the confident span
    assert rows[1]["echorl/clip_nll_mean"] < rows[0]["echorl/clip_nll_mean"]
    start = _weights(tiny_model_dir)
    trained = _weights(tmp_path / "echo" / "checkpoints" / "step-2")
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the EchoClip NLL moved the weights
    _run(tiny_model_dir, tmp_path / "off", **{**run, "algo.echorl.coef": 0.0})
    off = _weights(tmp_path / "off" / "checkpoints" / "step-2")
    assert all(torch.equal(start[k], off[k]) for k in start)  # every advantage is 0: nothing else trains


# --- progress advantage ------------------------------------------------------------------------------------------

def test_progress_advantage_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]])
    ratio = torch.tensor([[0.1, 0.2, -0.3, 0.4, 0.5, 9.0], [0.2, 7.0, -0.1, 0.6, 0.0, 0.0]])
    # row 0: steps (0, 1), (2, 3), (4): P = 0.3, 0.1, 0.5; row 1: trained positions 0, 2 | 3: P = 0.1, 0.6
    assert step_index(mask, 2).tolist()[0][:5] == [0, 0, 1, 1, 2]
    adv, returns = progress(torch.tensor([1.0, -1.0]), ratio, mask, coef=0.5, step_tokens=2)
    assert adv[0].tolist() == pytest.approx([1.15, 1.15, 1.05, 1.05, 1.25, 0.0])
    assert adv[1].tolist() == pytest.approx([-0.95, 0.0, -0.95, -0.7, 0.0, 0.0])
    assert returns[0].tolist() == pytest.approx([0.1, 0.3, 0.0, 0.4, 0.9, 0.0], abs=1e-6)
    assert returns[1].tolist() == pytest.approx([0.2, 0.0, 0.1, 0.7, 0.0, 0.0], abs=1e-6)


def test_progress_terms_use_the_reference_log_ratio():
    ref = SimpleNamespace(calls=0)

    def logprobs(mb):
        ref.calls += 1
        return torch.tensor([[-1.0, -2.0, -1.0, -0.5]])

    ref.logprobs = logprobs
    mb = SimpleNamespace(loss_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), advantages=torch.tensor([0.5]))
    own = torch.tensor([[-0.5, -2.5, -0.7, -3.0]])  # log-ratios 0.5, -0.5 | 0.3 (the fourth is masked out)
    terms = ProgressTerms(ref, coef=2.0, step_tokens=2)
    terms.start()
    adv = terms.advantages(own, mb, None)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.5, 1.1, 0.0])  # 0.5 + 2 x 0 | 0.5 + 2 x 0.3
    terms.advantages(own, mb, None)  # a second epoch over the same micro-batch: no second reference pass
    assert ref.calls == 1
    m = terms.metrics()
    assert m["progress/logratio_mean"] == pytest.approx(0.1) and m["progress/step_abs_mean"] == pytest.approx(0.1)


@pytest.mark.slow
def test_progress_run_starts_as_grpo_and_then_scores_steps(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path / "progress", **{"train.steps": 2, "algo.method": "progress",
                                                           "algo.progress.step_tokens": 2})
    assert rows[0]["progress/step_abs_mean"] < 1e-4  # step 1: pi = pi_ref, the advantages are GRPO's
    assert rows[1]["progress/step_abs_mean"] > 1e-3  # after an update the steps carry log pi / pi_ref
    assert rows[1]["progress/adv_shift_abs_mean"] == pytest.approx(0.5 * rows[1]["progress/step_abs_mean"])


# --- layer subsets -----------------------------------------------------------------------------------------------

def test_parse_layers():
    assert parse_layers("all") is None
    assert parse_layers("layers:20-29") == list(range(20, 30))
    assert parse_layers("layers:3,10-12,3") == [3, 10, 11, 12]
    with pytest.raises(TrainableError, match="train.trainable = 'layers:5-2'.*backwards"):
        parse_layers("layers:5-2")


def test_apply_trainable_freezes_all_but_the_chosen_layers():
    model = tiny_llama(32)
    info = apply_trainable(model, "layers:1")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(n.startswith("model.layers.1.") for n in names)
    assert info["layers"] == 1 and 0 < info["trainable"] < info["total"]
    with pytest.raises(TrainableError, match=r"train.trainable = 'layers:1-2': the model has 2 decoder layers \(0-1\)"):
        apply_trainable(tiny_llama(32), "layers:1-2")


@pytest.mark.slow
def test_layer_subset_run_trains_only_that_layer(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path / "layers", **{"train.steps": 2, "train.trainable": "layers:1",
                                                         "run.save_every_steps": 2})
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in rows)  # the engine samples from the trained weights
    start = _weights(tiny_model_dir)
    ckpt = tmp_path / "layers" / "checkpoints" / "step-2"
    trained = _weights(ckpt)
    changed = {k for k in start if not torch.equal(start[k], trained[k])}
    assert changed and all(k.startswith("model.layers.1.") for k in changed)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    n_layer = sum(1 for k in start if k.startswith("model.layers.1."))
    assert len(state["optimizer"]["state"]) == n_layer  # AdamW state for that layer only


def test_layer_subset_is_refused_with_lora(tiny_model_dir, tmp_path):
    with pytest.raises(TrainableError, match=r"train.trainable = 'layers:1'.*\[lora\]"):
        _run(tiny_model_dir, tmp_path / "lora", **{"train.trainable": "layers:1", "lora.rank": 2})


def test_dry_run_errors_name_the_key(tiny_model_dir):
    runner = CliRunner()
    cases = {"train.trainable=layers:x": "train.trainable",
             "algo.hargo.temperature=0": "algo.hargo.temperature",
             "algo.echorl.clip_frac=1.5": "algo.echorl.clip_frac",
             "algo.progress.step_tokens=0": "algo.progress.step_tokens",
             "algo.advantage=progress": "set algo.method = 'progress'"}
    for override, key in cases.items():
        method = [f"algo.method={override.split('.')[1]}"] if override.split("=")[0].count(".") == 2 else []
        result = runner.invoke(app, ["train", *tiny_overrides(tiny_model_dir), *method, override, "--dry-run"])
        assert result.exit_code != 0 and key in result.output, (override, result.output)
    for method in ("hargo", "progress"):
        result = runner.invoke(app, ["train", *tiny_overrides(tiny_model_dir), f"algo.method={method}",
                                     "algo.advantage=gae", "--dry-run"])
        assert result.exit_code != 0 and f"algo.method = '{method}'" in result.output, result.output


# --- recipes -----------------------------------------------------------------------------------------------------

RECIPES = {"hargo": "hargo/weight_max", "echorl": "echorl/echo_samples", "progress": "progress/step_abs_mean",
           "layers": "train/loss"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_seed_recipe_dry_run_and_two_steps(name, tiny_model_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(SEED / f"{name}.toml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    overrides = {**BASE, "eval.n": 4}
    if name == "layers":  # the recipe's layers 10-19 are SmolLM2's; the tiny model has 2
        overrides["train.trainable"] = "layers:1"
    cfg = load(SEED / f"{name}.toml", tiny_overrides(tiny_model_dir, **overrides))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["train/loss"]) and math.isfinite(row[RECIPES[name]]), (name, row)


# --- RELEX -------------------------------------------------------------------------------------------------------

def test_rank1_extrapolation_by_hand():
    from rollwise.relex import rank1_extrapolate

    v = torch.tensor([0.6, 0.8, 0.0])  # unit direction
    base = torch.tensor([1.0, -1.0, 2.0])
    steps = torch.tensor([1.0, 2.0, 4.0])
    deltas = torch.stack([(2 + 3 * n) * v for n in steps.tolist()])  # coordinates 5, 8, 14: exactly 2 + 3n
    out, explained = rank1_extrapolate(base, deltas, steps, 10.0)
    assert out.tolist() == pytest.approx((base + 32 * v).tolist(), abs=1e-5)  # 2 + 3 x 10 = 32
    assert explained == pytest.approx(1.0)
    # noise off the direction is dropped (the paper's denoising): along e3, uncorrelated with the coordinates
    # (5 x 0.08 - 8 x 0.05 + 14 x 0 = 0), so the top direction stays v and the fit stays 2 + 3n
    noise = torch.tensor([[0.0, 0.0, 0.08], [0.0, 0.0, -0.05], [0.0, 0.0, 0.0]])
    out, explained = rank1_extrapolate(base, deltas + noise, steps, 10.0)
    assert out.tolist() == pytest.approx((base + 32 * v).tolist(), abs=1e-5)
    assert explained == pytest.approx(285 / (285 + 0.0089))  # |c|^2 = 25 + 64 + 196 against |noise|^2
    still, none = rank1_extrapolate(base, torch.zeros(3, 3), steps, 10.0)  # a tensor that never moved
    assert torch.equal(still, base) and none == 0.0


@pytest.mark.slow
def test_extrapolate_command_writes_a_checkpoint_that_evaluates(tiny_model_dir, tmp_path):
    from rollwise.models import load_model

    _run(tiny_model_dir, tmp_path / "run", **{"train.steps": 3, "run.save_every_steps": 1})
    runner = CliRunner()
    result = runner.invoke(app, ["extrapolate", str(tmp_path / "run"), "--to", "6", "--observe", "3"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "run" / "extrapolated" / "step-6"
    info = json.loads((out / "relex.json").read_text())
    assert info["observed_steps"] == [1, 2, 3] and 0.5 < info["explained_variance_mean"] <= 1.0
    model, _ = load_model(str(out))
    step3 = _weights(tmp_path / "run" / "checkpoints" / "step-3")
    start = _weights(tiny_model_dir)
    got = dict(model.state_dict())
    moved = [k for k in step3 if not torch.equal(start[k], step3[k])]
    # beyond the window each moved tensor lies further from the start than the last observed checkpoint
    assert moved and all(float((got[k] - start[k]).norm()) > float((step3[k] - start[k]).norm()) for k in moved)
    result = runner.invoke(app, ["eval", "--model", str(out), "--n", "4", "--no-greedy"])
    assert result.exit_code == 0 and "accuracy" in result.output, result.output
    result = runner.invoke(app, ["extrapolate", str(tmp_path / "run"), "--to", "6", "--observe", "1"])
    assert result.exit_code != 0 and "at least 2 checkpoints" in result.output
