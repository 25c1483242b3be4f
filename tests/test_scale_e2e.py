"""The scale-out paths through the real loop (`rollwise.loop.train`, the CLI): LoRA runs, the Sync stage's
check, FSDP2 under torchrun, and the vLLM engine on a tiny model vLLM accepts (head_dim 64)."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_rows, subprocess_env, tiny_config, tiny_overrides
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate.torch_engine import TorchEngine
from rollwise.loop import train
from rollwise.sync import SyncError


def quiet_train(cfg, run_dir: Path, resume: bool = False) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir, resume=resume)


LORA = {"lora.rank": 4, "lora.alpha": 8.0, "train.lr": 1e-2, "eval.n": 0, "run.report": False,
        "reward.fn": "toy_plugins:digit_fraction",
        "run.samples_logged_per_step": 0}


@pytest.mark.slow
def test_lora_run_checkpoints_the_adapter_and_resumes_identically(tmp_path, tiny_model_dir):
    """3 LoRA steps in one go equal 2 steps + a resumed third: the same adapter weights, bit for bit. The
    checkpoint holds the adapter (no full model at its root), the base is never trained, and every sync's probe
    agrees with the trainer (fp32 torch engine with merged weights)."""
    pytest.importorskip("peft")
    whole, split = tmp_path / "whole", tmp_path / "split"
    quiet_train(tiny_config(tiny_model_dir, **LORA, **{"train.steps": 3}), whole)
    quiet_train(tiny_config(tiny_model_dir, **LORA, **{"train.steps": 2, "run.save_every_steps": 2}), split)
    quiet_train(tiny_config(tiny_model_dir, **LORA, **{"train.steps": 3}), split, resume=True)
    ckpt = whole / "checkpoints" / "step-3"
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "config.json").exists()
    a = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    b = load_file(split / "checkpoints" / "step-3" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(float(t.abs().max()) > 0 for k, t in a.items() if "lora_B" in k)  # the adapters did train
    rows = [r for r in read_rows(whole) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in rows)
    # `rollwise eval` on the LoRA run: the base of model.name with the checkpoint's adapter merged in
    from peft import PeftModel

    from rollwise.evaluate_cli import load_policy, run_eval_command
    from rollwise.models import load_model

    merged, _ = load_policy(str(ckpt), str(tiny_model_dir))
    peft_model = PeftModel.from_pretrained(load_model(str(tiny_model_dir))[0], str(ckpt / "adapter"))
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=0)
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_eval_command(str(whole), None, 8, 0.7, None, [])["n"] == 8


@pytest.mark.slow
def test_a_sync_that_leaves_the_engine_stale_stops_the_run(tmp_path, tiny_model_dir, monkeypatch):
    """An engine that keeps its old weights after a sync (the silent failure of a broken transport) is caught
    by the probe after the first update: SyncError names the version and the gap; no row claims step 1."""
    def keep_old_weights(self, state_dict, version):
        self.version = version  # claims the new version, samples from the old weights

    monkeypatch.setattr(TorchEngine, "update_weights", keep_old_weights)
    cfg = tiny_config(tiny_model_dir, **{"train.lr": 5e-2, "eval.n": 0, "train.steps": 2,
                                         "reward.fn": "toy_plugins:digit_fraction"})
    with pytest.raises(SyncError, match=r"weight sync to version 1: .* differ from the trainer's by up to"):
        quiet_train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not [
        r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]


@pytest.mark.slow
def test_fsdp2_under_torchrun_trains_two_steps(tmp_path, tiny_model_dir):
    """`torchrun --nproc-per-node 2 -m rollwise.cli train train.backend=fsdp2 train.world_size=2`: rank 0 runs
    the loop, rank 1 serves as a trainer worker; both exit 0 and the run has its 2 steps and checkpoint shards."""
    torchrun = Path(sys.executable).with_name("torchrun")
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, **{"train.backend": "fsdp2", "train.world_size": 2, "eval.n": 0,
                                                  "run.report": False, "reward.fn": "toy_plugins:digit_fraction",
                                                  "model.dtype": "float32", "train.precision": "fp32"})
    with socket.socket() as sock:  # torchrun hands `--master-port 0` to its ranks as is: give it a real one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "rollwise.cli", "train", "--run-dir", str(run_dir), *overrides]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_rows(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in rows), [r["sync/logprob_max_abs_diff"] for r in rows]
    assert sum(r["train/tokens"] or 0 for r in rows) > 0
    shards = run_dir / "checkpoints" / "step-2" / "trainer_shards"
    assert len(list(shards.glob("*.distcp"))) == 2


@pytest.fixture(scope="module")
def hd64_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with attention head_dim 64 (vLLM on CPU rejects 16) and the tiny tokenizer."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-hd64")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


VLLM_TEST_OPTIONS = {"rollout.engine_options": {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}}


@pytest.mark.slow
def test_vllm_engine_runs_the_loop_with_partial_rollouts(tmp_path, hd64_model_dir):
    """2 GRPO steps with rollout.engine = 'vllm' (vllm.LLM with its engine core in this process, weights synced
    from tensors, no folder) and partial rollouts: every sync's probe and every trained token agree with the
    trainer (fp32)."""
    pytest.importorskip("vllm")
    cfg = tiny_config(hd64_model_dir, **VLLM_TEST_OPTIONS, **{
        "rollout.engine": "vllm", "control.partial_rollouts": True, "algo.is_correction": "tis_token",
        "rollout.max_new_tokens": 12, "eval.n": 8, "run.report": False})
    summary = quiet_train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert summary["steps"] == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-3 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_mean"] < 1e-3 for r in rows if r["mismatch/logprob_abs_diff_mean"])
    assert [p.name for p in (tmp_path / "run" / "sync").iterdir()] == ["initial"]  # the start's folder only


RAY_FSDP = {"cluster.ray": True, "cluster.engine_workers": 1, "train.backend": "fsdp2", "train.world_size": 2,
            "eval.n": 8, "run.report": False, "reward.fn": "toy_plugins:digit_fraction",
            "model.dtype": "float32", "train.precision": "fp32"}


def _name(proc) -> str:
    try:
        return proc.name()
    except Exception:
        return "?"


@pytest.mark.slow
def test_ray_cluster_runs_two_steps_with_engine_and_trainer_actors(tmp_path, tiny_model_dir):
    """cluster.ray: the torch engine in a Ray actor, trainer rank 1 in another, rank 0 in the driver; 2 steps
    train, every sync reaches the engine actor (probe gap ~0 in fp32), and close() leaves no Ray process."""
    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = quiet_train(tiny_config(tiny_model_dir, **RAY_FSDP), tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert summary["steps"] == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in rows)
    assert sum(r["train/tokens"] or 0 for r in rows) > 0
    assert len(list((tmp_path / "run" / "checkpoints" / "step-2" / "trainer_shards").glob("*.distcp"))) == 2
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and p.status() != psutil.STATUS_ZOMBIE]
    _, alive = psutil.wait_procs(left, timeout=15)
    assert not alive, [(p.pid, _name(p)) for p in alive]


@pytest.mark.slow
def test_ctrl_c_on_a_ray_run_saves_and_leaves_no_process(tmp_path, tiny_model_dir):
    """`rollwise train cluster.ray=true ...` sent SIGINT during training: exit 130 with a checkpoint, and no
    gcs_server, raylet or actor process survives the driver."""
    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    import os
    import signal
    import time

    from conftest import ROLLWISE

    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, **{**RAY_FSDP, "eval.n": 0, "train.steps": 200})
    proc = subprocess.Popen([ROLLWISE, "train", "--run-dir", str(run_dir), *overrides], env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {_name(p) for p in started}
        assert {"gcs_server", "raylet"} <= names, names
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert (run_dir / "checkpoints" / "latest").exists()
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, [(p.pid, _name(p)) for p in alive]


@pytest.mark.slow
def test_lora_on_vllm_syncs_adapters_not_weights(tmp_path, hd64_model_dir):
    """lora.rank with rollout.engine = 'vllm': each sync hands vLLM the adapter alone (a new LoRARequest per
    version, `sync/adapter-v<N>`); its log-probs agree with the trainer's PEFT model (fp32 probe)."""
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    cfg = tiny_config(hd64_model_dir, **VLLM_TEST_OPTIONS, **{
        "rollout.engine": "vllm", "lora.rank": 4, "lora.alpha": 8.0, "train.lr": 1e-2, "eval.n": 0,
        "run.report": False, "reward.fn": "toy_plugins:digit_fraction"})
    quiet_train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-3 for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "sync").glob("adapter-v*")) == ["adapter-v1", "adapter-v2"]
    assert not list((tmp_path / "run" / "sync").glob("v[0-9]*"))  # no full-weight folder was written


