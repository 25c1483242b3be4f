"""Per-token log-probabilities and entropy of response tokens, computed in chunks.

The `[tokens, vocab]` logits are never built for a whole micro-batch: hidden states of response
positions go through the LM head `chunk_tokens` at a time, and a custom autograd function recomputes
each chunk's logits in the backward pass instead of keeping them.
"""

from __future__ import annotations

import torch

from rollwise.models.arch import logit_softcap
from rollwise.train.batching import MicroBatch
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION


def response_hidden(model, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict the valid response tokens.

    Returns [n, H] for the n valid tokens of `mb.valid` [S, T], in row-major order.
    """
    extra = {}
    if mb.layout is not None and model.config._attn_implementation == SHARED_ATTENTION:
        extra["shared_layout"] = mb.layout  # block attention: skips the masked-out response-response blocks
    hidden = model.get_decoder()(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False,
        **extra,
    ).last_hidden_state  # [R, L, H]
    R, L, H = hidden.shape
    return hidden.reshape(R * L, H).index_select(0, mb.pred_index[mb.valid])  # [n, H]


CHUNK_TOKENS = 512  # response positions per LM-head call: one [CHUNK_TOKENS, V] fp32 logits block at a time


def row_chunks(n: int, chunk_tokens: int = CHUNK_TOKENS) -> list[slice]:
    """Slices over `n` rows, `chunk_tokens` at a time: how every `[rows, V]` LM-head computation is chunked
    (`token_logprobs` here, the GKD term in `rollwise.distill.terms`)."""
    return [slice(start, start + chunk_tokens) for start in range(0, n, chunk_tokens)]


class _HeadLogprob(torch.autograd.Function):
    """Target-token log-probability and entropy through the LM head for one chunk of positions.

    Forward: h [C, H], weight [V, H], targets [C] -> (logp [C], entropy [C] or None) in fp32. Only h is
    saved; backward recomputes the logits, so no [C, V] tensor outlives a call.
    Gradients: d logp_t / dz = onehot(t) - p; d H / dz_j = -p_j (log p_j + H).
    The softmax kernels are used rather than `exp`, whose vectorised CPU path is 3-5x slower on the very
    negative inputs that most of a 49k vocabulary produces.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, with_entropy: bool, softcap: float | None = None):
        ctx.set_materialize_grads(False)
        ctx.softcap = softcap  # logits cap * tanh(z / cap) (Gemma 2's final_logit_softcapping, over temperature)
        with torch.autocast(h.device.type, enabled=False):  # h and weight already share a dtype; stay fp32 after
            return _HeadLogprob._forward(ctx, h, weight, targets, with_entropy)

    @staticmethod
    def _forward(ctx, h, weight, targets, with_entropy: bool):
        logits = _capped((h @ weight.T).float(), ctx.softcap)  # [C, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [C]
        entropy = None
        if with_entropy:
            probs = torch.softmax(logits, dim=-1)
            entropy = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # -sum_j p_j log p_j
        ctx.save_for_backward(h, weight, targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, weight, targets = ctx.saved_tensors
        logits = _capped((h @ weight.T).float(), ctx.softcap)  # [C, V]
        probs = torch.softmax(logits, dim=-1)
        grad = None
        if grad_entropy is not None:
            logp_all = torch.log_softmax(logits, dim=-1)
            entropy = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # [C]
            grad = logp_all.add_(entropy[:, None]).mul_(probs).mul_(-grad_entropy[:, None])
        if grad_logp is not None:  # (onehot - p) * g, built in the probs buffer
            term = probs.mul_(-grad_logp[:, None]).scatter_add_(-1, targets[:, None], grad_logp[:, None])
            grad = term if grad is None else grad.add_(term)
        if grad is None:
            return None, None, None, None, None
        if ctx.softcap:  # d cap * tanh(z / cap) / dz = 1 - (logit / cap)^2
            grad.mul_(1 - (logits / ctx.softcap) ** 2)
        grad = grad.to(h.dtype)
        return grad @ weight, grad.T @ h, None, None, None


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def token_logprobs(
    model, mb: MicroBatch, temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS, with_entropy: bool = True,
    hidden_out: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the response tokens under `model`.

    Logits are divided by `temperature` (the rollout temperature) so that the trainer's distribution
    matches the one the engine sampled from; the division is applied to the hidden states, which is the
    same and `vocab / hidden` times cheaper. Returns (logp [S, T], entropy [S, T] or None); values at
    padded positions are 0. With `hidden_out`, the final hidden states [n, H] of the predicting positions are
    appended to it (for a value head).
    """
    flat_h = response_hidden(model, mb)  # [n, H]
    if hidden_out is not None:
        hidden_out.append(flat_h)
    if temperature != 1.0:
        flat_h = flat_h / temperature
    flat_t = mb.targets[mb.valid]  # [n]
    weight = model.get_output_embeddings().weight  # [V, H]
    device = flat_h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat_h, weight = flat_h.to(dtype), weight.to(dtype)
    logps, ents = [], []
    cap = logit_softcap(model)  # on logits / temperature: cap * tanh(z / cap) / T = (cap / T) tanh((z / T) / (cap / T))
    for rows in row_chunks(flat_h.shape[0], chunk_tokens):
        h, t = flat_h[rows], flat_t[rows]
        lp, ent = _HeadLogprob.apply(h, weight, t, with_entropy, cap / temperature if cap else None)
        logps.append(lp)
        ents.append(ent)
    S, T = mb.targets.shape
    logp = torch.zeros(S, T, dtype=torch.float32, device=mb.device).masked_scatter(mb.valid, torch.cat(logps))
    if not with_entropy:
        return logp, None
    return logp, torch.zeros(S, T, dtype=torch.float32, device=mb.device).masked_scatter(mb.valid, torch.cat(ents))
