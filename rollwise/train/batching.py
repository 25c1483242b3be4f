"""Turn samples into padded tensors, in micro-batches bounded by a token budget.

Two layouts share one `MicroBatch` type:

- plain: one row per sample, `[prompt, response]`, right-padded, 2-D attention mask.
- prompt-shared: one row per prompt, `[prompt, response 1, ..., response k]`, with a 4-D mask in which each
  response sees the prompt and itself only and positions restart after the prompt. The prompt is computed
  once for its k responses; log-probabilities and gradients equal those of the plain layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.train.shared_attention import RowLayout
from rollwise.types import Sample


@dataclass
class MicroBatch:
    """Rows fed to the model plus per-sample response tensors.

    Row tensors: input_ids, position_ids [R, L]; attention_mask [R, L] (plain) or [R, 1, L, L] bool (shared).
    Sample tensors [S, T] over response positions (T = longest response): targets, loss_mask,
    behaviour_logp, valid (real response token), pred_index (index into the flattened [R * L] hidden
    states of the position that predicts the token). advantages: [S].
    """

    samples: list[Sample]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logp: torch.Tensor
    valid: torch.Tensor
    pred_index: torch.Tensor
    advantages: torch.Tensor
    real_tokens: int
    layout: list | None = None  # prompt-shared rows: one `RowLayout` per row (block attention)

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()


def _units(samples: list[Sample], share_prompt: bool) -> list[list[Sample]]:
    """Samples that go in one row: those with the same prompt ids when sharing, else one each."""
    if not share_prompt:
        return [[s] for s in samples]
    by_prompt: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    return list(by_prompt.values())


def _row_tokens(unit: list[Sample]) -> int:
    return len(unit[0].prompt_ids) + sum(len(s.response_ids) for s in unit)


def split_by_tokens(samples: list[Sample], max_tokens: int, share_prompt: bool = False) -> list[list[Sample]]:
    """Group samples into micro-batches whose padded size (rows x longest row) stays within `max_tokens`.

    Rows are sorted by length so padding stays small. With `share_prompt`, a prompt whose responses exceed
    the budget together is split over several rows (each repeats the prompt).
    """
    units: list[list[Sample]] = []
    for unit in _units(samples, share_prompt):
        current: list[Sample] = []
        for s in sorted(unit, key=lambda s: len(s.response_ids)):
            if current and _row_tokens(current + [s]) > max_tokens:
                units.append(current)
                current = []
            current.append(s)
        units.append(current)
    units.sort(key=_row_tokens)
    batches: list[list[Sample]] = []
    rows: list[list[Sample]] = []
    for unit in units:
        if rows and (len(rows) + 1) * _row_tokens(unit) > max_tokens:
            batches.append([s for r in rows for s in r])
            rows = []
        rows.append(unit)
    if rows:
        batches.append([s for r in rows for s in r])
    return batches


def collate(samples: list[Sample], pad_id: int, share_prompt: bool = False) -> MicroBatch:
    """Build a MicroBatch; with `share_prompt`, samples with equal prompt ids share one row."""
    rows = _units(samples, share_prompt)
    ordered = [s for r in rows for s in r]
    width = max(_row_tokens(r) for r in rows)
    R, S, T = len(rows), len(ordered), max(len(s.response_ids) for s in ordered)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    positions = torch.zeros((R, width), dtype=torch.long)
    segment = torch.full((R, width), -1, dtype=torch.long)  # -2 prompt, i >= 0 response i, -1 padding
    pred_index = torch.zeros((S, T), dtype=torch.long)
    k = 0
    layout = []
    for r, unit in enumerate(rows):
        P = len(unit[0].prompt_ids)
        spans = []
        input_ids[r, :P] = torch.tensor(unit[0].prompt_ids)
        positions[r, :P] = torch.arange(P)
        segment[r, :P] = -2
        start = P
        for i, s in enumerate(unit):
            n = len(s.response_ids)
            input_ids[r, start : start + n] = torch.tensor(s.response_ids)
            positions[r, start : start + n] = torch.arange(P, P + n)
            segment[r, start : start + n] = i
            # token 0 is predicted by the last prompt position, token t by the response's token t - 1
            if n:
                pred_index[k, :n] = r * width + torch.cat([torch.tensor([P - 1]), torch.arange(start, start + n - 1)])
                spans.append((start, n))
            start += n
            k += 1
        layout.append(RowLayout.build(P, spans) if spans else None)
    real = int((segment != -1).sum())
    attention = _shared_mask(segment) if share_prompt else (segment != -1).long()
    targets, loss_mask, blp, valid = _sample_tensors(ordered, T, pad_id)
    adv = torch.tensor([s.advantage for s in ordered], dtype=torch.float32)
    shared_layout = layout if share_prompt and all(row is not None for row in layout) else None
    return MicroBatch(ordered, input_ids, attention, positions, targets, loss_mask, blp, valid, pred_index, adv, real,
                      shared_layout)


def _shared_mask(segment: torch.Tensor) -> torch.Tensor:
    """[R, 1, L, L] bool: causal, prompt visible to all, responses see only themselves (and the prompt).

    Padding queries see only themselves, so no softmax row is empty.
    """
    L = segment.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # [L, L]
    q, k = segment[:, :, None], segment[:, None, :]  # [R, L, 1], [R, 1, L]
    allowed = causal & ((k == -2) | ((q == k) & (q >= 0)))
    allowed |= torch.eye(L, dtype=torch.bool)[None]
    return allowed[:, None]


def _sample_tensors(samples: list[Sample], T: int, pad_id: int):
    S = len(samples)
    targets = torch.full((S, T), pad_id, dtype=torch.long)
    mask = torch.zeros((S, T), dtype=torch.float32)
    blp = torch.zeros((S, T), dtype=torch.float32)
    valid = torch.zeros((S, T), dtype=torch.bool)
    for b, s in enumerate(samples):
        n = len(s.response_ids)
        targets[b, :n] = torch.tensor(s.response_ids)
        mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        blp[b, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        valid[b, :n] = True
    return targets, mask, blp, valid
