"""The prepared GPU check (benchmarks/gpu_check.sh) runs here with `--dry`: the same code on the CPU, tiny shapes,
so it is known to work before a GPU is lent; and `train.device` names what this machine has."""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert {name: part["status"] for name, part in summary["parts"].items()} == {
        "recipe": "ok", "trl": "ok", "memory-1.5b": "ok", "fsdp": "ok", "quickstart": "ok"}
    for name, run in summary["runs"].items():
        assert len(run["per_step"]) == 2 and run["checkpoint_logit_max_abs_diff"] == 0.0
        assert sum(s["perf/train_tokens_per_s"] or 0 for s in run["per_step"]) > 0  # it trained
        gaps = [s["mismatch/logprob_abs_diff_mean"] for s in run["per_step"] if s["mismatch/logprob_abs_diff_mean"]]
        assert gaps and max(gaps) < (1e-4 if name.endswith("fp32") else 5e-2)  # bf16 engine vs fp32 trainer
    recipe = summary["recipe"]
    assert "train.micro_batch_tokens=8192" in recipe["overrides"] and recipe["engine"] == "torch"
    assert recipe["engine_options"] == {"fused": False, "gqa_attention": True}  # the GPU's decode path, on the CPU
    assert len(recipe["per_step"]) == 3 and recipe["memory"]["estimate"]["total_gib"] > 0
    # EOS suppressed: every response runs to rollout.max_new_tokens (8 with --dry), in rollwise and in HF generate
    assert [s["rollout/response_len_mean"] for s in recipe["per_step"]] == [8.0, 8.0, 8.0]
    assert all(s["perf/train_tokens_per_s"] > 0 and s["perf/train_mfu_datasheet"] for s in recipe["per_step"])
    hf = recipe["hf_generate"]
    assert hf["rows"] == 4 and hf["new_tokens"] == 8 and hf["tokens_per_s"] > 0 and "within_2x" in hf
    assert len(summary["memory_1.5b"]["per_step"]) == 1
    trl = summary["trl"]
    assert trl["rounds"] == 1 and trl["completion_length_mean"] and set(trl["completion_length_mean"]) == {8.0}
    assert summary["side_by_side"]["trl_round_s"] == trl["round_s"][0]
    fsdp = summary["fsdp2_one_rank"]
    assert fsdp["loss_fsdp"] == pytest.approx(fsdp["loss_local"], abs=1e-6) and fsdp["weights_max_abs_diff"] < 1e-6
    assert (tmp_path / "check" / "check.log").read_text().count("gpu_check: done in") == 1


def test_a_part_past_its_budget_is_skipped_with_a_line_and_keeps_what_it_recorded(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    def too_slow(cmd, timeout):  # the child records its first TRL round, then runs past its budget
        (tmp_path / "part-trl.partial.json").write_text('{"round_s": [12.5]}')
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(gpu_check.subprocess, "run", too_slow)
    result = gpu_check.spawn_part("trl", tmp_path, dry=True, budget_s=7)
    assert result == {"status": "skipped", "why": "over its 7 s budget", "seconds": 7, "partial": {"round_s": [12.5]}}
    assert "gpu_check: trl skipped: over its 7 s budget" in capsys.readouterr().out


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
