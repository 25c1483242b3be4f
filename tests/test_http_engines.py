"""Server engines over HTTP.

- SGLang client against tests/fake_sglang_server.py: a real HTTP server subprocess speaking SGLang's native
  protocol from a tiny torch model (SGLang itself needs CUDA; the real server is checked only on a GPU machine).
- OpenAI client against a real vLLM OpenAI server launched with `launch_vllm_server` (skipped without vllm).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate.http_engine import ServerEngineError
from rollwise.generate.sglang_engine import SGLangEngine
from rollwise.generate.torch_engine import TorchEngine
from rollwise.generate.vllm_server import free_port
from rollwise.types import GenerationRequest, SamplingParams, Status

TESTS_DIR = Path(__file__).resolve().parent
PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 8, 9], [300, 301, 302, 303]]


def model_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of each response token given everything before it (T = 0: untempered)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def save_model(path: Path, seed: int = 0, **overrides):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **overrides)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def no_process_left(pids: list[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# ================================================================================================ SGLang
@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory):
    """(url, model, tokenizer, model_dir) of a running fake SGLang server; stopped after the module."""
    model_dir = tmp_path_factory.mktemp("sglang-model")
    model, tok = save_model(model_dir)
    proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "fake_sglang_server.py"), str(model_dir)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    yield line.split()[-1], model, tok, model_dir
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def sglang(fake_sglang, tmp_path):
    url, _, tok, model_dir = fake_sglang
    engine = SGLangEngine(url, tok, timeout_s=30.0, sync_dir=tmp_path / "sync", model_dir=model_dir)
    yield engine
    engine.close()


def requests_for(params: SamplingParams, prompts=PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(i, p, params) for i, p in enumerate(prompts)]


def test_sglang_greedy_matches_torch_engine_and_model_logprobs(fake_sglang, sglang):
    _, model, tok, _ = fake_sglang
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    got = sglang.generate(requests_for(params))
    want = TorchEngine(model, tok).generate(requests_for(params))
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    for req, res in zip(requests_for(params), got):
        assert res.status in (Status.TRUNCATED, Status.COMPLETED)
        torch.testing.assert_close(res.logprobs, model_logprobs(model, req.prompt_ids, res.response_ids),
                                   atol=1e-5, rtol=0)
        assert res.full_logprobs == res.logprobs
        assert res.version_spans == [(0, len(res.response_ids), 0)]
        assert res.text == tok.decode(res.response_ids, skip_special_tokens=True)
    assert sglang.stats.generated_tokens == sum(len(r.response_ids) for r in got)


def test_sglang_sampled_logprobs_are_the_models_at_the_temperature(fake_sglang, sglang):
    _, model, _, _ = fake_sglang
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
    first, again = sglang.generate(requests_for(params)), sglang.generate(requests_for(params))
    assert [r.response_ids for r in first] == [r.response_ids for r in again]  # sampling_seed is honoured
    for req, res in zip(requests_for(params), first):
        torch.testing.assert_close(res.logprobs, model_logprobs(model, req.prompt_ids, res.response_ids, 0.7),
                                   atol=1e-5, rtol=0)


def test_sglang_abort_keeps_tokens_and_continue_extends_them(fake_sglang, sglang):
    url, model, _, _ = fake_sglang
    import httpx

    httpx.post(f"{url}/rollwise_test/delay", json={"seconds": 0.05})
    try:
        short = GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=2, temperature=1.0, seed=1))
        long = GenerationRequest(1, PROMPTS[0], SamplingParams(max_new_tokens=200, temperature=1.0, seed=2))
        done = []

        def on_finish(result):
            done.append(result.request_id)
            if result.request_id == 0:
                sglang.abort([1])

        first = sglang.generate([short, long], on_finish=on_finish)
    finally:
        httpx.post(f"{url}/rollwise_test/delay", json={"seconds": 0.0})
    assert done == [0, 1]
    assert first[0].status == Status.TRUNCATED and len(first[0].response_ids) == 2
    kept = first[1]
    assert kept.status == Status.ABORTED and 0 < len(kept.response_ids) < 200
    sglang.version = 4  # a sync happened in between: the continuation is tagged with the new version
    more = len(kept.response_ids) + 3
    cont = GenerationRequest(1, PROMPTS[0], SamplingParams(max_new_tokens=more, temperature=1.0, seed=2),
                             response_ids=kept.response_ids, response_logprobs=kept.logprobs)
    (res,) = sglang.generate([cont])
    assert res.response_ids[: len(kept.response_ids)] == kept.response_ids
    assert len(res.response_ids) == more and res.status == Status.TRUNCATED
    assert res.version_spans == [(len(kept.response_ids), more, 4)]
    torch.testing.assert_close(res.logprobs, model_logprobs(model, PROMPTS[0], res.response_ids),
                               atol=1e-5, rtol=0)


def test_sglang_request_aborted_before_it_starts_returns_at_once(sglang):
    sglang.abort([0])
    req = GenerationRequest(0, PROMPTS[0], SamplingParams(max_new_tokens=4), response_ids=[9, 10],
                            response_logprobs=[-1.0, -2.0])
    (res,) = sglang.generate([req])
    assert (res.status, res.response_ids, res.logprobs, res.version_spans) == (Status.ABORTED, [9, 10],
                                                                               [-1.0, -2.0], [])


def test_sglang_weight_update_from_disk_changes_logprobs(fake_sglang, sglang, tmp_path):
    _, model, tok, _ = fake_sglang
    new = tiny_llama(len(tok), seed=7, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    probe = PROMPTS[0] + PROMPTS[2]
    before = sglang.probe_logprobs(probe)
    torch.testing.assert_close(before, model_logprobs(model, probe[:1], probe[1:]), atol=1e-5, rtol=0)
    try:
        sglang.update_weights(new.state_dict(), version=1)
        after = sglang.probe_logprobs(probe)
        torch.testing.assert_close(after, model_logprobs(new, probe[:1], probe[1:]), atol=1e-5, rtol=0)
        assert max(abs(a - b) for a, b in zip(before, after)) > 0.1
        assert sglang.version == 1
        (res,) = sglang.generate([GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=3))])
        assert res.version_spans == [(0, len(res.response_ids), 1)]
        assert [p.name for p in (tmp_path / "sync").iterdir()] == ["v1"]
        with pytest.raises(ServerEngineError, match="update_weights_from_disk") as bad:
            sglang.reload_from(tmp_path / "missing", version=2)
        assert "\n" not in str(bad.value)
        with pytest.raises(ServerEngineError, match="unknown state after a failed sync"):
            sglang.generate([GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=3))])
    finally:
        sglang.update_weights(model.state_dict(), version=3)  # the module's server keeps the original weights
    torch.testing.assert_close(sglang.probe_logprobs(probe), before, atol=1e-6, rtol=0)


def test_sglang_timeout_is_one_line_naming_url_and_key(fake_sglang):
    url, _, tok, _ = fake_sglang
    import httpx

    engine = SGLangEngine(url, tok, timeout_s=0.3)
    httpx.post(f"{url}/rollwise_test/delay", json={"seconds": 1.0})
    try:
        with pytest.raises(ServerEngineError) as err:
            engine.generate([GenerationRequest(0, PROMPTS[0], SamplingParams(max_new_tokens=1))])
    finally:
        httpx.post(f"{url}/rollwise_test/delay", json={"seconds": 0.0})
    message = str(err.value)
    assert f"{url}/generate" in message and "rollout.request_timeout_s = 0.3" in message and "\n" not in message


def test_sglang_server_error_and_unreachable_server_are_one_line(fake_sglang, sglang):
    url, _, tok, _ = fake_sglang
    with pytest.raises(ServerEngineError) as err:
        sglang.generate([GenerationRequest(0, [10**7], SamplingParams(max_new_tokens=2))])
    assert str(err.value) == f"{url}/generate answered HTTP 400: input_ids must be token ids in [0, {len(tok)})"
    port = free_port()
    with pytest.raises(ServerEngineError, match=rf"cannot reach the SGLang server .*127.0.0.1:{port}") as down:
        SGLangEngine(f"http://127.0.0.1:{port}", tok, timeout_s=2.0)
    assert "\n" not in str(down.value)


# ================================================================================================ vLLM
@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """A VLLMServerEngine on a tiny tied Llama (head_dim 64) launched for this module, and its model."""
    pytest.importorskip("vllm")
    import importlib.util

    if importlib.util.find_spec("rollwise.generate.vllm_ext") is None:
        pytest.skip("rollwise.generate.vllm_ext is missing")
    from rollwise.generate.vllm_server import VLLMServerEngine

    root = tmp_path_factory.mktemp("vllm-server")
    model, tok = save_model(root / "model", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=256)
    engine = VLLMServerEngine.launch(root / "model", tok, dtype="float32", log_path=root / "server.log",
                                     sync_dir=root / "sync", timeout_s=120.0, threads=2, startup_timeout_s=240.0,
                                     options={"enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8,
                                              "seed": 0})
    pids = [engine.server.process.pid] + [c.pid for c in psutil.Process(engine.server.process.pid).children(True)]
    yield engine, model, tok, pids
    engine.close()


@pytest.mark.slow
def test_vllm_server_greedy_equals_torch_engine_with_model_logprobs(vllm_server):
    engine, model, tok, _ = vllm_server
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    got = engine.generate(requests_for(params))
    want = TorchEngine(model, tok).generate(requests_for(params))
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    for req, res in zip(requests_for(params), got):
        torch.testing.assert_close(res.logprobs, model_logprobs(model, req.prompt_ids, res.response_ids),
                                   atol=1e-3, rtol=0)
    sampled = engine.generate(requests_for(SamplingParams(max_new_tokens=8, temperature=0.7, seed=5)))
    for req, res in zip(requests_for(params), sampled):
        torch.testing.assert_close(res.logprobs, model_logprobs(model, req.prompt_ids, res.response_ids, 0.7),
                                   atol=1e-3, rtol=0)
        assert res.full_logprobs == res.logprobs


@pytest.mark.slow
def test_vllm_server_abort_and_continue(vllm_server):
    engine, model, _, _ = vllm_server
    short = GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=1, temperature=1.0, seed=1))
    long = GenerationRequest(1, PROMPTS[0], SamplingParams(max_new_tokens=200, temperature=1.0, seed=2))
    first = engine.generate([short, long], on_finish=lambda r: engine.abort([1]) if r.request_id == 0 else None)
    kept = first[1]
    assert kept.status == Status.ABORTED and len(kept.response_ids) < 200
    more = len(kept.response_ids) + 4
    cont = GenerationRequest(1, PROMPTS[0], SamplingParams(max_new_tokens=more, temperature=1.0, seed=2),
                             response_ids=kept.response_ids, response_logprobs=kept.logprobs)
    (res,) = engine.generate([cont])
    assert res.response_ids[: len(kept.response_ids)] == kept.response_ids
    assert res.version_spans == [(len(kept.response_ids), len(res.response_ids), engine.version)]
    torch.testing.assert_close(res.logprobs, model_logprobs(model, PROMPTS[0], res.response_ids), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_vllm_server_reload_through_extension_gives_new_logprobs(vllm_server):
    engine, model, tok, _ = vllm_server
    new = tiny_llama(len(tok), seed=11, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    probe = PROMPTS[0] + PROMPTS[2]
    before = engine.probe_logprobs(probe)
    torch.testing.assert_close(before, model_logprobs(model, probe[:1], probe[1:]), atol=1e-3, rtol=0)
    engine.update_weights(new.state_dict(), version=1)
    after = engine.probe_logprobs(probe)
    torch.testing.assert_close(after, model_logprobs(new, probe[:1], probe[1:]), atol=1e-3, rtol=0)
    assert engine.server_versions() == [1] and engine.version == 1
    (res,) = engine.generate([GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0))])
    torch.testing.assert_close(res.logprobs, model_logprobs(new, PROMPTS[1], res.response_ids), atol=1e-3, rtol=0)
    assert res.version_spans == [(0, len(res.response_ids), 1)]


@pytest.mark.slow
def test_vllm_server_close_leaves_no_process(vllm_server):
    engine, _, _, pids = vllm_server
    assert len(pids) >= 2  # the API server and its engine core
    engine.close()
    engine.close()  # idempotent
    assert no_process_left(pids)
    with pytest.raises(ServerEngineError, match="closed"):
        engine.generate([GenerationRequest(0, PROMPTS[1], SamplingParams(max_new_tokens=2))])


def test_vllm_server_command_has_the_fixed_flags_and_maps_options():
    from rollwise.generate.vllm_server import server_command

    cmd = server_command("/m", 8123, "bfloat16", {"enforce_eager": True, "enable_prefix_caching": False,
                                                 "max_model_len": 512})
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(cmd[3:])
    assert "--host 127.0.0.1 --port 8123 --dtype bfloat16" in flags
    assert "--worker-extension-cls rollwise.generate.vllm_ext.RollwiseWorkerExtension" in flags
    assert "--logprobs-mode processed_logprobs" in flags
    assert cmd[-4:] == ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "512"]