@pytest.mark.slow
def test_vllm_server_launched_by_the_run_trains_and_stops(tmp_path, hd64_model_dir):
    """rollout.server = 'launch': vLLM's OpenAI server in its own process, weights synced through folders and
    the worker extension; 2 steps train, every probe agrees, and the server is gone after the run."""
    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = tiny_config(hd64_model_dir, **VLLM_TEST_OPTIONS, **{
        "rollout.engine": "vllm", "rollout.server": "launch", "eval.n": 0, "run.report": False,
        "reward.fn": "toy_plugins:digit_fraction"})
    quiet_train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2] and sum(r["train/tokens"] or 0 for r in rows) > 0
    assert all(r["sync/logprob_max_abs_diff"] < 1e-3 for r in rows)
    assert (tmp_path / "run" / "vllm_server.log").is_file()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and p.status() != psutil.STATUS_ZOMBIE]
    _, alive = psutil.wait_procs(left, timeout=15)
    assert not alive, [(p.pid, _name(p)) for p in alive]


# every kind of route of the launched server: OpenAI (/v1, guarded by vLLM's own key check too), the dev routes a
# sync uses (guarded only by rollwise's RequireKey middleware), and the other unprefixed ones
UNGUARDED_BY_VLLM = [("POST", "/collective_rpc", {"method": "rollwise_version"}), ("POST", "/pause", None),
                     ("POST", "/resume", None), ("POST", "/reset_prefix_cache", None), ("POST", "/sleep", None),
                     ("GET", "/server_info", None), ("GET", "/is_paused", None), ("GET", "/health", None),
                     ("POST", "/tokenize", {"model": "rollwise", "prompt": "hi"}), ("GET", "/metrics", None)]
