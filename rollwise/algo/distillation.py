"""Distillation objectives: pure functions on log-probs or logits, masked.

`distill(name, student, teacher, mask, **options) -> (per_token [N, T], metrics)`:

| name | student / teacher | output |
|---|---|---|
| `opd` | sampled-token log-probs `[N, T]` | a token-level ADVANTAGE `A_t = A_reward - coef * (logp_student_t - logp_teacher_t)` |
| `gkd` | logits `[N, T, V]` | per-token generalized JSD (a loss term) |
| `sft` | sampled-token log-probs `[N, T]` (teacher unused) | per-token negative log-likelihood (a loss term) |

Every output is 0 where `mask` is 0; the teacher never receives a gradient (it is detached); `metrics` are
detached scalar tensors. The loop's use of them (teachers, stages, routing, guards) is in `rollwise.distill`.
"""

from __future__ import annotations

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
    """Generalized JSD of GKD (Agarwal et al. 2024) over the full vocabulary, per token `[N, T]`.

    With `S`, `T` the student's and teacher's distributions at `temperature` and `M = beta * T + (1 - beta) * S`:
    `beta * KL(T || M) + (1 - beta) * KL(S || M)` for 0 < beta < 1; `beta = 0` is the forward KL(T || S) and
    `beta = 1` the reverse KL(S || T) (the limits of the interpolation, taken exactly). Logits `[N, T, V]`.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gkd: beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"gkd: temperature must be > 0, got {temperature}")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if beta == 0.0:
        per_token = kl(log_t, log_s)
    elif beta == 1.0:
        per_token = kl(log_s, log_t)
    else:
        log_m = torch.logsumexp(torch.stack([log_t + torch.log(torch.tensor(beta)),
                                             log_s + torch.log(torch.tensor(1.0 - beta))]), dim=0)
        per_token = beta * kl(log_t, log_m) + (1.0 - beta) * kl(log_s, log_m)
    per_token = _masked(per_token, mask)
    return per_token, {"gkd": masked_mean(per_token.detach(), mask)}


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
