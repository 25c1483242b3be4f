"""A tiny random Llama built in-process for tests: no files, no network, deterministic from a seed.

Pair it with `helpers_tokenizer.tiny_tokenizer()`:
`tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)`.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 kv heads, tied embeddings), in eval mode.

    Weights depend only on `seed`; the global torch RNG is left untouched. `overrides` go to `LlamaConfig`,
    e.g. `eos_token_id=2, pad_token_id=3, num_hidden_layers=1, tie_word_embeddings=False`.
    """
    params = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    params.update(overrides)
    config = LlamaConfig(**params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
