"""The prepared GPU check (benchmarks/gpu_check.sh) runs here with `--dry`: the same code on the CPU, tiny shapes,
so it is known to work before a GPU is lent; and `train.device` names what this machine has."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import subprocess_env
from rollwise.cli import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    env = {**subprocess_env(), "OUT": str(tmp_path / "check")}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "check" / "summary.json").read_text())
    assert summary["dry"] and set(summary["runs"]) == {"tiny-fp32", "tiny-bf16"}
    for name, run in summary["runs"].items():
        assert len(run["per_step"]) == 2 and run["checkpoint_logit_max_abs_diff"] == 0.0
        assert sum(s["perf/train_tokens_per_s"] or 0 for s in run["per_step"]) > 0  # it trained
        gaps = [s["mismatch/logprob_abs_diff_mean"] for s in run["per_step"] if s["mismatch/logprob_abs_diff_mean"]]
        assert gaps and max(gaps) < (1e-4 if name.endswith("fp32") else 5e-2)  # bf16 engine vs fp32 trainer
    fsdp = summary["fsdp2_one_rank"]
    assert fsdp["loss_fsdp"] == pytest.approx(fsdp["loss_local"], abs=1e-6) and fsdp["weights_max_abs_diff"] < 1e-6
    assert (tmp_path / "check" / "check.log").read_text().count("gpu_check: done in") == 1


def test_train_device_names_what_this_machine_has(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    bad = CliRunner().invoke(app, ["train", "--dry-run", "train.device=cuda"])
    assert bad.exit_code == 2 and "train.device = 'cuda', but this machine has 0 CUDA device(s) visible" in bad.output
    typo = CliRunner().invoke(app, ["train", "--dry-run", "train.device=gpu"])
    assert typo.exit_code == 2 and "train.device" in typo.output
    ok = CliRunner().invoke(app, ["train", "--dry-run", "train.device=cpu"])
    assert ok.exit_code == 0 and 'device = "cpu"' in ok.output
