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
    """Final hidden states at the positions that predict the valid response tokens.

    Returns [n, H] for the n valid tokens of `mb.valid` [S, T], in row-major order.
    """
    hidden = model.get_decoder()(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
    ).last_hidden_state  # [R, L, H]
    R, L, H = hidden.shape
    return hidden.reshape(R * L, H).index_select(0, mb.pred_index[mb.valid])  # [n, H]


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
    distribution matches the one the engine sampled from. Returns (logp [S, T], entropy [S, T]);
    values at padded positions are 0.
    """
    flat_h = response_hidden(model, mb)  # [n, H]
    flat_t = mb.targets[mb.valid]  # [n]
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
    S, T = mb.targets.shape
    logp = torch.zeros(S, T, dtype=torch.float32).masked_scatter(mb.valid, torch.cat(logps))
    entropy = torch.zeros(S, T, dtype=torch.float32).masked_scatter(mb.valid, torch.cat(ents))
    return logp, entropy
