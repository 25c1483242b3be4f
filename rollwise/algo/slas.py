"""SLAS (Super-Linear Advantage Shaping): the group-centred advantage without the prompt-level std, reshaped
super-linearly, then normalised over the batch (`algo.advantage = "slas"`, `algo.slas.power`).

    a_i = r_i - mean_g(r)                          (no division by the group std)
    s_i = sign(a_i) * |a_i| ** p                   (p = algo.slas.power, >= 1; p > 1 is super-linear)
    A_i = s_i / (std_batch(s) + eps)               (unbiased std over every sample of the step's batch)

Paper: SLAS, "Super-Linear Advantage Shaping" (GRPO post-training of text-to-image models; see the seeds'
abstracts). The abstract says: removing the prompt-level std term gives an ascent direction linear in the
advantage; SLAS extends the Fisher-Rao metric with an advantage-dependent weighting so that updates along
high-advantage directions are relaxed (amplified) and low-advantage ones tightened (suppressed); and a
batch-level normalisation stabilises training across reward scales. It gives no formula; what is filled in here,
and why:
- The advantage-dependent weighting is taken as the power law `sign(a) |a|^p`: the simplest odd, monotone map
  whose gain |s| / |a| = |a|^(p-1) grows with |a|, so large advantages are amplified relative to small ones
  (the ratio of two advantages' magnitudes becomes its p-th power) and the sign (direction) of every sample's
  update is kept. p = 1 is the linear direction (Dr. GRPO's advantage, batch-normalised): the control.
- Since the batch normalisation divides by the std of the shaped values, the result is invariant to the reward
  scale (`(c a)^p` and its std both scale by `c^p`), which is the stabilisation the abstract names; for the same
  reason no per-group rescaling before the power changes anything but the relative scale between groups.
- The batch normalisation divides by the std only, without subtracting the batch mean (REINFORCE++ subtracts
  it): subtracting it would flip the sign of small advantages, against the shaping's purpose. The shaped values
  of one group need not sum to 0: with binary rewards and solve rate q, a group sums to n q (1-q) (1-2q) at p = 2,
  so hard prompts (q < 1/2) are pushed up on net and easy ones down: part of the shaping, left as is.
- A batch whose shaped values are all 0 (every group uniform) gets advantage 0; a batch of one sample has std 0
  and gets 0 too (no signal to normalise).
"""

from __future__ import annotations

import torch

from rollwise.algo.advantages import group_stats
from pydantic import Field

from rollwise.algo.registries import ADVANTAGES
from rollwise.config_methods import MethodOptions

DEFAULT_POWER = 2.0


class SlasOptions(MethodOptions, section="algo", name="slas"):
    """`[algo.slas]` (with `algo.advantage = "slas"`)."""

    power: float = Field(DEFAULT_POWER, ge=1.0, le=8.0, description="exponent p of the super-linear shaping "
                         "sign(a)|a|^p of the group-centred advantage before the batch normalisation; p > 1 "
                         "amplifies large advantages over small ones, 1 = linear control")


def slas_shape(centred: torch.Tensor, power: float) -> torch.Tensor:
    """`sign(a) |a|^power` elementwise: [N] -> [N] (same dtype). ValueError naming `algo.slas.power` when the
    power is below 1 or not finite."""
    if not (1.0 <= power < float("inf")):
        raise ValueError(f"algo.slas.power = {power}: must be a finite number >= 1 (p > 1 is super-linear; "
                         "1 is the linear control)")
    return torch.sign(centred) * centred.abs().pow(power)


@ADVANTAGES.register("slas")
def slas(rewards: torch.Tensor, group_ids: torch.Tensor, power: float = DEFAULT_POWER,
         eps: float = 1e-6) -> torch.Tensor:
    """SLAS advantages (see the module docstring).

    rewards: [N] training rewards; group_ids: [N]; power: algo.slas.power. Returns [N] float32, computed in
    float64: `sign(a)|a|^p / (std(sign(a)|a|^p) + eps)` with `a = r - mean_g(r)` and the unbiased batch std."""
    mean, _ = group_stats(rewards, group_ids)
    shaped = slas_shape(rewards.to(torch.float64) - mean, power)  # [N]
    if shaped.numel() < 2:
        return torch.zeros_like(shaped, dtype=torch.float32)
    return (shaped / (shaped.std() + eps)).to(torch.float32)


slas.options = SlasOptions  # type: ignore[attr-defined]  ([algo.slas])
