"""Turn samples into padded tensors, in micro-batches bounded by a token budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.types import Sample


@dataclass
class MicroBatch:
    """Right-padded `[prompt + response]` rows for one forward/backward.

    input_ids, attention_mask: [B, L]; targets, loss_mask, behaviour_logp, advantages_tok: [B, T]
    over response positions (T = longest response); `resp_start[b]` = prompt length of row b.
    """

    samples: list[Sample]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    resp_start: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()


def split_by_tokens(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Sort by length and group so that rows * longest row <= max_tokens (at least one row each)."""
    ordered = sorted(samples, key=lambda s: s.num_tokens)
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    for s in ordered:
        if current and (len(current) + 1) * s.num_tokens > max_tokens:
            groups.append(current)
            current = []
        current.append(s)
    if current:
        groups.append(current)
    return groups


def collate(samples: list[Sample], pad_id: int) -> MicroBatch:
    """Build a right-padded MicroBatch from samples."""
    width = max(s.num_tokens for s in samples)
    resp_len = max(len(s.response_ids) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    targets = torch.full((B, resp_len), pad_id, dtype=torch.long)
    mask = torch.zeros((B, resp_len), dtype=torch.float32)
    blp = torch.zeros((B, resp_len), dtype=torch.float32)
    for b, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        n, r = len(seq), len(s.response_ids)
        input_ids[b, :n] = torch.tensor(seq)
        attn[b, :n] = 1
        targets[b, :r] = torch.tensor(s.response_ids)
        mask[b, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        blp[b, :r] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    resp_start = torch.tensor([len(s.prompt_ids) for s in samples])
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(samples, input_ids, attn, resp_start, targets, mask, blp, adv)
