"""`hargo`: Heterogeneity-Aware Reward-Guided Optimization (HARGO, "confidence-modulated advantage").

The abstract: per-response importance weights from a confidence-modulated advantage; a *discrimination* signal from
the group's reward contrast and a *confidence* signal from the reference model's log-probabilities modulate the
advantage, and the per-response weights are computed from the modulated advantage; no task-type labels.

What the abstract leaves open, filled in here (per response i of group g, A_i its outcome advantage, e.g. GRPO's):

    D_g = min(1, 2 std_g(r))                       discrimination: the group's reward contrast, in [0, 1]
                                                   (rewards in [0, 1]: 1 for a half-right group, 0 for a uniform one)
    C_i = exp(mean_t log pi_ref(y_t))              confidence: the reference's per-token geometric-mean probability
    u_i = 1 - C_i  if A_i > 0  else  C_i           surprise: a right answer the reference found unlikely, or a
                                                   wrong one it was sure of, carries more information
    M_i = A_i (1 + alpha D_g) (1 + gamma u_i)      the confidence-modulated advantage
    z_i = |M_i| / mean_j |M_j|                     the modulated magnitude relative to the batch (scale-free)
    w_i = n softmax_j(z_j / tau)_i                 over the n responses of the batch with A_j != 0 (mean weight 1)
    A'_i = w_i A_i                                 what the policy loss trains (A_i = 0 stays 0)

The weights are normalised over the whole batch (not within a group), so that groups of high contrast and
responses of high surprise take a larger share of the update: the heterogeneity across prompts the paper targets,
without task labels. `tau -> inf` gives w = 1 (plain GRPO). The reference is the run's starting model, held by the
method (`rollwise.methods.reference`); the weights are computed once per step on the fresh samples (replayed ones
keep the advantage they were trained with). Keys: `[algo.hargo] alpha, gamma, temperature`.
"""

from __future__ import annotations

import torch

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput, outcome_advantage_errors
from rollwise.methods.reference import FrozenReference


def reward_contrast(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """D per response: min(1, 2 x population std of its group's rewards). `[N], [N] -> [N]`."""
    out = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        at = group_ids == g
        out[at] = torch.clamp(2.0 * rewards[at].float().std(unbiased=False), max=1.0)
    return out


def hargo_weights(advantages: torch.Tensor, contrast: torch.Tensor, confidence: torch.Tensor, alpha: float,
                  gamma: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights w [N], modulated advantages M [N]) from A, D, C `[N]` each (see the module docstring).

    Responses with A = 0 get weight 0 and take no share of the softmax."""
    a = advantages.float()
    surprise = torch.where(a > 0, 1.0 - confidence, confidence)
    modulated = a * (1.0 + alpha * contrast) * (1.0 + gamma * surprise)
    active = a != 0
    weights = torch.zeros_like(a)
    if active.any():
        n = int(active.sum())
        magnitude = modulated[active].abs()
        weights[active] = n * torch.softmax(magnitude / magnitude.mean() / temperature, dim=0)
    return weights, modulated


class HargoOptions(MethodOptions, section="algo", name="hargo"):
    """`[algo.hargo]`."""

    alpha: float = Field(1.0, ge=0.0, description="strength of the group's reward contrast D in the modulated "
                         "advantage M = A (1 + alpha D)(1 + gamma u)")
    gamma: float = Field(1.0, ge=0.0, description="strength of the reference-confidence surprise u")
    temperature: float = Field(2.0, gt=0.0, description="per-response weights w = n softmax(|M| / mean|M| / "
                               "temperature) over the batch; larger = closer to plain GRPO (w = 1)")


class HARGO(Method):
    """Outcome advantages reweighted per response by HARGO (module docstring)."""

    options = HargoOptions

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.reference = FrozenReference(setup.cfg, setup.policy, setup.tokenizer)

    @classmethod
    def checks(cls, cfg) -> list[str]:
        return outcome_advantage_errors("hargo", cfg, "reweights outcome advantages")

    def prepare(self, step: StepInput) -> Prepared:
        samples = step.samples
        if not samples:
            return Prepared(samples)
        a = self.opts
        ref = self.reference.sample_logprobs(samples)
        confidence = torch.tensor([_confidence(ref[id(s)], s.loss_mask) for s in samples])
        rewards = torch.tensor([s.reward if s.train_reward is None else s.train_reward for s in samples])
        contrast = reward_contrast(rewards, torch.tensor([s.group_id for s in samples]))
        advantages = torch.tensor([s.advantage for s in samples])
        weights, modulated = hargo_weights(advantages, contrast, confidence, a.alpha, a.gamma, a.temperature)
        for s, w in zip(samples, weights.tolist()):  # in place: replay and the record know samples by identity
            s.advantage = float(w) * s.advantage
        out = samples
        active = advantages != 0
        metrics = {"hargo/confidence_mean": float(confidence.mean()), "hargo/contrast_mean": float(contrast.mean())}
        if active.any():
            w = weights[active]
            metrics.update({"hargo/weight_max": float(w.max()), "hargo/weight_min": float(w.min()),
                            "hargo/weight_std": float(w.std(unbiased=False))})
        info = {id(s): (float(c), float(w)) for s, c, w in zip(out, confidence.tolist(), weights.tolist())}

        def record(sample) -> dict:
            c, w = info.get(id(sample), (None, None))
            return {} if c is None else {"hargo_confidence": c, "hargo_weight": w}

        return Prepared(out, metrics=metrics, record=record)


def _confidence(ref_logp: torch.Tensor, loss_mask: list[int]) -> float:
    """exp of the mean reference log-prob over the response's trained tokens (1.0 for a response without any)."""
    mask = torch.tensor(loss_mask[: ref_logp.shape[0]], dtype=torch.float32)
    count = float(mask.sum())
    return float(torch.exp((ref_logp * mask).sum() / count)) if count else 1.0
