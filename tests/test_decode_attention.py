"""Grouped-query attention of the torch engine (rollwise.generate.decode_attention) and its one-copy sampling.

The grouped attention must equal transformers' SDPA path with repeated K/V: on a hand-computed case, on random
tensors (strided keys as the slot cache hands them, boolean and additive masks, several query tokens), and
through the whole engine (prefill without a mask, decode steps with per-slot masks) for several architectures:
the same tokens, log-probs and untruncated log-probs, and identical greedy tokens."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_arch, tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.generate import decode_attention
from rollwise.generate.decode_attention import gqa_attention_forward
from rollwise.generate.sampling import sample_with_full_logprobs
from rollwise.generate.torch_engine import _sample_rows
from rollwise.types import GenerationRequest, SamplingParams


class _Module:  # what the attention function reads of the attention layer
    is_causal = True
    num_key_value_groups = 2


def test_hand_computed_grouped_attention():
    # 2 query heads share 1 KV head; D = 1, so scale = 1. Keys [0, 1, 5], values [2, 4, 100]; column 2 masked.
    query = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)  # [B=1, Hq=2, q=1, D=1]
    key = torch.tensor([0.0, 1.0, 5.0]).view(1, 1, 3, 1)  # [1, Hkv=1, T=3, 1]
    value = torch.tensor([2.0, 4.0, 100.0]).view(1, 1, 3, 1)
    mask = torch.tensor([True, True, False]).view(1, 1, 1, 3)
    out, _ = gqa_attention_forward(_Module(), query, key, value, mask)
    # head 0: scores [0, 1] -> weights [1, e] / (1 + e); head 1: scores [0, 2] -> [1, e^2] / (1 + e^2)
    e = math.e
    expected = [(2 + 4 * e) / (1 + e), (2 + 4 * e**2) / (1 + e**2)]
    assert out.shape == (1, 1, 2, 1)  # [B, q, Hq, Dv]
    assert_close(out.flatten(), torch.tensor(expected))


def _reference(query, key, value, mask, scale):
    """transformers' path: K/V repeated to every query head, then plain masked attention."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    k, v = repeat_kv(key, groups), repeat_kv(value, groups)
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("additive", [False, True])
def test_equals_repeated_kv_attention_on_strided_cache_keys(q_len, additive):
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, dim, width = 3, 2, 3, 8, 11
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=gen)
    stored = torch.randn(batch, kv_heads, dim, 16, generator=gen)  # the slot cache's keys: [S, Hkv, D, capacity]
    key = stored[..., :width].transpose(-1, -2)  # [B, Hkv, T, D], a strided view as SlotCache.update returns
    value = torch.randn(batch, kv_heads, width, dim, generator=gen)
    lengths = torch.tensor([4, 11, 7])
    mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :].expand(batch, 1, q_len, width)
    given = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min) if additive else mask
    module = _Module()
    module.num_key_value_groups = groups
    out, _ = gqa_attention_forward(module, query, key, value, given, scaling=0.3)
    assert_close(out, _reference(query, key, value, mask, 0.3))


def test_no_mask_is_causal_sdpa_with_grouped_kv(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    query, key, value = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen), \
        torch.randn(2, 2, 5, 8, generator=gen)
    seen = {}
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out, _ = gqa_attention_forward(_Module(), query, key, value, None)
    assert seen["is_causal"] is True and seen["enable_gqa"] is True and seen["attn_mask"] is None
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    assert_close(out, _reference(query, key, value, causal, 8 ** -0.5))


# -- through the engine -------------------------------------------------------------------------------------------
ARCHS = ["llama", "qwen2", "qwen3", "mistral-window", "gemma3", "phi3"]


def _model(name, tok):
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tiny_llama(len(tok), seed=3, **ids) if name == "tiny_llama" else tiny_arch(name, len(tok), **ids)


def _requests(tok):
    texts = ["What is 7 + 3?", "Compute 12 - 5 and then add 9 to it, please.", "banana"]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    sampled = SamplingParams(max_new_tokens=14, temperature=1.0, seed=5)
    truncated = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=6)
    return [GenerationRequest(i, p, params) for i, (p, params) in
            enumerate([(p, sampled) for p in prompts] * 2 + [(p, truncated) for p in prompts])]


