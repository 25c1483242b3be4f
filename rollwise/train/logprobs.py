"""Per-token log-probabilities and entropy of response tokens, computed in chunks.

The `[tokens, vocab]` logits are never built for a whole micro-batch: hidden states of response
positions go through the LM head `chunk_tokens` at a time, each chunk under activation
checkpointing when gradients are needed.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rollwise.train.batching import MicroBatch


def response_hidden(model, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict response tokens.

    Returns [B, T, H]: row b, column t is the state at position resp_start[b] + t - 1.
    """
    decoder = model.get_decoder()
    positions = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    hidden = decoder(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=positions, use_cache=False
    ).last_hidden_state  # [B, L, H]
    T = mb.targets.shape[1]
    idx = mb.resp_start[:, None] - 1 + torch.arange(T)[None, :]  # [B, T]
    idx = idx.clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, T, H]


def _chunk_logp_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = (h @ weight.T).float() / temperature  # [C, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [C, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [C]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [C]
    return logp, entropy


def token_logprobs(
    model, mb: MicroBatch, temperature: float = 1.0, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities and entropies of the response tokens under `model`.

    Logits are divided by `temperature` (the rollout temperature) so that the trainer's
    distribution matches the one the engine sampled from. Returns (logp [B, T], entropy [B, T]);
    values at padded positions are 0.
    """
    hidden = response_hidden(model, mb)  # [B, T, H]
    B, T, H = hidden.shape
    valid = mb.loss_mask.bool() | (torch.arange(T)[None, :] < (mb.attention_mask.sum(-1) - mb.resp_start)[:, None])
    flat_h = hidden[valid]  # [n, H]
    flat_t = mb.targets[valid]  # [n]
    weight = model.get_output_embeddings().weight  # [V, H]
    logps, ents = [], []
    for start in range(0, flat_h.shape[0], chunk_tokens):
        h, t = flat_h[start : start + chunk_tokens], flat_t[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logp_entropy, h, weight, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logp_entropy(h, weight, t, temperature)
        logps.append(lp)
        ents.append(ent)
    logp = torch.zeros(B, T, dtype=torch.float32).masked_scatter(valid, torch.cat(logps))
    entropy = torch.zeros(B, T, dtype=torch.float32).masked_scatter(valid, torch.cat(ents))
    return logp, entropy
