"""What a step's distillation adds to the trainer's loss: the OPD token advantage, the GKD and SFT loss terms.

The trainer calls `StepTerms.advantages` before its policy loss and `StepTerms.extra_loss` after it, per
micro-batch (`rollwise.train.trainer.Trainer._backward`). Per-sample weights `mb.loss_weights [S, 3]`
(reward advantage, teacher term, SFT NLL) come from Self-Routing and the stage; a sample the teacher did not
score (NaN in `mb.teacher_logp`) gets no teacher term.

    A_t  = w_reward * reward_weight * A_reward - w_teacher * coef * (logp_old_t - logp_teacher_t)     (opd)
    loss = policy_loss(A) + coef * agg(w_teacher * GJSD_beta(T_topk+tail || S_topk+tail))              (gkd)
         + sft_coef * agg(w_sft * -logp_t)                                                             (sft)

An SFT stage (`sft_only`) trains the NLL alone (no policy loss: demonstrations have no advantage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise import algo
from rollwise.train.batching import MicroBatch


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

    @property
    def needs_logits(self) -> bool:
        return self.teacher and self.objective == "gkd"

    def advantages(self, old_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages the policy loss uses: `[S]` (no teacher term) or `[S, T]` (opd), and `distill/*` (the
        gap metrics of the guards, with the policy's `entropy [S, T]` at the largest gaps)."""
        w = mb.loss_weights  # [S, 3]
        route = w[:, 0] if mb.advantages.dim() == 1 else w[:, 0:1]  # outcome [S] or critic (gae) [S, T] advantages
        base = mb.advantages * route * (self.reward_weight if self.teacher else 1.0)
        if not self.teacher or mb.teacher_logp is None:
            return base, {}
        scored = torch.isfinite(mb.teacher_logp)  # [S, T]
        teacher = torch.where(scored, mb.teacher_logp, old_logp)  # unscored tokens: no gap
        metrics = gap_metrics(old_logp - teacher, mb.loss_mask * scored, entropy)
        if self.objective != "opd":
            return base, metrics
        adv, out = algo.distill("opd", old_logp, teacher, mb.loss_mask, reward_advantage=base,
                                coef=self.coef * w[:, 1:2])
        metrics["distill/teacher_kl"] = float(out["teacher_kl"])
        return adv, metrics

    def extra_loss(self, logp: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor, mb: MicroBatch,
                   aggregate) -> tuple[torch.Tensor, dict[str, float]]:
        """GKD and SFT loss terms of one micro-batch (a 0-d tensor, 0.0 when neither applies).

        `logp [S, T]` the policy's log-probs (with gradient); `hidden [n, H]` its final hidden states at the valid
        response positions (gkd only); `weight [V, H]` the LM head; `aggregate(per_token, mask)` the run's
        loss aggregation."""
        loss, metrics = logp.new_zeros(()), {}
        w = mb.loss_weights
        sft_coef = 1.0 if self.sft_only else self.sft_coef
        if sft_coef > 0 and bool((w[:, 2] > 0).any()):
            per_token, m = algo.distill("sft", logp, None, mb.loss_mask * (w[:, 2:3] > 0))
            loss = loss + sft_coef * aggregate(per_token * w[:, 2:3], mb.loss_mask)
            metrics["distill/sft_nll"] = float(m["nll"])
        if self.needs_logits and mb.teacher_topk is not None and hidden is not None:
            per_token = gkd_topk(hidden, weight, mb, self.gkd_beta, self.temperature)  # [S, T]
            mask = mb.loss_mask * torch.isfinite(mb.teacher_logp)
            loss = loss + self.coef * aggregate(per_token * w[:, 1:2] * mask, mb.loss_mask)
            metrics["distill/gkd"] = float((per_token.detach() * mask).sum() / mask.sum().clamp(min=1))
        return loss, metrics


def gkd_topk(hidden: torch.Tensor, head: torch.Tensor, mb: MicroBatch, beta: float, temperature: float) -> torch.Tensor:
    """Generalized JSD over the teacher's top-k tokens plus one tail bucket, per response token `[S, T]`.

    Both distributions are reduced to k + 1 buckets: the teacher's top-k ids, and everything else (log of one
    minus their mass). The student's come from its full softmax at `temperature` (`hidden [n, H]` of the valid
    positions, `head [V, H]`); the teacher's were stored at scoring time."""
    t_lp, ids = mb.teacher_topk  # [S, T, k] each
    valid = mb.valid
    logits = (hidden / temperature).to(head.dtype) @ head.T  # [n, V]
    s_all = torch.log_softmax(logits.float(), dim=-1)
    s_top = s_all.gather(-1, ids[valid])  # [n, k]
    buckets_s = with_tail(s_top)
    buckets_t = with_tail(t_lp[valid])
    per = _gjsd(buckets_s, buckets_t, beta)  # [n]
    S, T = mb.targets.shape
    return torch.zeros(S, T, dtype=per.dtype).masked_scatter(valid, per)


def with_tail(top_logp: torch.Tensor) -> torch.Tensor:
    """`[..., k]` log-probs of k tokens -> `[..., k + 1]`: the tokens and the rest of the vocabulary."""
    mass = top_logp.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-6)
    return torch.cat([top_logp, torch.log1p(-mass)], dim=-1)


def _gjsd(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalized JSD on normalised log-probs (the same limits as `rollwise.algo.distill.gkd`)."""
    from rollwise.algo.distillation import kl

    log_t = log_t.detach()
    if beta == 0.0:
        return kl(log_t, log_s)
    if beta == 1.0:
        return kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + torch.log(torch.tensor(beta)),
                                         log_s + torch.log(torch.tensor(1.0 - beta))]), dim=0)
    return beta * kl(log_t, log_m) + (1.0 - beta) * kl(log_s, log_m)


def gap_metrics(gap: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None) -> dict[str, float]:
    """`distill/gap_*` and `distill/entropy_*` of `gap = logp_student - logp_teacher [S, T]` over `mask`."""
    from rollwise.distill.guards import gap_metrics as guard_gap_metrics

    return guard_gap_metrics(gap.detach(), mask, None if entropy is None else entropy.detach())