@pytest.mark.parametrize("name", ["tiny_llama", *ARCHS])
def test_engine_with_grouped_attention_equals_the_sdpa_engine(name):
    tok = tiny_tokenizer()
    model = _model(name, tok)
    plain = TorchEngine(model, tok, fused=False, gqa_attention=False, max_batch_size=4)
    grouped = TorchEngine(model, tok, fused=False, gqa_attention=True, max_batch_size=4)  # 4 slots: slots refill
    assert grouped.gqa_attention and grouped.model.config._attn_implementation == decode_attention.NAME
    assert plain.model.config._attn_implementation == "sdpa"
    for a, b in zip(plain.generate(_requests(tok)), grouped.generate(_requests(tok))):
        assert a.response_ids == b.response_ids and a.status == b.status
        assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs))
        assert_close(torch.tensor(b.full_logprobs), torch.tensor(a.full_logprobs))
    greedy = [GenerationRequest(i, r.prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.0))
              for i, r in enumerate(_requests(tok)[:3])]
    assert [r.response_ids for r in plain.generate(greedy)] == [r.response_ids for r in grouped.generate(greedy)]
    probe = greedy[1].prompt_ids + [5, 9, 11]
    assert_close(torch.tensor(grouped.probe_logprobs(probe)), torch.tensor(plain.probe_logprobs(probe)))


def test_decode_step_logits_equal_the_sdpa_path():
    """One decode step's logits, not just what was sampled from them."""
    tok = tiny_tokenizer()
    model = _model("qwen2", tok)
    logits = {}
    for gqa in (False, True):
        engine = TorchEngine(model, tok, fused=False, gqa_attention=gqa)
        seen = []
        original = engine.model.forward

        def forward(*args, _original=original, _seen=seen, **kwargs):
            out = _original(*args, **kwargs)
            _seen.append(out.logits.detach().clone())
            return out

        engine.model.forward = forward
        engine.generate(_requests(tok)[:3])
        logits[gqa] = seen
    assert len(logits[True]) == len(logits[False]) > 5
    for a, b in zip(logits[False], logits[True]):
        assert_close(b, a)


def test_models_it_cannot_serve_keep_their_attention():
    tok = tiny_tokenizer()
    gemma2 = tiny_arch("gemma2", len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert decode_attention.refusal(gemma2) == "attention logit soft-capping"
    engine = TorchEngine(gemma2, tok, fused=False, gqa_attention=True)
    assert not engine.gqa_attention and engine.model.config._attn_implementation == "eager"


def test_default_is_off_on_the_cpu():
    tok = tiny_tokenizer()
    engine = TorchEngine(_model("tiny_llama", tok), tok)
    assert not engine.gqa_attention and engine.model.config._attn_implementation == "sdpa"


def test_sample_rows_reads_every_params_group_back_in_one_copy(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 40, generator=gen)
    a = SamplingParams(temperature=1.0, seed=1)
    b = SamplingParams(temperature=0.5, top_k=5, seed=2)
    params = [a, b, a, b, b]
    generators = {a: torch.Generator().manual_seed(10), b: torch.Generator().manual_seed(11)}
    expected = {}
    for p, rows, g in ((a, [0, 2], 10), (b, [1, 3, 4], 11)):
        tok, lp, full = sample_with_full_logprobs(logits[rows], p.temperature, p.top_k, p.top_p,
                                                  torch.Generator().manual_seed(g))
        for row, t, l, f in zip(rows, tok.tolist(), lp.tolist(), full.tolist()):
            expected[row] = (t, l, f)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or real_cpu(self, *a, **k))
    tokens, logprobs, full = _sample_rows(logits, params, generators)
    assert copies == [(3, 5)]  # one read-back: [tokens | logprobs | full] x rows
    assert [(t, l, f) for t, l, f in zip(tokens, logprobs, full)] == [expected[r] for r in range(5)]
    assert all(isinstance(t, int) for t in tokens)


def test_off_the_cpu_a_decode_step_reads_nothing_back_from_the_device():
    """The slot cache's width off the CPU is its capacity (the mask hides unwritten columns): on the meta device,
    whose tensors hold no data, a host read of the longest slot would raise. On the CPU in fp32 it attends only
    up to the longest slot (hand-checked widths)."""
    from rollwise.generate.slot_cache import SlotCache

    for device in ("meta", "cpu"):
        cache = SlotCache(2, 3, 2, 16, 4, torch.float32, device)
        cache.lengths += torch.tensor([5, 2, 0], device=device)
        positions, mask = cache.begin_step()
        assert mask.shape == (3, 1, 1, 16 if device == "meta" else 6)
        if device == "cpu":
            assert positions[:, 0].tolist() == [5, 2, 0] and mask[:, 0, 0].sum(-1).tolist() == [6, 3, 1]
