"""Token sampling on fp32 logits, returning the behaviour log-probability of each choice and its untruncated
log-probability (same temperature, no top-k / top-p)."""

from __future__ import annotations

import torch


def truncates(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether top-k / top-p can drop tokens (so the sampled distribution differs from the full one)."""
    return 0 < top_k < vocab_size or top_p < 1.0


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask tokens outside top-k, then outside top-p (of the renormalised top-k mass), with -inf.

    logits: [B, V] float32, already temperature-scaled -> [B, V]. Top-k: Fan et al. 2018, "Hierarchical
    Neural Story Generation"; top-p (nucleus): Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration".
    """
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


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scale by temperature and mask tokens outside top-k / top-p with -inf.

    logits: [B, V] float32 -> [B, V] (the log-space distribution actually sampled, unnormalised).
    """
    return truncate_logits(logits / temperature, top_k, top_p)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: (tokens [B] long, behaviour logprobs [B] fp32); see `sample_with_full_logprobs`."""
    tokens, logprobs, _ = sample_with_full_logprobs(logits, temperature, top_k, top_p, generator)
    return tokens, logprobs


def sample_with_full_logprobs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row and score it twice.

    logits: [B, V] (any float dtype; computed in fp32). Returns (tokens [B] long, logprobs [B] fp32,
    full_logprobs [B] fp32): `logprobs` under the distribution sampled from (temperature, then top-k / top-p,
    renormalised: the behaviour policy), `full_logprobs` under `softmax(logits / temperature)` without
    truncation (what the trainer computes). Truncation only removes mass, so `logprobs >= full_logprobs`,
    the gap being `-log(kept mass)` of the row. Without truncation both are the same tensor.
    `temperature == 0` is greedy; both log-probs are then taken under the untempered distribution.
    """
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs, logprobs
    scaled = logits / temperature  # [B, V]
    truncated = truncates(top_k, top_p, scaled.shape[-1])
    probs = torch.softmax(truncate_logits(scaled, top_k, top_p) if truncated else scaled, dim=-1)  # [B, V]
    # inverse-CDF sampling: one uniform per row (cheaper than Gumbel noise over the whole vocabulary)
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    uniform = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float32, device=probs.device)
    uniform = uniform * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)  # [B]
    logprobs = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    if not truncated:
        return tokens, logprobs, logprobs
    full = scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # [B]
    return tokens, logprobs, full
