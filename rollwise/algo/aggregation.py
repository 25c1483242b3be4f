"""Loss aggregations: `fn(per_token_loss [N,T], mask [N,T], num_tokens=None, num_seqs=None, **options)
-> scalar`.

Micro-batching contract. A trainer that splits one batch into micro-batches and accumulates gradients
must pass the WHOLE batch's normalisers to every call: `num_tokens` (trained tokens of the batch) and
`num_seqs` (rows of the batch with at least one trained token), e.g. from `batch_normalisers(masks)`.
Then the sum of the micro-batch aggregates equals the aggregate of the whole batch, for every entry
(a row is never split across micro-batches, so per-row quantities stay local). Without them each call
normalises by its own counts. Every entry accepts both keywords and ignores the one it does not use.
"""

from __future__ import annotations

from typing import Iterable

import torch

from rollwise.algo.common import seq_masked_mean, valid_rows
from rollwise.algo.registries import AGGREGATIONS


def _denominator(given: float | None, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`given` (a batch-global count) when set, else the micro-batch's own count; at least 1."""
    value = local if given is None else torch.as_tensor(given, dtype=like.dtype, device=like.device)
    return value.clamp(min=1)


def _masked(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, per_token_loss, torch.zeros_like(per_token_loss))


def batch_normalisers(masks: Iterable[torch.Tensor]) -> dict[str, float]:
    """Batch-global `num_tokens` and `num_seqs` over the micro-batch masks `[N_k, T_k]` of one batch.

    Counted exactly as the aggregations count them locally: trained tokens, and rows with >= 1 trained token.
    """
    num_tokens, num_seqs = 0.0, 0.0
    for mask in masks:
        num_tokens += float(mask.sum())
        num_seqs += float(valid_rows(mask).sum())
    return {"num_tokens": num_tokens, "num_seqs": num_seqs}


@AGGREGATIONS.register("token_mean")
def token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None, num_seqs: float | None = None
) -> torch.Tensor:
    """Mean over all trained tokens of the batch (DAPO's token-level loss, Yu et al. 2025).

    `sum_{i,t} mask * loss / num_tokens`; `num_tokens` overrides the denominator so that micro-batches of
    one batch sum to the batch mean. `num_seqs` is ignored.
    """
    return _masked(per_token_loss, mask).sum() / _denominator(num_tokens, mask.sum(), per_token_loss)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None, num_seqs: float | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (the GRPO paper's sample-level loss; GSPO).

    `sum_i [ sum_t mask * loss / |y_i| ] / num_seqs`, rows without trained tokens contribute 0.
    `num_seqs` overrides the number of sequences; `num_tokens` is ignored.
    """
    per_seq = seq_masked_mean(per_token_loss, mask)  # [N]
    return per_seq.sum() / _denominator(num_seqs, valid_rows(mask).sum(), per_token_loss)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    per_token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None, num_seqs: float | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum: `sum_{i,t} mask * loss / num_seqs`.

    `num_seqs` overrides the number of sequences; `num_tokens` is ignored.
    """
    return _masked(per_token_loss, mask).sum() / _denominator(num_seqs, valid_rows(mask).sum(), per_token_loss)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """Dr. GRPO's constant normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    `sum_{i,t} mask * loss / (num_seqs * norm_tokens)`: every token weighs the same whatever the length of
    its response. `norm_tokens` should be a constant such as the generation budget (`max_new_tokens`);
    when None it is this tensor's width T, which varies with padding, so pass it for exact micro-batch
    sums. `num_seqs` overrides the number of sequences; `num_tokens` is ignored.
    """
    width = float(mask.shape[-1]) if norm_tokens is None else float(norm_tokens)
    seqs = _denominator(num_seqs, valid_rows(mask).sum(), per_token_loss)
    return _masked(per_token_loss, mask).sum() / (seqs * max(width, 1.0))

