"""Token sampling on fp32 logits, returning the behaviour log-probability of each choice."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scale by temperature and mask tokens outside top-k / top-p with -inf.

    logits: [B, V] float32 -> [B, V] (the log-space distribution actually sampled, unnormalised).
    """
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits: [B, V] (any float dtype; computed in fp32). Returns (tokens [B] long, logprobs [B] fp32),
    where logprobs are under the distribution sampled from. `temperature == 0` is greedy; its logprob
    is taken under the untempered distribution.
    """
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)  # [B, V]
    # inverse-CDF sampling: one uniform per row (cheaper than Gumbel noise over the whole vocabulary)
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    uniform = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float32, device=probs.device)
    uniform = uniform * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)  # [B]
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()
