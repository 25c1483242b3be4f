"""Attention pieces some architectures add to plain causal SDPA, for code that computes attention itself
(the trainer's block attention for prompt-shared rows, `rollwise.train.shared_attention`).

- Sliding windows: a query at position p sees the keys at positions p - window < k <= p (transformers'
  `sliding_window_overlay`), the layer's `sliding_window` argument (None on full-attention layers).
- Attention-logit soft-capping (Gemma 2's `attn_logit_softcapping`): scores become `cap * tanh(scores / cap)`
  before the mask, as transformers' eager attention does (its SDPA path skips the cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window(q_pos: torch.Tensor, k_pos: torch.Tensor, size: int) -> torch.Tensor:
    """[..., Lq, Lk] bool: key k is inside the window of query q. q_pos [..., Lq], k_pos [..., Lk]."""
    return k_pos[..., None, :] > q_pos[..., :, None] - size


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
           softcap: float | None = None) -> torch.Tensor:
    """SDPA with an optional soft cap. q [B, H, Lq, D], k/v [B, KV, Lk, D] (H a multiple of KV), mask bool
    broadcastable to [B, H, Lq, Lk] (True = visible; every query row sees at least one key) -> [B, H, Lq, D]."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None, position_ids: torch.Tensor | None, sliding_window: int | None,
                     softcap: float | None) -> torch.Tensor:
    """A transformers attention call (query [R, H, L, D], key/value [R, KV, L, D], bool mask [R, 1, L, L] or
    None for plain causal) with the layer's window and cap applied -> [R, L, H, D]. The window is taken over
    `position_ids` [R, L] (a packed row's positions restart after its prompt)."""
    length = query.shape[2]
    self_attention = key.shape[2] == length  # against a cache, the caller's mask already holds the window
    if mask is None and self_attention:
        mask = torch.ones((length, length), dtype=torch.bool, device=query.device).tril()[None, None]
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask == 0  # additive: 0 where visible
    if sliding_window is not None and self_attention:
        if position_ids is None:
            raise RuntimeError("a sliding-window layer was called without position_ids; cannot place its window")
        mask = mask & window(position_ids, position_ids, sliding_window)[:, None]
    return attend(query, key, value, mask, scale, softcap).transpose(1, 2).contiguous()
