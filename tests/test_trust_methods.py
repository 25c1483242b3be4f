"""Trust in the seed methods (issue 29, items 4-6): progress refuses the engine's log-probs at --dry-run; a resumed
EEPO or Tandem run samples what the uninterrupted one does (the strategies' own engines' sampler RNG, and Tandem's
junior = the starting model, are in the checkpoint's reach); EchoRL's metrics count each micro-batch once however
many passes (`train.ppo_epochs`) read it."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.cli import app
from rollwise.generate.torch_engine import TorchEngine
from rollwise.loop import train
from rollwise.methods.echorl import EchoTerms
from rollwise.rollout_strategies.eepo import EEPOStrategy
from rollwise.rollout_strategies.tandem import TandemStrategy
from rollwise.types import Prompt, RewardResult, Sample, Status

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "seed"
TIMING = ("perf/", "_s", "time", "throughput", "per_s", "elapsed")


def always_right(sample: Sample) -> RewardResult:
    """Every response verified correct: every group is all-success (EchoRL's echo groups)."""
    return RewardResult(value=1.0, parts={"correct": 1.0}, correct=True)


def _train(model_dir, run_dir, resume: bool = False, **overrides) -> list[dict]:
    cfg = tiny_config(model_dir, **{"eval.n": 0, "run.report": False, "run.name": None, **overrides})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(cfg, run_dir, resume=resume)
    return [r for r in read_rows(run_dir) if r["kind"] == "train"]


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


# --- item 4: progress refuses train.old_logprobs = "behaviour" ---------------------------------------------------

def test_progress_with_behaviour_logprobs_fails_at_dry_run_with_one_line():
    """The user's path: the seed recipe plus the two keys, `rollwise train ... --dry-run` -> exit 2, one line."""
    args = ["train", str(RECIPES / "progress.toml"), "algo.method=progress", "train.old_logprobs=behaviour",
            "--dry-run"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "algo.method = 'progress'" in lines[0] and "train.old_logprobs = 'behaviour'" in lines[0]
    assert "set train.old_logprobs = 'recompute'" in lines[0]


def test_progress_with_recomputed_logprobs_passes_dry_run(tiny_model_dir):
    result = CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(
        tiny_model_dir, **{"algo.method": "progress", "train.old_logprobs": "recompute"})])
    assert result.exit_code == 0, result.output


def test_progress_refusal_is_on_the_train_path_too(tiny_model_dir, tmp_path):
    """Not only --dry-run: a run started with the pair does not train on the engine's log-probs."""
    from rollwise.errors import UserError

    with pytest.raises((UserError, ValueError), match=r"set train.old_logprobs = 'recompute'"):
        _train(tiny_model_dir, tmp_path / "run", **{"algo.method": "progress", "train.old_logprobs": "behaviour"})


# --- item 6: EchoRL's metrics count each micro-batch once --------------------------------------------------------

def _echo_sample() -> Sample:
    return Sample(prompt=Prompt(uid="p", messages=[]), prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0],
                  loss_mask=[1], status=Status.COMPLETED, group_id=0, correct=True, reward=1.0)


