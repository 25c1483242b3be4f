"""Grouped-query attention for the torch engine's model forward, with no copy of K/V per query head.

transformers' SDPA path repeats every KV head to its query heads (`repeat_kv`, a copy of the whole cache per layer
and step) whenever an attention mask is given, and the torch engine always gives one in its decode steps (each slot
has its own length). This attention function, registered in `transformers.AttentionInterface` as `"rollwise_gqa"`,
computes the same attention grouped instead:

- with a mask (decode steps, a padded prefill, a cached speculative round): the query heads of each KV head are
  stacked, `q [B, Hkv, G*q, D] @ K^T [B, Hkv, D, T]`, so K and V are read once, in place (the slot cache's
  transposed keys are a strided view, no copy); scores in the model's dtype as eager attention has them, softmax in
  fp32, masked columns get zero weight;
- with no mask (a causal forward with no padding: the engine's prefill passes none, since its right padding is
  never seen by a real token under the causal mask): transformers' SDPA forward, which then passes
  `is_causal=True, enable_gqa=True`, so PyTorch can pick FlashAttention with native grouped K/V on CUDA.

Used by `TorchEngine` (`gqa_attention`) on every device where the fused CPU decoder does not decode. Exact: the
same logits, tokens and log-probs as SDPA with repeated K/V up to fp32 rounding (tests/test_decode_attention.py).
Models it does not serve (attention soft-capping, attention sinks, a model that refuses custom attention) keep
their own attention; `refusal` says why.
"""

from __future__ import annotations

import torch

NAME = "rollwise_gqa"


def gqa_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of query [B, Hq, q, D] over key [B, Hkv, T, D] and value [B, Hkv, T, Dv], Hq = G * Hkv (query
    head h reads KV head h // G, as `repeat_kv` orders them). `attention_mask`: None (causal, no padding), a bool
    [B or 1, 1, q, T] (True = visible) or an additive float one of that shape. Returns ([B, q, Hq, Dv], None)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("rollwise_gqa attention does not apply soft-capping or attention sinks: the engine keeps "
                         "the model's own attention for such models (decode_attention.refusal)")
    if attention_mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    scale = scaling if scaling is not None else head_dim ** -0.5
    q = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # [B, Hkv, G*q, D]
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, G*q, T]
    scores = scores.view(batch, kv_heads, groups, q_len, kv_len)  # [B, Hkv, G, q, T]
    mask = attention_mask[:, :, None]  # [B|1, 1, 1, q, T]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)  # [B, Hkv, G, q, T]
    out = torch.matmul(probs.view(batch, kv_heads, groups * q_len, kv_len), value)  # [B, Hkv, G*q, Dv]
    out = out.view(batch, q_heads, q_len, value.shape[-1])  # [B, Hq, q, Dv]
    return out.transpose(1, 2).contiguous(), None  # [B, q, Hq, Dv]


def register() -> None:
    """Register `NAME` with transformers' attention and mask interfaces (idempotent). The mask function is SDPA's:
    boolean 4-D masks, or None where the forward is causal with no padding."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, gqa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def refusal(model) -> str | None:
    """Why `model` cannot run `NAME` attention, or None: soft-capped attention logits (Gemma 2: eager attention
    applies the cap), attention sinks (gpt-oss), or a model class that takes no custom attention function."""
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} takes no custom attention function"
    return None


def use(model) -> bool:
    """Switch `model` (the engine's own copy) to `NAME` attention when it can run it; returns whether it did."""
    if refusal(model) is not None:
        return False
    register()
    model.set_attn_implementation(NAME)
    return True
