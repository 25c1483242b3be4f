"""The fused decode step reproduces the model's own forward on the same slot cache."""

import pytest
import torch
from torch.testing import assert_close
from transformers import Qwen2Config, Qwen2ForCausalLM

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.generate.fused_decode import FusedDecoder
from rollwise.generate.slot_cache import SlotCache
from rollwise.models.compat import cache_kwargs
from rollwise.types import GenerationRequest, SamplingParams


def _tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=False, use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Qwen2ForCausalLM(config)
        for layer in model.model.layers:  # non-zero q/k/v biases, so that they are exercised
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    return model.eval()


def _filled_cache(model, dtype, lengths):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = SlotCache(cfg.num_hidden_layers, len(lengths), cfg.num_key_value_heads, 24, head_dim, dtype)
    gen = torch.Generator().manual_seed(0)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    cache.lengths[:] = torch.tensor(lengths)
    return cache


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_model_forward(family, dtype):
    vocab = 97
    model = (tiny_llama(vocab, seed=1) if family == "llama" else _tiny_qwen2(vocab)).to(dtype)
    assert FusedDecoder.supports(model)
    lengths = [3, 17, 9, 1]  # slots at different lengths: per-slot positions and masks
    ids = torch.tensor([5, 11, 42, 7])
    ref_cache, fused_cache = _filled_cache(model, dtype, lengths), _filled_cache(model, dtype, lengths)
    positions, mask = ref_cache.begin_step()
    with torch.inference_mode():
        ref = model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions,
                    **cache_kwargs(model, ref_cache), use_cache=True).logits[:, -1]
    positions, _ = fused_cache.begin_step()
    rows = torch.tensor([0, 2, 3])  # logits only for the rows that are sampled
    fused = FusedDecoder(model).step(ids, positions[:, 0], fused_cache, rows)
    tol = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    assert_close(fused.float(), ref[rows].float(), **tol)
    untouched = _filled_cache(model, dtype, lengths)
    for a, b, c in zip(ref_cache.keys + ref_cache.values, fused_cache.keys + fused_cache.values,
                       untouched.keys + untouched.values):
        assert_close(a[rows].float(), b[rows].float(), **tol)  # the same K/V at the same columns
        assert torch.equal(b[1], c[1])  # the inactive slot's cache is left as it was


def test_unsupported_architecture_falls_back_to_model_forward():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       hidden_act="gelu")
    assert not FusedDecoder.supports(model)
    engine = TorchEngine(model, tok)
    assert engine.fused is None
    (result,) = engine.generate([GenerationRequest(0, [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0))])
    assert len(result.response_ids) == 4


def test_engine_fused_and_unfused_agree_and_weight_updates_reach_fused_matrices():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    reqs = [GenerationRequest(i, [5 + i, 6, 7, 8], params) for i in range(3)]
    fused, plain = TorchEngine(model, tok), TorchEngine(model, tok, fused=False)
    assert fused.fused is not None and plain.fused is None
    for a, b in zip(fused.generate(reqs), plain.generate(reqs)):
        assert a.response_ids == b.response_ids
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    other = tiny_llama(len(tok), seed=9, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    fused.update_weights(other.state_dict(), version=1)
    plain.update_weights(other.state_dict(), version=1)
    for a, b in zip(fused.generate(reqs), plain.generate(reqs)):
        assert a.response_ids == b.response_ids
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_prefill_equals_model_forward_with_right_padding(family):
    vocab = 97
    model = tiny_llama(vocab, seed=1) if family == "llama" else _tiny_qwen2(vocab)
    contexts = [[5, 9, 13, 2, 7], [4, 4], [8, 1, 6]]
    width = max(len(c) for c in contexts)
    ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
    lengths = torch.tensor([len(c) for c in contexts])
    logits, layer_kv = FusedDecoder(model).prefill(ids, lengths)
    for row, context in enumerate(contexts):  # each context alone, unpadded, through the model
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([context]), use_cache=True)
        assert_close(logits[row], out.logits[0, -1])
        for layer, (k, v) in enumerate(layer_kv):
            ref = out.past_key_values.layers[layer]
            assert_close(k[row, :, : len(context)], ref.keys[0])
            assert_close(v[row, :, : len(context)], ref.values[0])