def test_echo_metrics_are_those_of_the_first_pass_by_hand():
    """Two passes over one micro-batch (the second after an update: other log-probs and entropies) and a second
    micro-batch: the metrics are the first passes' over both micro-batches, by hand."""
    a, b, c = _echo_sample(), _echo_sample(), _echo_sample()
    mb1 = SimpleNamespace(samples=[a, b], loss_mask=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    mb2 = SimpleNamespace(samples=[c], loss_mask=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    terms = EchoTerms({id(a), id(c)}, coef=0.5, frac=0.5)  # b is not an echo sample
    token_sum = lambda per_token, m: (per_token * m).sum() / 9
    first = (torch.log(torch.tensor([[0.5, 0.25, 0.8, 0.1], [0.9, 0.9, 0.9, 1.0]])),
             torch.tensor([[2.0, 1.0, 0.1, 3.0], [0.5, 0.5, 0.5, 0.0]]))
    later = (torch.log(torch.tensor([[0.6, 0.5, 0.9, 0.2], [0.9, 0.9, 0.9, 1.0]])),
             torch.tensor([[0.1, 2.0, 2.0, 0.2], [0.5, 0.5, 0.5, 0.0]]))
    other = (torch.log(torch.tensor([[0.4, 0.2, 1.0, 1.0]])), torch.tensor([[1.5, 0.5, 0.0, 0.0]]))
    terms.start()
    for epoch in range(3):  # ppo_epochs = 3: mb1 and mb2 in every epoch, the weights moving in between
        logp, entropy = first if epoch == 0 else later
        loss = terms.extra_loss(logp.clone().requires_grad_(True), None, None, mb1, token_sum, entropy=entropy)
        if epoch == 1:  # every pass still trains its own clip: tokens 0, 3 of row 0 (windows 2.1, 4.0, 2.2)
            assert float(loss.detach()) == pytest.approx(-0.5 * (math.log(0.6) + math.log(0.5)) / 9, rel=1e-6)
        terms.extra_loss(other[0].clone().requires_grad_(True), None, None, mb2, token_sum, entropy=other[1])
    m = terms.metrics()
    # mb1 row 0 (first pass): n = 4, k = 2, windows 3.0, 1.1, 3.1 -> tokens 1, 2 (-ln 0.25 - ln 0.8; entropy 1.1)
    # mb2 row 0: n = 2, k = 1, windows 1.5, 0.5 -> token 1 (-ln 0.2; entropy 0.5)
    assert m["echorl/clip_tokens"] == 3.0
    assert m["echorl/clip_nll_mean"] == pytest.approx(-(math.log(0.25) + math.log(0.8) + math.log(0.2)) / 3)
    assert m["echorl/clip_entropy_mean"] == pytest.approx((1.0 + 0.1 + 0.5) / 3)
    assert m["echorl/echo_entropy_mean"] == pytest.approx((2.0 + 1.0 + 0.1 + 3.0 + 1.5 + 0.5) / 6)
    terms.start()  # the next step starts from nothing
    assert terms.metrics() == {"echorl/clip_tokens": 0.0}


@pytest.mark.slow
def test_echorl_metrics_of_two_passes_equal_those_of_one_on_the_same_batch(tiny_model_dir, tmp_path):
    """One step on the same sampled batch (the same seed): ppo_epochs = 2 reports what ppo_epochs = 1 does."""
    run = {"train.steps": 1, "reward.fn": "test_trust_methods:always_right", "algo.method": "echorl",
           "train.lr": 1e-2}
    one = _train(tiny_model_dir, tmp_path / "one", **run, **{"train.ppo_epochs": 1})[0]
    two = _train(tiny_model_dir, tmp_path / "two", **run, **{"train.ppo_epochs": 2})[0]
    assert two["train/passes/update"] == 2.0 and one["train/passes/update"] == 1.0
    keys = ["echorl/echo_groups", "echorl/echo_samples", "echorl/clip_tokens", "echorl/clip_nll_mean",
            "echorl/clip_entropy_mean", "echorl/echo_entropy_mean"]
    assert one["echorl/clip_tokens"] > 0
    for key in keys:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key


# --- item 5: a resumed EEPO or Tandem run goes on as the uninterrupted one ----------------------------------------

@pytest.fixture(scope="module")
def junior_model_dir(tmp_path_factory):
    """Another random tiny model (other weights, the same tokenizer)."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("junior-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_strategy_state_carries_the_second_engines_sampler_rng(tiny_model_dir):
    """state_dict -> load_state_dict on a fresh strategy puts its own engine's generator where it was."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for make in (lambda e: EEPOStrategy(model, e, 0, 0.0, 0), lambda e: TandemStrategy(e, 2, 0.5, seed=0)):
        engine, fresh = TorchEngine(model, tok, seed=11), TorchEngine(model, tok, seed=11)
        torch.rand(5, generator=engine.generator)  # rounds of sampling moved it on
        state = make(engine).state_dict()
        make(fresh).load_state_dict(state)
        assert torch.equal(fresh.generator.get_state(), engine.generator.get_state())


def test_a_resumed_tandem_junior_is_the_starting_model_again(tiny_model_dir, tmp_path):
    """`rollout.tandem.junior` unset: the junior is the starting model, also when the run resumes from a trained
    policy (the strategy is then built from the checkpoint's weights)."""
    from rollwise.rollout_strategies import StrategyContext
    from rollwise.rollout_strategies.tandem import tandem_strategy
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(tiny_model_dir, **{"rollout.strategy": "tandem"})
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)
    strategy = tandem_strategy(cfg, StrategyContext(tiny_tokenizer(), trained, 0))
    strategy.load_state_dict(TandemStrategy(None, 2, 0.5, seed=0).state_dict())  # what resume does
    junior = strategy.junior.model.state_dict()
    assert all(torch.equal(junior[k], v) for k, v in start.state_dict().items())


def _straight_and_resumed(model_dir, root: Path, settings: dict) -> tuple[Path, Path, list[dict], list[dict]]:
    settings = {"reward.fn": "toy_plugins:digit_fraction", "run.save_every_steps": 2,
                "run.samples_logged_per_step": 16, **settings}
    straight = _train(model_dir, root / "straight", **settings, **{"train.steps": 4})
    _train(model_dir, root / "resumed", **settings, **{"train.steps": 2})
    resumed = _train(model_dir, root / "resumed", resume=True, **settings, **{"train.steps": 4})
    return root / "straight", root / "resumed", straight, resumed


def _assert_same_after_resume(a: Path, b: Path, straight: list[dict], resumed: list[dict], prefix: str) -> None:
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for ra, rb in zip(straight[2:], resumed[2:], strict=True):
        assert any(k.startswith(prefix) for k in ra)
        assert _deterministic(rb) == _deterministic(ra), ra["step"]
    for step in (3, 4):
        name = f"samples/step-{step}.jsonl"
        assert (b / name).read_text() == (a / name).read_text(), name


@pytest.mark.slow
def test_a_resumed_eepo_run_samples_and_logs_what_the_uninterrupted_one_does(tiny_model_dir, tmp_path):
    a, b, straight, resumed = _straight_and_resumed(tiny_model_dir, tmp_path, {
        "rollout.strategy": "eepo", "algo.is_correction": "tis_token", "rollout.eepo.unlearn_steps": 2,
        "rollout.eepo.unlearn_lr": 1e-2})
    _assert_same_after_resume(a, b, straight, resumed, "eepo/")


@pytest.mark.slow
@pytest.mark.parametrize("junior", ["model", "initial"])
def test_a_resumed_tandem_run_samples_and_logs_what_the_uninterrupted_one_does(junior, tiny_model_dir,
                                                                               junior_model_dir, tmp_path):
    """With a junior model (its engine's sampler RNG) and without (the junior is the starting model, not the
    checkpoint's policy)."""
    settings = {"rollout.strategy": "tandem", "rollout.tandem.segment_tokens": 2, "rollout.tandem.junior_prob": 0.5}
    if junior == "model":
        settings["rollout.tandem.junior"] = str(junior_model_dir)
    a, b, straight, resumed = _straight_and_resumed(tiny_model_dir, tmp_path, settings)
    _assert_same_after_resume(a, b, straight, resumed, "tandem/")
