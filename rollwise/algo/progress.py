"""The progress advantage: step scores from the log-ratio of the RL policy to its reference.

After the paper that names it "progress advantage": under KL-regularised RL the log-probability ratio
log pi(a|s) / pi_ref(a|s) between the RL-trained policy and its reference recovers the optimal advantage of each
step (up to the KL coefficient). It is a byproduct of RL training: no process reward model, no annotation.
`rollwise.methods.progress` feeds it the trainer's log-probs and a frozen reference's; this module is the math.
"""

from __future__ import annotations

import torch

from rollwise.algo.registries import TOKEN_ADVANTAGES


def step_index(mask: torch.Tensor, step_tokens: int) -> torch.Tensor:
    """The reasoning step of each trained token: its rank among its row's trained tokens // `step_tokens`.
    `[N, T] -> [N, T]` long (positions outside the mask get the step of the last trained token before them)."""
    rank = torch.cumsum((mask > 0).long(), dim=-1) - 1
    return rank.clamp(min=0) // step_tokens


@TOKEN_ADVANTAGES.register("progress")
@torch.no_grad()
def progress(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, coef: float = 0.5,
             step_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Progress advantage (outcome advantage plus the step's implicit advantage from log pi / pi_ref).

    rewards: [N] per-response outcome advantages (e.g. GRPO's; every trained token gets its row's) or [N, T];
    values: [N, T] the per-token log-ratio log pi(y_t) - log pi_ref(y_t) (the implicit value increments);
    mask: [N, T]. Each row's trained tokens are cut into steps of `step_tokens` consecutive trained tokens; step k's
    progress is the change of the cumulative log-ratio L over it, P_k = sum_{t in k} values_t. Then, on trained
    tokens,
        advantage_t = rewards_t + coef x P_{k(t)}        returns_t = L_t = sum_{s <= t, trained} values_s
    (returns: the implicit value after token t). Both are 0 outside the mask, float32.
    The paper scores steps with log pi / pi_ref alone (test-time ranking, failure attribution); adding it to the
    outcome advantage with weight `coef` (its beta) is how a training run uses it here.
    """
    maskf = (mask > 0).to(torch.float32)
    ratio = values.to(torch.float32) * maskf
    steps = step_index(mask, step_tokens)  # [N, T]
    per_step = torch.zeros_like(ratio).scatter_add_(1, steps, ratio)  # [N, T]: P_k at index k (k < T)
    step_progress = per_step.gather(1, steps)  # [N, T]: P_{k(t)}
    base = rewards.to(torch.float32)
    base = base[:, None].expand_as(ratio) if base.dim() == 1 else base
    advantages = (base + coef * step_progress) * maskf
    returns = torch.cumsum(ratio, dim=-1) * maskf
    return advantages, returns
