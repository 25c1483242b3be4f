"""FSDP2 trainer (train.backend = "fsdp2"): 2 real gloo ranks against the local trainer, checkpoints, failures.

One 2-rank trainer (rank 0 here, rank 1 a spawned process) runs 3 steps next to a local `Trainer` on the same
batches; their metrics and weights must agree. It then checkpoints (HF model + sharded optimizer state), steps
once more and closes; a second 2-rank trainer resumes from the checkpoint and must give the same step. A rank
killed with SIGKILL, and one that cannot load its model, must each end in one clear error at rank 0 and leave
no process behind.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_config
from rollwise.models import load_model
from rollwise.train.batching import split_by_tokens
from rollwise.train.checkpoint import is_complete, save_checkpoint
from rollwise.train.fsdp import SHARDS_DIR, FSDPTrainer
from rollwise.train.launch import build_trainer
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

pytestmark = pytest.mark.slow

MICRO_BATCH_TOKENS = 96
BATCH_SIZES = (4, 12, 20, 12)  # micro-batches per step: 1 (fewer than the ranks), 3, 3 (odd), ...
OVERRIDES = {"train.backend": "fsdp2", "train.world_size": 2, "train.micro_batch_tokens": MICRO_BATCH_TOKENS,
             "train.ppo_epochs": 2,  # recomputed old log-probs: a no-grad pass before the updates
             "algo.kl_coef": 0.05,  # reference log-probs in the loss
             "train.lr": 1e-3, "model.threads": 1}


def make_samples(n: int, seed: int, vocab: int) -> list[Sample]:
    """`n` samples in groups of 4: random prompts (3-8 tokens) and responses (2-10), advantages in [-1, 1]."""
    rng = random.Random(seed)
    out = []
    for g in range(n // 4):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        for _ in range(4):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 10))]
            behaviour = [-3.0 + 0.01 * i for i in range(len(resp))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, behaviour, [1] * len(resp), Status.COMPLETED, g,
                              advantage=rng.uniform(-1.0, 1.0)))
    return out


def batches(vocab: int) -> list[list[Sample]]:
    return [make_samples(n, seed, vocab) for seed, n in enumerate(BATCH_SIZES)]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def children() -> list[psutil.Process]:
    """Live child processes, less multiprocessing's resource tracker (one per parent; exits with it)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(proc.cmdline()):
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_no_children(timeout_s: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return tiny_config(tiny_model_dir, **OVERRIDES)


@pytest.fixture(scope="module")
def two_runs(cfg, tiny_model_dir, tmp_path_factory):
    """Steps 1-3 on FSDP2 (2 ranks) and on the local trainer; a checkpoint; step 4 on FSDP2; close."""
    torch.set_num_threads(1)
    model, tokenizer = load_model(str(tiny_model_dir))
    ref_model, _ = load_model(str(tiny_model_dir))
    ref_model.eval().requires_grad_(False)
    start = weights(model)
    local = Trainer(copy.deepcopy(model), cfg.train, cfg.algo, tokenizer.pad_token_id, ref_model=ref_model,
                    temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    started = time.perf_counter()
    fsdp = build_trainer(cfg, model, tokenizer.pad_token_id, ref_model, str(tiny_model_dir))
    out = {"start_s": time.perf_counter() - started, "start": start, "fsdp": [], "local": [], "time": []}
    try:
        assert isinstance(fsdp, FSDPTrainer) and fsdp.world_size == 2
        data = batches(len(tokenizer))
        out["plans"] = [len(split_by_tokens(b, MICRO_BATCH_TOKENS)) for b in data]
        for version, batch in enumerate(data[:3]):
            t0 = time.perf_counter()
            out["fsdp"].append(fsdp.step(copy.deepcopy(batch), version=version))
            t1 = time.perf_counter()
            out["local"].append(local.step(copy.deepcopy(batch), version=version))
            out["time"].append((t1 - t0, time.perf_counter() - t1))
        out["fsdp_weights"] = fsdp.policy_state()
        out["local_weights"] = weights(local.model)
        run_dir = tmp_path_factory.mktemp("fsdp-ckpt")
        state = {"step": 3, **fsdp.state_dict()}  # what the session saves of the backend
        out["ckpt"] = save_checkpoint(run_dir, 3, model, tokenizer, state, state_dict=fsdp.checkpoint_weights(),
                                      write_extra=fsdp.write_checkpoint)
        out["state"] = state
        out["step4"] = fsdp.step(copy.deepcopy(data[3]), version=3)
        out["step4_weights"] = fsdp.policy_state()
    finally:
        fsdp.close()
    out["left_after_close"] = wait_no_children()
    out["data"], out["tokenizer"] = data, tokenizer
    return out


def test_three_steps_equal_the_local_trainer(two_runs):
    # the batches do split unevenly: 1 micro-batch (rank 1 runs stand-ins only) and odd counts
    assert two_runs["plans"][0] == 1 and any(n % 2 == 1 and n > 1 for n in two_runs["plans"][:3])
    for step, (a, b) in enumerate(zip(two_runs["fsdp"], two_runs["local"]), start=1):
        assert a.keys() == b.keys(), step
        for key in a:  # every train/* and mismatch/* figure, grad norm (the global one) included
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key, a[key], b[key])
    assert max_diff(two_runs["fsdp_weights"], two_runs["local_weights"]) < 1e-4
    assert max_diff(two_runs["fsdp_weights"], two_runs["start"]) > 1e-3  # the weights did move
    assert two_runs["left_after_close"] == []


def test_checkpoint_holds_an_hf_model_and_the_shards(two_runs):
    ckpt = two_runs["ckpt"]
    assert is_complete(ckpt)
    shards = sorted(p.name for p in (ckpt / SHARDS_DIR).iterdir())
    assert ".metadata" in shards and sum(name.endswith(".distcp") for name in shards) == 2  # one per rank
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert max_diff(reloaded, two_runs["fsdp_weights"]) == 0.0


@pytest.fixture(scope="module")
def resumed(cfg, two_runs):
    """A second 2-rank trainer from the checkpoint: shards loaded, step 4; then rank 1 is killed."""
    ckpt, tokenizer = two_runs["ckpt"], two_runs["tokenizer"]
    model, _ = load_model(str(ckpt))
    ref_model, _ = load_model(cfg.model.name)
    ref_model.eval().requires_grad_(False)
    trainer = build_trainer(cfg, model, tokenizer.pad_token_id, ref_model, str(ckpt))
    out = {}
    try:
        trainer.load_state_dict(two_runs["state"], ckpt)
        assert trainer.version == 3
        out["step4"] = trainer.step(copy.deepcopy(two_runs["data"][3]), version=3)
        out["step4_weights"] = trainer.policy_state()
        out["other_world"] = pytest.raises(ValueError, trainer.load_state_dict,
                                           {"step": 3, "fsdp": {"world_size": 4}}, ckpt)
        worker = trainer.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(RuntimeError) as failure:
            trainer.step(copy.deepcopy(two_runs["data"][0]), version=4)
        out["failure"] = str(failure.value)
    finally:
        trainer.close()
    out["left"] = wait_no_children()
    return out


def test_resumed_trainer_repeats_the_step_exactly(two_runs, resumed):
    assert resumed["step4"] == two_runs["step4"]
    assert max_diff(resumed["step4_weights"], two_runs["step4_weights"]) == 0.0


def test_resume_on_another_world_size_or_backend_is_one_clear_error(two_runs, resumed):
    assert "sharded over 4 ranks, this run has 2; resume with train.world_size = 4" in str(resumed["other_world"].value)
    from helpers_model import tiny_llama
    from rollwise.config import AlgoConfig, TrainConfig

    local = Trainer(tiny_llama(64), TrainConfig(), AlgoConfig(), pad_id=0)  # the local backend
    with pytest.raises(ValueError, match="train.backend = 'fsdp2' and train.world_size = 2"):
        local.load_state_dict(two_runs["state"], two_runs["ckpt"])


def test_killed_rank_is_named_at_rank_0_and_nothing_is_left(resumed):
    assert resumed["failure"].startswith("trainer rank 1 (pid ")
    assert "SIGKILL" in resumed["failure"]
    assert resumed["left"] == []


def test_rank_that_cannot_load_its_model_reports_its_error(cfg, tiny_model_dir, tmp_path):
    model, tokenizer = load_model(str(tiny_model_dir))
    missing = tmp_path / "no-model-here"
    with pytest.raises(RuntimeError) as failure:
        build_trainer(cfg, model, tokenizer.pad_token_id, None, str(missing))
    assert str(failure.value).startswith("trainer rank 1 failed: ")
    assert "no-model-here" in str(failure.value)
    assert wait_no_children() == []
    assert not torch.distributed.is_initialized()


def test_resume_through_the_session_equals_a_straight_run(tiny_model_dir, tmp_path):
    """As tests/test_resume.py for train.backend = "fsdp2": 2 steps + resume to 4 == 4 straight steps, exactly."""
    import contextlib
    import io

    from rollwise.loop import train

    base = {**OVERRIDES, "reward.fn": "toy_plugins:digit_fraction", "run.save_every_steps": 2, "run.report": False,
            "eval.n": 4}
    with contextlib.redirect_stdout(io.StringIO()):
        train(tiny_config(tiny_model_dir, **base, **{"train.steps": 4}), tmp_path / "A")
        train(tiny_config(tiny_model_dir, **base, **{"train.steps": 2}), tmp_path / "B")
        train(tiny_config(tiny_model_dir, **base, **{"train.steps": 4}), tmp_path / "B", resume=True)
    for step in (2, 4):
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "A" / "checkpoints" / f"step-{step}").state_dict()
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "B" / "checkpoints" / f"step-{step}").state_dict()
        assert max_diff(a, b) == 0.0, step
    assert (tmp_path / "A" / "samples" / "step-4.jsonl").read_text() == \
        (tmp_path / "B" / "samples" / "step-4.jsonl").read_text()
    assert wait_no_children() == []
