"""Index tensors that say, for a packed prompt-shared row, which keys each query attends to.

A packed row `[1, L]` holds units `[prompt, response 1, ..., response G]` end to end (`rollwise.train.batching`).
Each response sees its own prompt and itself; each prompt itself. Two ways to run that through one fused kernel
call per layer, each a gather of q/k/v into a dense batch and a gather of the outputs back into the row
(`rollwise.train.shared_attention`):

- `PrefixLayout` (CUDA): segments `[prompt, response i]` padded to W; `is_causal=True` inside each segment is
  exactly the visibility wanted; no mask, so FlashAttention with native grouped K/V runs it. Each unit's prompt
  queries run once per segment (only the first segment's prompt outputs are read).
- `SplitLayout` (CPU): one causal call over the units' prompts `[U, P_max]`, and one call with the responses'
  queries only `[N, L_r]` against `[prompt (padded to P_max), own response]` keys `[N, P_max + L_r]`, with a
  boolean mask that hides the prompt padding and keeps the response part causal. It computes
  `N * L_r * (P_max + L_r)` scores instead of `N * W^2`, about 3x faster than the prefix layout on PyTorch's CPU
  flash kernel at the default recipe's shape (BENCHMARKS.md); the mask is built once per micro-batch.

Padding repeats the last real position: a padded query's output is never read and a padded key is seen by
padded queries only, so both get exactly zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

Unit = tuple[int, int, list[tuple[int, int]]]  # (row start, prompt length P, [(start, n) per non-empty response])
CPU = torch.device("cpu")


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] long: each row padded by repeating its last entry."""
    return torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.long, device=CPU)


def _moved(layout, device: torch.device):
    return type(layout)(**{f.name: getattr(layout, f.name).to(device) for f in fields(layout)})


@dataclass
class PrefixLayout:
    """`gather` [N, W]: row position of segment token j; `scatter` [L]: index into the flattened `[N * W]`
    outputs that each row position reads (a prompt token: its unit's first segment)."""

    gather: torch.Tensor
    scatter: torch.Tensor

    @classmethod
    def build(cls, units: list[Unit], length: int) -> "PrefixLayout":
        segments = []
        for start, P, spans in units:
            prompt = list(range(start, start + P))
            segments += [prompt + list(range(s, s + n)) for s, n in spans or [(start + P, 0)]]
        width = max(map(len, segments))
        scatter, seen = [0] * length, set()
        for k, seg in enumerate(segments):
            for j, pos in enumerate(seg):
                if pos not in seen:  # a prompt position: its first segment; a response position: its only one
                    seen.add(pos)
                    scatter[pos] = k * width + j
        return cls(_padded(segments, width), torch.tensor(scatter, dtype=torch.long, device=CPU))


@dataclass
class SplitLayout:
    """`prompts` [U, P_max]: each unit's prompt positions; `queries` [N, L_r]: each response's positions; `keys`
    [N, P_max + L_r]: its unit's prompt then itself; `mask` [N, 1, L_r, P_max + L_r] bool; `query_pos` /
    `key_pos`: position ids of those queries and keys (for sliding windows); `scatter` [L]: index into the
    outputs `[U * P_max + N * L_r]` (prompts first) that each row position reads."""

    prompts: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    scatter: torch.Tensor

    @classmethod
    def build(cls, units: list[Unit], length: int) -> "SplitLayout":
        p_max = max(P for _, P, _ in units)
        l_r = max([n for _, _, spans in units for _, n in spans] or [1])
        prompts, queries, keys, masks, q_pos, k_pos = [], [], [], [], [], []
        scatter = [0] * length
        own = torch.ones(l_r, l_r, dtype=torch.bool, device=CPU).tril()
        for u, (start, P, spans) in enumerate(units):
            prompt = list(range(start, start + P))
            prompts.append(prompt)
            scatter[start:start + P] = range(u * p_max, u * p_max + P)
            for s, n in spans:
                first = len(units) * p_max + len(queries) * l_r
                scatter[s:s + n] = range(first, first + n)
                queries.append(list(range(s, s + n)))
                keys.append(prompt + [prompt[-1]] * (p_max - P) + queries[-1] + [s + n - 1] * (l_r - n))
                mask = torch.zeros(l_r, p_max + l_r, dtype=torch.bool, device=CPU)
                mask[:, :P], mask[:, p_max:] = True, own
                masks.append(mask)
                q_pos.append(list(range(P, P + l_r)))
                k_pos.append(list(range(p_max)) + list(range(P, P + l_r)))
        if not queries:  # every response empty: a response call with no rows
            return cls(_padded(prompts, p_max), *(torch.zeros(0, w, dtype=torch.long, device=CPU) for w in
                       (l_r, p_max + l_r)), torch.zeros(0, 1, l_r, p_max + l_r, dtype=torch.bool, device=CPU),
                       torch.zeros(0, l_r, dtype=torch.long, device=CPU),
                       torch.zeros(0, p_max + l_r, dtype=torch.long, device=CPU),
                       torch.tensor(scatter, dtype=torch.long, device=CPU))
        return cls(_padded(prompts, p_max), _padded(queries, l_r), _padded(keys, p_max + l_r),
                   torch.stack(masks)[:, None], torch.tensor(q_pos, device=CPU), torch.tensor(k_pos, device=CPU),
                   torch.tensor(scatter, dtype=torch.long, device=CPU))


@dataclass
class SegmentLayout:
    """Both layouts of one packed row (the attention picks by device) and, for `dense_mask`, each position's
    `unit` and `response` id within it (-1: the prompt) [L]."""

    prefix: PrefixLayout
    split: SplitLayout
    unit: torch.Tensor
    response: torch.Tensor

    @classmethod
    def build(cls, units: list[Unit], length: int) -> "SegmentLayout":
        """Built on the CPU from the units' places in the row; `to(device)` moves it with its micro-batch."""
        unit_ids, response_ids = [-1] * length, [-1] * length
        for u, (start, P, spans) in enumerate(units):
            unit_ids[start:start + P] = [u] * P
            for i, (s, n) in enumerate(spans):
                unit_ids[s:s + n], response_ids[s:s + n] = [u] * n, [i] * n
        return cls(PrefixLayout.build(units, length), SplitLayout.build(units, length),
                   torch.tensor(unit_ids, device=CPU), torch.tensor(response_ids, device=CPU))

    def to(self, device: torch.device) -> "SegmentLayout":
        return SegmentLayout(_moved(self.prefix, device), _moved(self.split, device), self.unit.to(device),
                             self.response.to(device))

    def dense_mask(self) -> torch.Tensor:
        """[1, 1, L, L] bool: what the segment attention computes, as a mask (for a model on another attention)."""
        L = self.unit.shape[0]
        causal = torch.ones(L, L, dtype=torch.bool, device=self.unit.device).tril()
        same_unit = self.unit[:, None] == self.unit[None, :]
        visible = (self.response[None, :] < 0) | (self.response[:, None] == self.response[None, :])
        allowed = (causal & same_unit & visible) | torch.eye(L, dtype=torch.bool, device=self.unit.device)
        return allowed[None, None]
