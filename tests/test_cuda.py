"""The CUDA path (`train.device = "cuda"`): skipped without a GPU; `benchmarks/gpu_check.sh` runs it on one.

What a CPU machine checks instead: tests/test_device_discipline.py (no tensor without a device), and
tests/test_gpu_check.py (the GPU check's own code, `--dry`, on the CPU).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import read_rows, tiny_config
from rollwise.build import open_run
from rollwise.loop import rl_step, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SETTINGS = {"reward.fn": "toy_plugins:even_id_fraction", "eval.n": 8, "train.steps": 2, "train.device": "cuda",
            "run.save_every_steps": 2, "model.dtype": "float32", "train.precision": "fp32"}


def test_a_run_on_cuda_keeps_engine_and_trainer_together_and_agreeing(tmp_path, tiny_model_dir):
    """Policy, engine and batches on the GPU; the engine's log-probs equal the trainer's (fp32, like with like);
    the sync probe agrees; the GPU memory figures are reported; the checkpoint loads on the CPU."""
    with contextlib.redirect_stdout(io.StringIO()):
        train(tiny_config(tiny_model_dir, **SETTINGS), tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/tokens"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_mean"] < 1e-4 for r in rows)
    assert all(r["sync/logprob_max_abs_diff"] < 1e-3 for r in rows)
    assert all(r["perf/cuda_peak_allocated_gb"] > 0 for r in rows)
    assert all(r["perf/peak_gflops_train"] and r["perf/train_mfu"] is not None and r["perf/train_mfu"] <= 1
               for r in rows)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-2")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_autocast_on_cuda_trains_with_fp32_master_weights(tmp_path, tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, **{**SETTINGS, "train.precision": "auto", "model.dtype": "auto"})
    run = open_run(cfg, tmp_path / "run")
    try:
        assert run.trainer.bf16 and run.engine.dtype == torch.bfloat16  # auto = bf16 on CUDA
        assert all(p.dtype == torch.float32 and p.is_cuda for p in run.model.parameters())
        with contextlib.redirect_stdout(io.StringIO()):
            row, _ = rl_step(run)
        assert row["train/tokens"] > 0 and row["mismatch/logprob_abs_diff_mean"] < 0.1
    finally:
        run.close()
