"""Attention for packed prompt-shared micro-batches, through fused kernels and no `[L, L]` mask.

A packed micro-batch is one row of units `[prompt, response 1, ..., response G]` laid end to end with no padding
(`rollwise.train.batching`). Each response must see its own prompt and itself only; each prompt itself only.
With one dense `[L, L]` mask, attention costs O(L^2) memory and time and, with a boolean mask and grouped K/V,
PyTorch falls back to its math kernel on CUDA. Here q/k/v are gathered into dense batches by the layout's
index tensors (`rollwise.train.segments`) and each layer makes one or two fused SDPA calls:

- on CUDA (`PrefixLayout`): one `is_causal=True` call over segments `[prompt, response i]`: FlashAttention with
  native grouped K/V, no mask tensor at all;
- on CPU (`SplitLayout`): one causal call over the prompts and one over the responses' queries against their
  prompt and themselves (a per-micro-batch mask); the scores computed drop about 2-3x against the prefix form,
  and PyTorch's CPU flash kernel runs in fp32 (its bf16 backward is about twice as slow at these shapes).

Segment coordinates are position ids, so a sliding window is a mask over positions
(`rollwise.models.attention.window`) and a soft cap goes through `attend`. Log-probs and gradients equal those of
the plain per-sample forward, on every architecture (tests/test_architectures.py, fp32, 1e-5). Registered with
transformers' `AttentionInterface` as `rollwise_shared`; the layout reaches it as the forward keyword
`shared_layout`. Without it (any other call: generation, probes) the function is plain SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rollwise.models.attention import attend, causal_attention, window
from rollwise.train.segments import PrefixLayout, SegmentLayout, SplitLayout

NAME = "rollwise_shared"
FORCE_FORM: str | None = None  # "prefix" | "split": run that form on any device (tests check both on the CPU)
__all__ = ["NAME", "SegmentLayout", "shared_attention"]


class _Gather(torch.autograd.Function):
    """`x.index_select(0, index)` whose backward accumulates in fp32: x [L, ...], index [M] -> [M, ...].

    The backward is an index_add of the M rows into L (a prompt position occurs once per segment of its unit).
    PyTorch's CPU index_add is an order of magnitude slower in bf16 than in fp32 at these shapes, and fp32 also
    keeps the G-fold sum of a prompt's gradient from rounding in bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32)
        return out.index_add_(0, index, grad.float()).to(grad.dtype), None


def _batch(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [1, heads, L, D] (the row) -> [B, heads, W, D] gathered by `index` [B, W], in `dtype`."""
    heads, D = x.shape[1], x.shape[3]
    B, W = index.shape
    rows = x[0].transpose(0, 1)  # [L, heads, D]
    return _Gather.apply(rows, index.reshape(-1)).view(B, W, heads, D).transpose(1, 2).to(dtype)


def _flat(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, W, D] -> [B * W, H, D] in `dtype`."""
    return out.to(dtype).transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


def _sdpa(q, k, v, mask, scaling, softcap):
    """Causal SDPA (mask None) or masked; soft-capped through `attend`. q [B, H, Lq, D], k/v [B, KV, Lk, D]."""
    if softcap is None and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return attend(q, k, v, mask, scaling, softcap)


def _windowed(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """[W, W] bool, causal inside a sliding window over positions 0..W-1; None (plain causal) without one."""
    if sliding_window is None:
        return None
    pos = torch.arange(length, device=device)
    return torch.ones(length, length, dtype=torch.bool, device=device).tril() & window(pos, pos, sliding_window)


def _prefix(query, key, value, layout: PrefixLayout, scaling, sliding_window, softcap, dtype):
    q, k, v = (_batch(t, layout.gather, dtype) for t in (query, key, value))  # [N, H | KV, W, D]
    out = _sdpa(q, k, v, _windowed(q.shape[2], sliding_window, q.device), scaling, softcap)  # [N, H, W, D]
    return _Gather.apply(_flat(out, query.dtype), layout.scatter)


def _split(query, key, value, layout: SplitLayout, scaling, sliding_window, softcap, dtype):
    pq, pk, pv = (_batch(t, layout.prompts, dtype) for t in (query, key, value))  # [U, H | KV, P_max, D]
    prompt_mask = _windowed(pq.shape[2], sliding_window, pq.device)
    parts = [_flat(_sdpa(pq, pk, pv, prompt_mask, scaling, softcap), query.dtype)]
    if layout.queries.shape[0]:
        q = _batch(query, layout.queries, dtype)  # [N, H, L_r, D]
        k, v = (_batch(t, layout.keys, dtype) for t in (key, value))  # [N, KV, P_max + L_r, D]
        mask = layout.mask  # [N, 1, L_r, P_max + L_r]
        if sliding_window is not None:
            mask = mask & window(layout.query_pos, layout.key_pos, sliding_window)[:, None]
        parts.append(_flat(attend(q, k, v, mask, scaling, softcap), query.dtype))
    return _Gather.apply(torch.cat(parts), layout.scatter)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The activations' own dtype, except bf16/fp16 on a CPU: PyTorch's CPU flash-attention backward is about
    twice as slow in bf16 as in fp32 at these shapes (BENCHMARKS.md)."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return query.dtype


def shared_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     shared_layout: SegmentLayout | None = None, sliding_window: int | None = None,
                     softcap: float | None = None, **kwargs):
    """query [1, H, L, D], key/value [1, KV, L, D] -> ([1, L, H, D], None), as HF attention functions return.
    A layer's `sliding_window` and `softcap` (Gemma 2/3, Mistral) apply as `rollwise.models.attention` says."""
    if shared_layout is None:
        if sliding_window is None and softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return causal_attention(query, key, value, attention_mask, scaling, kwargs.get("position_ids"),
                                sliding_window, softcap), None
    if query.shape[0] != 1:
        raise RuntimeError(f"packed attention expects one row, got {query.shape[0]}")
    form = FORCE_FORM or ("prefix" if query.device.type == "cuda" else "split")
    dtype = _compute_dtype(query)
    with torch.autocast(query.device.type, enabled=False):
        if form == "prefix":
            out = _prefix(query, key, value, shared_layout.prefix, scaling, sliding_window, softcap, dtype)
        else:
            out = _split(query, key, value, shared_layout.split, scaling, sliding_window, softcap, dtype)
    return out.view(1, query.shape[2], query.shape[1], query.shape[3]), None


AttentionInterface.register(NAME, shared_attention)
