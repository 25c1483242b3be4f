"""MIPU (`algo.method = "mipu"`): the inference-side proxy by hand, accept / reject / restore on a stub trainer,
real tiny runs (a ruinous learning rate rejected with the weights bit-identical, a normal one accepted), the
errors at --dry-run, and recipes/seed/mipu.toml (dry-run and two steps on the tiny model)."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from rollwise.cli import app
from rollwise.config import Config
from rollwise.generate.base import EngineCaps
from rollwise.loop import train
from rollwise.methods import METHODS, MethodSetup, Stage, StepInput
from rollwise.methods.mipu import MIPURejectError, inference_proxy
from rollwise.train.checkpoint import latest_checkpoint
from rollwise.validate import load

SEED = Path(__file__).resolve().parents[1] / "recipes" / "seed"
BASE = {"algo.method": "mipu", "train.old_logprobs": "behaviour", "reward.fn": "toy_plugins:digit_fraction",
        "eval.n": 0, "run.report": False}


# --- the proxy, by hand ----------------------------------------------------------------------------------------

def test_the_proxy_by_hand():
    old = torch.log(torch.tensor([0.5, 0.25, 0.5]))
    new = torch.log(torch.tensor([1.0, 0.25, 0.25]))  # r = 2, 1, 0.5
    adv = torch.tensor([1.0, 1.0, -2.0])
    out = inference_proxy(new, old, adv, kl_coef=0.5)
    # mean(r A) = (2 + 1 - 1) / 3 = 2/3; mean(A) = 0: gain = 2/3
    assert out["gain"] == pytest.approx(2 / 3)
    # k3 = r - 1 - log r: (1 - ln 2) + 0 + (-0.5 + ln 2), mean = 0.5 / 3
    assert out["kl"] == pytest.approx(0.5 / 3)
    assert out["proxy"] == pytest.approx(2 / 3 - 0.5 * 0.5 / 3)
    # the same policy on both sides: no gain, no gap
    same = inference_proxy(old, old, adv, kl_coef=1.0)
    assert same == {"gain": 0.0, "kl": 0.0, "proxy": 0.0}
    assert inference_proxy(torch.zeros(0), torch.zeros(0), torch.zeros(0), 1.0)["proxy"] == 0.0


def test_a_ruined_policy_looks_like_a_gain_to_the_bare_surrogate_but_not_to_the_proxy():
    """r ~ 0 everywhere: gain = -mean(A) > 0 when the tokens of negative advantage are many; the KL term rejects."""
    old = torch.log(torch.full((4,), 0.5))
    new = torch.full((4,), -30.0)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    out = inference_proxy(new, old, adv, kl_coef=1.0)
    assert out["gain"] == pytest.approx(0.5, abs=1e-9)
    assert out["proxy"] < -20


# --- accept / reject / restore on a stub trainer and engine ------------------------------------------------------

class StubEngine:
    caps = EngineCaps(probe_logprobs=True)

    def __init__(self, model):
        self.model = model

    def probe_logprobs(self, token_ids):  # log-prob of every next token: the one weight, as a log-prob
        return [float(torch.nn.functional.logsigmoid(self.model.weight.detach()[0, 0]))] * (len(token_ids) - 1)


def _stub(tolerance=0.0, kl_coef=0.0, max_rejects=0):
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)  # logsigmoid(0) = log 0.5: the sampler's log-prob below
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.0, 0.999))  # each step follows its gradient
    trainer = SimpleNamespace(optimizer=optimizer, version=0, model=model)
    pushed = []
    sync = SimpleNamespace(engine=StubEngine(model), push=lambda v: pushed.append(v))
    cfg = Config.model_validate({"algo": {"method": "mipu", "mipu": {
        "tolerance": tolerance, "kl_coef": kl_coef, "max_rejects_in_row": max_rejects}}})
    method = METHODS.get("mipu")(MethodSetup(cfg, trainer=trainer, sync=sync))
    sample = SimpleNamespace(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], advantage=1.0,
                             full_logprobs=[], behaviour_logprobs=[math.log(0.5)] * 2)
    return method, trainer, model, sample, pushed


def _step(method, trainer, model, sample, direction: float):
    sample.behaviour_logprobs = [float(torch.nn.functional.logsigmoid(model.weight.detach()[0, 0]))] * 2  # on-policy
    prepared = method.prepare(StepInput(trainer.version, Stage("mipu", 0, 9, 0, 1), [], [sample]))
    loss = -direction * model.weight.sum()  # one AdamW step moves the weight by ~ direction x lr
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    trainer.version += 1
    method.after_update(model)
    return prepared.metrics


def test_an_update_that_lowers_the_engine_s_probability_of_positive_tokens_is_rejected_and_undone():
    method, trainer, model, sample, pushed = _stub()
    good = _step(method, trainer, model, sample, +1.0)  # weight up: p > 0.5 on tokens of advantage 1
    assert good["mipu/accepted"] == 1.0 and good["mipu/gain"] > 0 and pushed == [1]
    weight = model.weight.detach().clone()
    state = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    bad = _step(method, trainer, model, sample, -1.0)
    assert bad["mipu/accepted"] == 0.0 and bad["mipu/proxy"] < 0 and bad["mipu/rejected_steps"] == 1.0
    assert torch.equal(model.weight, weight)  # bit for bit
    restored = trainer.optimizer.state_dict()["state"][0]
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    assert bad["mipu/tokens"] == 2.0 and pushed == [1, 2]
    assert method.state_dict() == {"accepted": 1, "rejected": 1, "rejects_in_row": 1}


def test_the_tolerance_admits_a_small_loss_and_repeated_rejections_stop_the_run():
    method, trainer, model, sample, _ = _stub(tolerance=10.0)
    assert _step(method, trainer, model, sample, -1.0)["mipu/accepted"] == 1.0
    method, trainer, model, sample, _ = _stub(max_rejects=2)
    _step(method, trainer, model, sample, -1.0)
    with pytest.raises(MIPURejectError, match="algo.mipu.max_rejects_in_row = 2"):
        _step(method, trainer, model, sample, -1.0)


# --- real tiny runs ----------------------------------------------------------------------------------------------

def _run(model_dir, run_dir, **overrides) -> list[dict]:
    cfg = tiny_config(model_dir, **{**BASE, **overrides})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, run_dir)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(Path(folder).glob("*.safetensors"))))


@pytest.mark.slow
def test_a_ruinous_update_is_rejected_and_the_weights_stay_bit_identical(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path / "bad", **{"train.lr": 1.0, "algo.mipu.max_rejects_in_row": 0})
    assert [r["mipu/accepted"] for r in rows] == [0.0, 0.0]
    assert rows[-1]["mipu/rejected_steps"] == 2.0 and all(r["mipu/proxy"] < -1e-3 for r in rows)
    assert all(r["mipu/tokens"] > 0 and r["train/grad_norm"] > 0 for r in rows)  # an update was made, then undone
    start, end = _weights(tiny_model_dir), _weights(latest_checkpoint(tmp_path / "bad"))
    assert start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
def test_a_candidate_that_fails_its_sync_check_on_an_int8_engine_is_rejected_not_fatal(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path / "int8", **{"train.lr": 1.0, "algo.mipu.max_rejects_in_row": 0,
                                                        "rollout.engine_options": {"weight_quant": "int8"}})
    assert [r["mipu/accepted"] for r in rows] == [0.0, 0.0]
    assert any(r["mipu/sync_rejected"] == 1.0 and "mipu/proxy" not in r for r in rows)
    start, end = _weights(tiny_model_dir), _weights(latest_checkpoint(tmp_path / "int8"))
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
def test_a_normal_update_is_accepted_and_trained(tiny_model_dir, tmp_path):
    rows = _run(tiny_model_dir, tmp_path / "ok", **{"train.lr": 1e-5})
    assert [r["mipu/accepted"] for r in rows] == [1.0, 1.0]
    assert rows[-1]["mipu/rejected_steps"] == 0.0 and all(r["mipu/proxy"] >= -1e-3 for r in rows)
    start, end = _weights(tiny_model_dir), _weights(latest_checkpoint(tmp_path / "ok"))
    assert any(not torch.equal(start[k], end[k]) for k in start)


# --- the errors, at --dry-run ------------------------------------------------------------------------------------

def _dry_run(model_dir, **overrides):
    return CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(model_dir, **overrides)])


def test_the_name_resolves_at_dry_run(tiny_model_dir):
    result = _dry_run(tiny_model_dir, **BASE)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("overrides, message", [
    ({"train.old_logprobs": "recompute"}, "set train.old_logprobs = 'behaviour'"),
    ({"rollout.temperature": 0.8}, "set rollout.temperature = 1.0 (it is 0.8)"),
    ({"control.mode": "async", "control.max_staleness": 0}, "set control.mode = 'sync'"),
    ({"algo.mipu.tolerance": -1.0}, "algo.mipu.tolerance"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(tiny_model_dir, overrides, message):
    result = _dry_run(tiny_model_dir, **{**BASE, **overrides})
    assert result.exit_code == 2, result.output
    assert message in result.output


# --- the recipe --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_recipe_dry_runs_and_runs_two_steps_on_the_tiny_model(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(app, ["train", str(SEED / "mipu.toml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 4, "run.report": False, "run.name": None}
    cfg = load(SEED / "mipu.toml", tiny_overrides(tiny_model_dir, **overrides))
    assert cfg.rollout.engine_options == {"weight_quant": "int8"} and cfg.train.precision == "fp32"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, tmp_path / "mipu")
    rows = [r for r in read_rows(tmp_path / "mipu") if r["kind"] == "train"]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["mipu/proxy"]) and row["mipu/tokens"] > 0 and row["mipu/accepted"] in (0.0, 1.0)
