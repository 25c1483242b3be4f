"""What a step's distillation adds to the trainer's loss: the OPD token advantage, the GKD and SFT loss terms.

The trainer calls `StepTerms.start_step` once per update, `StepTerms.advantages` before its policy loss and
`StepTerms.extra_loss` after it, per micro-batch (`rollwise.train.trainer.Trainer._backward`), and
`StepTerms.step_metrics` at the end. Per-sample weights `mb.loss_weights [S, 3]` (reward advantage, teacher term,
SFT NLL) come from Self-Routing and the stage; a sample the teacher did not score (NaN in `mb.teacher_logp`: a
replayed sample, whose scores the replay buffer clears) gets no teacher term.

    A_t  = w_reward * reward_weight * A_reward - w_teacher * coef * (logp_own_t - logp_teacher_t)      (opd)
    loss = policy_loss(A) + coef * agg(w_teacher * GJSD_beta(T_topk+tail || S_topk+tail))               (gkd)
         + sft_coef * agg(w_sft * -logp_t)                                                              (sft)

`logp_own` is the student's own untruncated log-prob of the sampled token (no top-k / top-p, no TRB mixture):
the trainer's old log-probs, or the engine's `full_logp` with `train.old_logprobs = "behaviour"`.
An SFT stage (`sft_only`) trains the NLL alone (no policy loss: demonstrations have no advantage).

The `distill/*` metrics are over the whole step's batch, not means of per-micro-batch values: each micro-batch's
first pass (before any update of this step) records its per-token gaps, entropies and term sums, and
`step_metrics` takes the means and the top-gap share once over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollwise import algo
from rollwise.algo.distillation import generalized_jsd
from rollwise.distill.guards import gap_metrics
from rollwise.train.batching import MicroBatch
from rollwise.train.logprobs import CHUNK_TOKENS, row_chunks


@dataclass
class StepTerms:
    """One RL step's distillation settings (the loop builds them from `[distill]` and the stage)."""

    teacher: bool = False  # this stage's samples were scored by the teacher
    objective: str = "opd"
    coef: float = 1.0
    reward_weight: float = 1.0
    gkd_beta: float = 0.5
    temperature: float = 1.0  # gkd: the student's logits are compared at the teacher's temperature
    sft_coef: float = 0.0
    sft_only: bool = False
    chunk_tokens: int = CHUNK_TOKENS  # gkd: response positions per LM-head chunk
    record: "StepRecord" = field(default_factory=lambda: StepRecord(), repr=False, compare=False)

    @property
    def needs_logits(self) -> bool:
        return self.teacher and self.objective == "gkd"

    def start_step(self) -> None:
        """Forget the metrics of an earlier step (the trainer calls this before its first micro-batch)."""
        self.record = StepRecord()

    def step_metrics(self) -> dict[str, float]:
        """`distill/*` of the step's batch (see the module docstring); {} when nothing was recorded."""
        return self.record.metrics(opd=self.teacher and self.objective == "opd")

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages the policy loss uses: `[S]` (no teacher term) or `[S, T]` (opd), and this micro-batch's
        `distill/*` gap metrics (the trainer reports `step_metrics` instead, over the whole batch).

        `own_logp [S, T]`: the student's own untruncated log-probs of the sampled tokens (no gradient needed);
        `entropy [S, T]`: the policy's, recorded with the gaps for `distill/entropy_at_top_gap`."""
        w = mb.loss_weights  # [S, 3]
        route = w[:, 0] if mb.advantages.dim() == 1 else w[:, 0:1]  # outcome [S] or critic (gae) [S, T] advantages
        base = mb.advantages * route * (self.reward_weight if self.teacher else 1.0)
        if not self.teacher or mb.teacher_logp is None:
            return base, {}
        scored = torch.isfinite(mb.teacher_logp)  # [S, T]
        teacher = torch.where(scored, mb.teacher_logp, own_logp)  # unscored tokens: no gap
        gap, mask = own_logp - teacher, mb.loss_mask * scored
        self.record.gaps(mb, gap, mask, entropy)
        alone = StepRecord()
        alone.gaps(mb, gap, mask, entropy)
        metrics = alone.metrics(opd=self.objective == "opd")
        if self.objective != "opd":
            return base, metrics
        adv, _ = algo.distill("opd", own_logp, teacher, mb.loss_mask, reward_advantage=base,
                              coef=self.coef * w[:, 1:2])
        return adv, metrics

    def extra_loss(self, logp: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor, mb: MicroBatch,
                   aggregate) -> tuple[torch.Tensor, dict[str, float]]:
        """GKD and SFT loss terms of one micro-batch (a 0-d tensor, 0.0 when neither applies) and their means over
        this micro-batch's tokens (the trainer reports `step_metrics` instead, over the whole batch).

        `logp [S, T]` the policy's log-probs (with gradient); `hidden [n, H]` its final hidden states at the valid
        response positions (gkd only); `weight [V, H]` the LM head; `aggregate(per_token, mask)` the run's
        loss aggregation."""
        loss, alone = logp.new_zeros(()), StepRecord()
        w = mb.loss_weights
        sft_coef = 1.0 if self.sft_only else self.sft_coef
        if sft_coef > 0 and bool((w[:, 2] > 0).any()):
            sft_mask = mb.loss_mask * (w[:, 2:3] > 0)  # [S, T]
            per_token, _ = algo.distill("sft", logp, None, sft_mask)
            loss = loss + sft_coef * aggregate(per_token * w[:, 2:3], mb.loss_mask)
            for record in (self.record, alone):
                record.total(mb, "distill/sft_nll", per_token.detach().sum(), sft_mask.sum())
        if self.needs_logits and mb.teacher_topk is not None and hidden is not None:
            per_token = gkd_topk(hidden, weight, mb, self.gkd_beta, self.temperature, self.chunk_tokens)  # [S, T]
            mask = mb.loss_mask * torch.isfinite(mb.teacher_logp)
            loss = loss + self.coef * aggregate(per_token * w[:, 1:2] * mask, mb.loss_mask)
            for record in (self.record, alone):
                record.total(mb, "distill/gkd", (per_token.detach() * mask).sum(), mask.sum())
        return loss, alone.metrics(opd=False)