GUARDED_BY_VLLM = [("POST", "/v1/completions", {"model": "rollwise", "prompt": [5, 6], "max_tokens": 2}),
                   ("GET", "/v1/models", None)]


@pytest.mark.slow
def test_the_launched_vllm_server_refuses_every_route_without_its_key(tmp_path, hd64_model_dir):
    """rollout.server = 'launch' through `build_engine`: the server answers 401 on every route to a caller
    without its key (a wrong one, or one without `Bearer`); rollwise's engine samples and syncs with it; the
    key is in neither the server's command line nor its log."""
    pytest.importorskip("vllm")
    import httpx
    import psutil

    from rollwise.generate.factory import build_engine
    from rollwise.models import load_model

    cfg = tiny_config(hd64_model_dir, **VLLM_TEST_OPTIONS, **{"rollout.engine": "vllm", "rollout.server": "launch"})
    model, tok = load_model(str(hd64_model_dir), dtype=torch.float32)
    engine = build_engine(cfg, model, tok, tmp_path)
    key = engine.server.api_key
    try:
        assert len(key) >= 32
        for method, path, body in UNGUARDED_BY_VLLM + GUARDED_BY_VLLM:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = httpx.request(method, engine.base_url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
        r = httpx.get(engine.base_url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200
        from rollwise.types import GenerationRequest, SamplingParams

        (res,) = engine.generate([GenerationRequest(0, [5, 6, 7], SamplingParams(max_new_tokens=4))])
        assert 1 <= len(res.response_ids) <= 4
        engine.update_weights({n: p.detach() for n, p in model.named_parameters()}, 1)
        assert engine.server_versions() == [1] and engine.version == 1
        family = [psutil.Process(engine.server.process.pid)]
        family += family[0].children(recursive=True)
        assert all(key not in " ".join(p.cmdline()) for p in family)
        assert key not in repr(engine.server)
    finally:
        engine.close()
    assert key not in (tmp_path / "vllm_server.log").read_text(errors="replace")
