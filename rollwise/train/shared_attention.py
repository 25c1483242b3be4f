"""Attention for prompt-shared rows `[prompt, response 1, ..., response G]`, without the masked-out blocks.

With one dense `[L, L]` mask per row (L = P + sum of response lengths), attention costs O(L^2) although each
response only sees the prompt and itself. This function computes the same result block by block:

- the prompt attends to itself causally: one SDPA over `[P, P]`;
- the G responses of a row are gathered into a batch `[G, Lr]` (Lr = longest response) whose keys are the
  shared prompt's keys followed by the response's own: one SDPA over `[G, Lr, P + Lr]` with a causal mask
  on the response part.

Cost per row: P^2 + G * Lr * (P + Lr) instead of (P + G * Lr)^2 (about 5x less for P = 40, G = 8,
Lr = 40). Registered with transformers' `AttentionInterface` as `rollwise_shared`; the row layout is passed
through the model's forward as the keyword `shared_layout`. Without it (any other call) the function is
plain SDPA, so a model switched to it behaves as before everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rollwise.models.attention import attend, causal_attention, window

NAME = "rollwise_shared"


@dataclass
class RowLayout:
    """One packed row: prompt length and, per response, (start, length) in the row.

    `index` [G, Lr] gathers each response's positions (padded with its last position), `keep` [G, Lr] marks
    real ones, `mask` [G, 1, Lr, P + Lr] bool is what each response query may see.
    """

    prompt_len: int
    index: torch.Tensor
    keep: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, prompt_len: int, spans: list[tuple[int, int]]) -> "RowLayout":
        """Built on the CPU (from Python lists); `to(device)` moves it with its micro-batch."""
        cpu = torch.device("cpu")
        longest = max(n for _, n in spans)
        offsets = torch.arange(longest, device=cpu)
        starts = torch.tensor([s for s, _ in spans], device=cpu)[:, None]
        lengths = torch.tensor([n for _, n in spans], device=cpu)[:, None]
        keep = offsets[None, :] < lengths  # [G, Lr]
        index = starts + torch.minimum(offsets[None, :], (lengths - 1).clamp(min=0))  # [G, Lr]
        own = torch.ones(longest, longest, dtype=torch.bool, device=cpu).tril()[None] & keep[:, None, :]  # [G, Lr, Lr]
        prompt = torch.ones(len(spans), longest, prompt_len, dtype=torch.bool, device=cpu)
        return cls(prompt_len, index, keep, torch.cat([prompt, own], dim=-1)[:, None])

    def to(self, device: torch.device) -> "RowLayout":
        return RowLayout(self.prompt_len, self.index.to(device), self.keep.to(device), self.mask.to(device))


def shared_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     shared_layout: list[RowLayout] | None = None, sliding_window: int | None = None,
                     softcap: float | None = None, **kwargs):
    """query [R, H, L, D], key/value [R, KV, L, D] -> ([R, L, H, D], None), as HF attention functions return.
    A layer's `sliding_window` and `softcap` (Gemma 2/3, Mistral) apply as `rollwise.models.attention` says."""
    if shared_layout is None:
        if sliding_window is None and softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return causal_attention(query, key, value, attention_mask, scaling, kwargs.get("position_ids"),
                                sliding_window, softcap), None
    if sliding_window is not None or softcap is not None:
        return _windowed_shared(query, key, value, scaling, shared_layout, sliding_window, softcap), None
    gqa = query.shape[1] != key.shape[1]
    heads, width, head_dim = query.shape[1:]
    rows_out = []
    for r, row in enumerate(shared_layout):
        P = row.prompt_len
        q, k, v = query[r], key[r], value[r]  # [H | KV, L, D]
        prompt_out = F.scaled_dot_product_attention(q[None, :, :P], k[None, :, :P], v[None, :, :P], is_causal=True,
                                                    scale=scaling, enable_gqa=gqa)[0]  # [H, P, D]
        G, Lr = row.index.shape
        flat = row.index.reshape(-1)
        rq = q[:, flat].view(q.shape[0], G, Lr, -1).transpose(0, 1)  # [G, H, Lr, D]
        rk = k[:, flat].view(k.shape[0], G, Lr, -1).transpose(0, 1)  # [G, KV, Lr, D]
        rv = v[:, flat].view(v.shape[0], G, Lr, -1).transpose(0, 1)
        keys = torch.cat([k[None, :, :P].expand(G, -1, -1, -1), rk], dim=2)  # [G, KV, P + Lr, D]
        values = torch.cat([v[None, :, :P].expand(G, -1, -1, -1), rv], dim=2)
        resp_out = F.scaled_dot_product_attention(rq, keys, values, attn_mask=row.mask, scale=scaling,
                                                  enable_gqa=gqa)  # [G, H, Lr, D]
        keep = row.keep.reshape(-1)
        resp = resp_out.transpose(0, 1).reshape(heads, G * Lr, head_dim)[:, keep]  # [H, n, D]
        # padding positions stay 0: nothing reads them
        row_out = torch.cat([prompt_out, prompt_out.new_zeros(heads, width - P, head_dim)], dim=1)
        rows_out.append(row_out.index_copy(1, flat[keep], resp))
    return torch.stack(rows_out).transpose(1, 2).contiguous(), None


def _windowed_shared(query, key, value, scaling, shared_layout, sliding_window, softcap):
    """`shared_attention`'s blocks with a sliding window and/or soft cap (positions: prompt 0..P-1, each
    response P, P + 1, ...) -> [R, L, H, D]."""
    heads, width, head_dim = query.shape[1:]
    rows_out = []
    for r, row in enumerate(shared_layout):
        P, (G, Lr) = row.prompt_len, row.index.shape
        q, k, v = query[r], key[r], value[r]  # [H | KV, L, D]
        pos = torch.arange(P + Lr, device=query.device)
        own = torch.ones((P, P), dtype=torch.bool, device=query.device).tril()
        mask = row.mask
        if sliding_window is not None:
            own = own & window(pos[:P], pos[:P], sliding_window)
            mask = mask & window(pos[P:], pos, sliding_window)
        prompt_out = attend(q[None, :, :P], k[None, :, :P], v[None, :, :P], own, scaling, softcap)[0]  # [H, P, D]
        flat = row.index.reshape(-1)
        rq, rk, rv = (t[:, flat].view(t.shape[0], G, Lr, -1).transpose(0, 1) for t in (q, k, v))  # [G, H|KV, Lr, D]
        keys = torch.cat([k[None, :, :P].expand(G, -1, -1, -1), rk], dim=2)  # [G, KV, P + Lr, D]
        values = torch.cat([v[None, :, :P].expand(G, -1, -1, -1), rv], dim=2)
        resp_out = attend(rq, keys, values, mask, scaling, softcap)  # [G, H, Lr, D]
        keep = row.keep.reshape(-1)
        resp = resp_out.transpose(0, 1).reshape(heads, G * Lr, head_dim)[:, keep]  # [H, n, D]
        row_out = torch.cat([prompt_out, prompt_out.new_zeros(heads, width - P, head_dim)], dim=1)
        rows_out.append(row_out.index_copy(1, flat[keep], resp))
    return torch.stack(rows_out).transpose(1, 2).contiguous()


AttentionInterface.register(NAME, shared_attention)