@dataclass
class StepRecord:
    """Per-token gaps and term sums of one step's micro-batches, the first pass over each (by identity)."""

    rows: dict = field(default_factory=dict)  # id(mb) -> (gap [S, T], mask [S, T], entropy [S, T] or None)
    sums: dict = field(default_factory=dict)  # metric -> {id(mb): (sum, count)}

    def gaps(self, mb: MicroBatch, gap: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None) -> None:
        if id(mb) not in self.rows:
            self.rows[id(mb)] = (gap.detach().float(), mask.detach().float(),
                                 None if entropy is None else entropy.detach().float())

    def total(self, mb: MicroBatch, key: str, value: torch.Tensor, count: torch.Tensor) -> None:
        self.sums.setdefault(key, {}).setdefault(id(mb), (float(value), float(count)))

    def metrics(self, opd: bool) -> dict[str, float]:
        out = {}
        for key, parts in self.sums.items():
            count = sum(c for _, c in parts.values())
            if count > 0:
                out[key] = sum(v for v, _ in parts.values()) / count
        if self.rows:
            rows = list(self.rows.values())
            width = max(gap.shape[1] for gap, _, _ in rows)
            pad = lambda t: F.pad(t, (0, width - t.shape[1]))  # noqa: E731  [S, T] -> [S, width], zeros
            entropy = None if any(e is None for _, _, e in rows) else torch.cat([pad(e) for _, _, e in rows])
            gaps = gap_metrics(torch.cat([pad(g) for g, _, _ in rows]), torch.cat([pad(m) for _, m, _ in rows]),
                               entropy)
            out.update(gaps)
            if opd and "distill/gap_mean" in gaps:
                out["distill/teacher_kl"] = gaps["distill/gap_mean"]
        return out


def gkd_topk(hidden: torch.Tensor, head: torch.Tensor, mb: MicroBatch, beta: float, temperature: float,
             chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """Normalised generalized JSD (`rollwise.algo.distillation.generalized_jsd`) over the teacher's top-k tokens
    plus one tail bucket, per response token `[S, T]`.

    Both distributions are reduced to k + 1 buckets: the teacher's top-k ids, and everything else (log of one
    minus their mass). The student's come from its full softmax at `temperature` (`hidden [n, H]` of the valid
    positions, `head [V, H]`); the teacher's were stored at scoring time. The student's `[n, V]` logits are
    never built for the whole micro-batch: rows go through the head `chunk_tokens` at a time
    (`rollwise.train.logprobs.row_chunks`), and each chunk is recomputed in the backward pass
    (`torch.utils.checkpoint`) instead of keeping its `[chunk, V]` softmax, so the peak is a few
    `chunk_tokens x V` fp32 blocks whatever n is."""
    t_lp, ids = mb.teacher_topk  # [S, T, k] each
    valid = mb.valid
    S, T = mb.targets.shape
    h = (hidden / temperature).to(head.dtype)  # [n, H]
    teacher = with_tail(t_lp[valid])  # [n, k + 1]
    top_ids = ids[valid]  # [n, k]
    if h.shape[0] == 0:
        return torch.zeros(S, T)
    per = torch.cat([checkpoint(_gkd_rows, h[rows], head, top_ids[rows], teacher[rows], beta, use_reentrant=False)
                     for rows in row_chunks(h.shape[0], chunk_tokens)])  # [n]
    return torch.zeros(S, T, dtype=per.dtype).masked_scatter(valid, per)


def _gkd_rows(h: torch.Tensor, head: torch.Tensor, top_ids: torch.Tensor, teacher: torch.Tensor,
              beta: float) -> torch.Tensor:
    """One chunk: `h [C, H]`, `head [V, H]`, `top_ids [C, k]`, teacher buckets `[C, k + 1]` -> GJSD `[C]`."""
    student = torch.log_softmax((h @ head.T).float(), dim=-1).gather(-1, top_ids)  # [C, k]
    return generalized_jsd(with_tail(student), teacher, beta)


def with_tail(top_logp: torch.Tensor) -> torch.Tensor:
    """`[..., k]` log-probs of k tokens -> `[..., k + 1]`: the tokens and the rest of the vocabulary."""
    mass = top_logp.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-6)
    return torch.cat([top_logp, torch.log1p(-mass)], dim=-1)
