"""Distillation objectives: pure functions on log-probs or logits, masked.

`distill(name, student, teacher, mask, **options) -> (per_token [N, T], metrics)`:

| name | student / teacher | output |
|---|---|---|
| `opd` | sampled-token log-probs `[N, T]` | a token-level ADVANTAGE `A_t = A_reward - coef * (logp_student_t - logp_teacher_t)` |
| `gkd` | logits `[N, T, V]` | per-token generalized JSD over beta (1 - beta), continuous in beta (a loss term) |
| `sft` | sampled-token log-probs `[N, T]` (teacher unused) | per-token negative log-likelihood (a loss term) |

Every output is 0 where `mask` is 0; the teacher never receives a gradient (it is detached); `metrics` are
detached scalar tensors. The loop's use of them (teachers, stages, routing, guards) is in `rollwise.distill`.
"""

from __future__ import annotations

import math

import torch

from rollwise.algo.common import masked_mean
from rollwise.algo.registries import DISTILL

Metrics = dict[str, torch.Tensor]


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, values, torch.zeros_like(values))


@DISTILL.register("opd")
def opd_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                  reward_advantage: torch.Tensor | float = 0.0, coef: float = 1.0) -> tuple[torch.Tensor, Metrics]:
    """On-policy distillation as a token-level advantage (Agarwal et al. 2024, "On-Policy Distillation of
    Language Models: Learning from Self-Generated Mistakes"; the per-token reverse-KL reward of the OPD
    reports): `A_t = A_reward - coef * (logp_student_t - logp_teacher_t)` on the sampled tokens.

    `student_logp`: the sampling policy's log-probs of the sampled tokens `[N, T]` (the behaviour / old ones,
    no gradient needed); `teacher_logp`: the teacher's of the same tokens `[N, T]`; `reward_advantage`: the
    outcome advantage `[N]` or `[N, T]` or a number (0 = pure OPD). The mean of `logp_s - logp_t` over the mask
    is a sampled estimate of KL(student || teacher) per token (`teacher_kl`).
    """
    gap = (student_logp - teacher_logp).detach().float()  # [N, T]
    base = torch.as_tensor(reward_advantage, dtype=torch.float32, device=gap.device)
    if base.dim() == 1:
        base = base[:, None]
    advantage = _masked(base - coef * gap, mask)
    return advantage, {"teacher_kl": masked_mean(gap, mask)}


@DISTILL.register("gkd")
def gkd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, beta: float = 0.5,
        temperature: float = 1.0) -> tuple[torch.Tensor, Metrics]:
    """GKD's generalized JSD (Agarwal et al. 2024) over the full vocabulary, normalised, per token `[N, T]`.

    `S`, `T`: the student's and teacher's distributions at `temperature` (logits `[N, T, V]`). See
    `generalized_jsd` for what is computed: `JSD_beta / (beta * (1 - beta))`, whose limits are the forward
    KL(T || S) at beta = 0 and the reverse KL(S || T) at beta = 1, so a sweep over beta is continuous.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gkd: beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"gkd: temperature must be > 0, got {temperature}")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    per_token = _masked(generalized_jsd(log_s, log_t, beta), mask)
    return per_token, {"gkd": masked_mean(per_token.detach(), mask)}


def generalized_jsd(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """The normalised generalized JSD of GKD from normalised log-probs `[..., V] -> [...]` (teacher detached).

    With `M = beta * T + (1 - beta) * S`, GKD's `JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)` goes to 0
    at both ends (M -> S as beta -> 0, M -> T as beta -> 1). Expanding around beta = 0 with `r = T / S - 1`:
    `KL(S || M) = beta^2 chi2(T || S) / 2 + O(beta^3)` and `KL(T || M) = KL(T || S) - beta chi2(T || S) + O(beta^2)`,
    so `JSD_beta = beta KL(T || S) - beta^2 chi2(T || S) / 2 + O(beta^3)`; the same holds at 1 with S and T
    swapped. What is computed is therefore

        JSD_beta / (beta * (1 - beta))         0 < beta < 1
        KL(T || S)  (forward)                  beta = 0
        KL(S || T)  (reverse)                  beta = 1

    which is continuous on [0, 1]: `f(beta) = KL(T || S) + beta (KL(T || S) - chi2(T || S) / 2) + O(beta^2)`.
    At beta = 0.5 it is 4 x GKD's (and TRL's) JSD; multiply `distill.coef` by beta * (1 - beta) for their scale.
    The mixture is computed in float64 (returned in the input dtype): the division by beta * (1 - beta) would
    otherwise magnify float32 rounding of KL(S || M) by up to 1 / beta.
    """
    log_t = log_t.detach()
    if beta == 0.0:
        return kl(log_t, log_s)
    if beta == 1.0:
        return kl(log_s, log_t)
    s64, t64 = log_s.double(), log_t.double()
    log_m = torch.logaddexp(t64 + math.log(beta), s64 + math.log1p(-beta))
    jsd = beta * kl(t64, log_m) + (1.0 - beta) * kl(s64, log_m)
    return (jsd / (beta * (1.0 - beta))).to(log_s.dtype)


gkd.takes = "logits"  # the contract test feeds [N, T, V] logits; the others take [N, T] log-probs


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) over the last dimension from log-probabilities: `sum_v p_v (log p_v - log q_v)`, `[..., V] -> [...]`."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@DISTILL.register("sft")
def sft_nll(student_logp: torch.Tensor, teacher_logp: torch.Tensor | None, mask: torch.Tensor
            ) -> tuple[torch.Tensor, Metrics]:
    """Supervised fine-tuning: the negative log-likelihood of demonstration tokens, per token `[N, T]`
    (`student_logp` with gradient; `teacher_logp` unused)."""
    per_token = _masked(-student_logp, mask)
    return per_token, {"nll": masked_mean(per_token.detach(), mask)}


def distill(name: str, student: torch.Tensor, teacher: torch.Tensor | None, mask: torch.Tensor,
            **options) -> tuple[torch.Tensor, Metrics]:
    """The public entry point: `DISTILL[name](student, teacher, mask, **options)` (see the module docstring)."""
    return DISTILL.get(name)(student, teacher, mask, **options)
