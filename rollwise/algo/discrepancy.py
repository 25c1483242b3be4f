"""The engine-vs-trainer discrepancy of a step and the two controllers of it (DCMDP, ACRL): pure functions.

    d = discrepancy(trainer_logp [N, T], engine_logp [N, T], mask [N, T], "k3")   # [N, T] per token
    lam = dual_ascent(lam, D, target=0.01, lr=10.0, max_value=100.0)             # DCMDP's multiplier
    keep = gap_mask(trainer_logp, engine_logp, mask, threshold=0.5)              # ACRL's per-token weight [N, T]
    tau = threshold_control(tau, fit_threshold(gaps [n], d [n], 0.01), 1.0, 0.05, 2.0)  # ACRL's threshold

`discrepancy` is, per token, `k3 = r - 1 - log r` with `r = pi_train / pi_engine` (the estimate of
KL(engine || trainer) from tokens the engine sampled, the same as `mismatch/k3`), or `abs_gap = |log pi_train -
log pi_engine|`; 0 where `mask` is 0. With gradient through `trainer_logp`, `d(k3)/d(log pi_train) = r - 1`: it
pulls the trainer's log-probs toward the engine's, the learning signal by which the policy "self-corrects" the
discrepancy (DCMDP: Liu et al. 2026, "Reformulate LLM Reinforcement Learning for Efficient Training under
Black-box Discrepancy").

`dual_ascent`: DCMDP's Lagrangian relaxation of "D <= target": the objective gains `lambda x (D - target)` and
`lambda <- clip(lambda + lr (D - target), 0, max)`, one projected dual-ascent step per RL step. The multiplier
grows while the discrepancy exceeds the tolerance and decays to 0 inside it, where the policy explores freely.

`gap_mask`, `fit_threshold` and `threshold_control`: ACRL (Adaptive Control RL, "adaptively maintains the
training-inference discrepancy within a reasonable range"). The paper's abstract, the copy we have, names the aim,
the FP8 setting and an effect (higher entropy), not the mechanism; we fill it in as an importance correction whose
threshold is adapted: a token whose log-prob gap `|log pi_train - log pi_engine|` exceeds `tau` gets weight 0 in
the policy loss (a two-sided token mask, as `mis_token` with a moving bound). The controlled quantity is
D_trained, the discrepancy of the tokens the update trains on. The trainer learns a step's gaps only as it trains
it (one pass per micro-batch), so the threshold is set from the step before: `fit_threshold` finds the largest
`tau*` whose kept tokens of that step had mean D at most the target (none needed: `tau* = max`), and
`tau <- tau^(1 - gain) tau*^gain` (gain 1: take it; below 1: smooth it). A kept token's k3 is at most
`e^tau - 1 - tau`, so a target above that of `[algo.acrl] threshold_min` can always be met.
The largest gaps are on tokens the engine over-samples (low trainer probability); a masked one is no longer pushed
further down by a negative advantage, which would widen the gap again, and the tail it keeps is the entropy the
paper reports as a side effect.
"""

from __future__ import annotations

import torch


def discrepancy(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                measure: str = "k3") -> torch.Tensor:
    """Per-token discrepancy `[N, T]` (see the module docstring); 0 where `mask` is 0. Differentiable in
    `trainer_logp`."""
    log_ratio = trainer_logp - engine_logp  # log(pi_train / pi_engine)
    if measure == "k3":
        values = torch.expm1(log_ratio) - log_ratio  # r - 1 - log r >= 0
    elif measure == "abs_gap":
        values = log_ratio.abs()
    else:
        raise ValueError(f"discrepancy measure {measure!r} is not one of k3, abs_gap")
    return torch.where(mask > 0, values, torch.zeros_like(values))


def dual_ascent(lam: float, measured: float, target: float, lr: float, max_value: float) -> float:
    """One projected dual-ascent step of DCMDP's multiplier: `clip(lam + lr (measured - target), 0, max_value)`."""
    return min(max(0.0, lam + lr * (measured - target)), max_value)


def gap_mask(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
             threshold: float) -> torch.Tensor:
    """ACRL's per-token weight `[N, T]`: 1 where `mask` is set and `|trainer_logp - engine_logp| <= threshold`,
    else 0 (float, no gradient)."""
    keep = (trainer_logp - engine_logp).abs() <= threshold
    return (keep & (mask > 0)).to(trainer_logp.dtype).detach()


def fit_threshold(gaps: torch.Tensor, values: torch.Tensor, target: float) -> float | None:
    """The largest threshold on `|gap|` whose kept tokens have mean discrepancy at most `target`.

    `gaps [n]` the log-prob gaps of a step's current tokens, `values [n]` their discrepancies (`discrepancy`).
    Returns None when every token can be kept (no threshold needed), 0.0 when not even the smallest gap's token
    alone meets the target."""
    if gaps.numel() == 0 or float(values.mean()) <= target:
        return None
    order = torch.argsort(gaps.abs())
    sorted_gaps, sorted_values = gaps.abs()[order], values[order]
    running = torch.cumsum(sorted_values, 0) / torch.arange(1, len(order) + 1, dtype=values.dtype)  # [n]
    ok = torch.nonzero(running <= target).flatten()
    return float(sorted_gaps[int(ok[-1])]) if ok.numel() else 0.0


def threshold_control(threshold: float, fitted: float | None, gain: float, min_value: float,
                      max_value: float) -> float:
    """ACRL's next threshold: `threshold^(1 - gain) x fitted^gain` (a geometric step toward the threshold fitted to
    the last step, `fit_threshold`; `fitted` None = `max_value`), clipped to `[min_value, max_value]`."""
    goal = max_value if fitted is None else min(max(fitted, min_value), max_value)
    return min(max(threshold ** (1.0 - gain) * goal ** gain, min_value), max_value)
