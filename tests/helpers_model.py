"""Tiny random models built in-process for tests: no files, no network, deterministic from a seed.

Pair them with `helpers_tokenizer.tiny_tokenizer()`:
`tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)`, or one of the
architectures users bring, `tiny_arch("gemma2", len(tok), ...)` (names in `ARCHITECTURES`).
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


# -- one tiny random model per architecture users bring (tests/test_architectures.py) ------------------------
# Sizes: hidden 64, 2 layers, 4 heads, intermediate 128. Each entry: (config class name, its arguments). Prompts
# of the tests are longer than every sliding window (8), and soft caps are small enough to change the numbers.
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),  # per-head q/k norms, head_dim != 64 / 4
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),  # v0.3: no window
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8)),  # v0.1: every layer slides
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, sliding_window=8, partial_rotary_factor=0.5)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    # keys GPT-NeoX ignores: it has num_attention_heads kv heads of hidden / heads dims and no window
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
}


def tiny_arch(name: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny random model of architecture `name` (a key of ARCHITECTURES), eval mode, fp32.

    Biases and norm weights are drawn at random too (their init is 0 and 1, which would hide a missing or
    misplaced bias or norm), and embeddings at a larger scale so that soft caps and attention matter.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, params = ARCHITECTURES[name]
    args = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, initializer_range=0.1, **params)
    args.update(overrides)
    config = getattr(transformers, config_name)(**args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if module_name.endswith("bias") or "norm" in module_name:
                    param.add_(torch.randn(param.shape) * 0.2)
    return model.eval()


def max_diff(a, b) -> float:
    """The largest absolute difference of two equal-length, non-empty sequences of numbers (log-probs)."""
    assert len(a) == len(b) and len(a) > 0
    return max(abs(x - y) for x, y in zip(a, b))
