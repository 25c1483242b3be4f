"""The Train stage: policy-gradient updates on scored samples.

One `Trainer.step(samples)` = `ppo_epochs` passes over the batch, each split into
`minibatches_per_epoch` optimizer steps, each accumulated over micro-batches bounded by
`micro_batch_tokens`. Losses come from `rollwise.algo` by name.
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import torch

from rollwise import algo
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.hardware import bf16_is_native
from rollwise.train.batching import MicroBatch, collate, split_by_tokens
from rollwise.train.logprobs import token_logprobs
from rollwise.types import Sample


def use_bf16(precision: str, device_type: str) -> bool:
    """Resolve `train.precision`: `auto` means bf16 on CUDA or on a CPU with native bf16 instructions."""
    if precision == "auto":
        return bf16_is_native(device_type)
    return precision == "bf16"


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the base lr at RL step `s`: linear warm-up, then constant or cosine decay."""

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


class Trainer:
    """Owns the policy's optimizer, schedule and (optionally) a frozen reference model."""

    def __init__(self, model, train_cfg: TrainConfig, algo_cfg: AlgoConfig, pad_id: int, ref_model=None,
                 temperature: float = 1.0):
        self.model = model
        self.cfg = train_cfg
        self.algo = algo_cfg
        self.pad_id = pad_id
        self.ref_model = ref_model
        self.temperature = temperature if temperature > 0 else 1.0
        self.device_type = next(model.parameters()).device.type
        self.bf16 = use_bf16(train_cfg.precision, self.device_type)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused: one kernel per step instead of one per op and tensor
            params, lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay, eps=1e-8,
            fused=self.device_type in ("cpu", "cuda"),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(train_cfg))
        algo.POLICY_LOSSES.get(algo_cfg.loss)  # fail early on unknown names
        algo.AGGREGATIONS.get(algo_cfg.aggregation)
        algo.KL_ESTIMATORS.get(algo_cfg.kl_estimator)

    def _autocast(self):
        if self.bf16:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def _micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        share = self.cfg.share_prompt
        groups = split_by_tokens(samples, self.cfg.micro_batch_tokens, share_prompt=share)
        return [collate(g, self.pad_id, share_prompt=share) for g in groups]

    @torch.no_grad()
    def _frozen_logprobs(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        with self._autocast():
            return [token_logprobs(model, mb, self.temperature)[0] for mb in mbs]

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL update on `samples` (advantages already set). Returns `train/*` and `mismatch/*`."""
        self.model.train()
        minibatches = _split(samples, self.cfg.minibatches_per_epoch)
        single_update = self.cfg.ppo_epochs == 1 and len(minibatches) == 1
        plans = [self._micro_batches(mb) for mb in minibatches]
        old = None if single_update else [self._frozen_logprobs(self.model, p) for p in plans]
        ref = None
        if self.algo.kl_coef > 0 and self.ref_model is not None:
            ref = [self._frozen_logprobs(self.ref_model, p) for p in plans]
        acc = _Accumulator()
        for _epoch in range(self.cfg.ppo_epochs):
            for k, plan in enumerate(plans):
                n_tokens = sum(float(mb.loss_mask.sum()) for mb in plan)
                for j, mb in enumerate(plan):
                    self._backward(mb, n_tokens, None if old is None else old[k][j],
                                   None if ref is None else ref[k][j], acc, first_pass=_epoch == 0)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
                acc.add("train/grad_norm", float(grad_norm), 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out = acc.means()
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        out["train/optimizer_steps"] = float(self.cfg.ppo_epochs * len(plans))
        real = sum(mb.real_tokens for p in plans for mb in p)
        computed = sum(mb.computed_tokens for p in plans for mb in p)
        out["train/tokens"] = float(real * self.cfg.ppo_epochs)
        out["perf/train_padding_eff"] = real / max(1, computed)
        return out

    def skip_step(self) -> None:
        """Advance the lr schedule on a step without an update (every group was filtered out)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()

    def _backward(self, mb: MicroBatch, n_tokens: float, old_logp, ref_logp, acc: "_Accumulator",
                  first_pass: bool) -> None:
        mask = mb.loss_mask  # [B, T]
        with self._autocast():
            logp, entropy = token_logprobs(self.model, mb, self.temperature)  # [B, T] each
        old = logp.detach() if old_logp is None else old_logp
        per_tok, m = algo.policy_loss(self.algo.loss, logp, old, mb.advantages, mask,
                                      clip_low=self.algo.clip_low, clip_high=self.algo.clip_high)
        loss = algo.aggregate(self.algo.aggregation, per_tok, mask, num_tokens=n_tokens)
        w = float(mask.sum())
        if ref_logp is not None:
            kl_tok = algo.kl(self.algo.kl_estimator, logp, ref_logp)  # [B, T]
            loss = loss + self.algo.kl_coef * algo.aggregate(self.algo.aggregation, kl_tok, mask, num_tokens=n_tokens)
            acc.add("train/kl", float((kl_tok.detach() * mask).sum()) / max(w, 1), w)
        loss.backward()
        acc.add("train/loss", float(loss.detach()) * n_tokens / max(w, 1), w)
        acc.add("train/entropy", float((entropy.detach() * mask).sum()) / max(w, 1), w)
        for key, value in m.items():
            acc.add(f"train/{key}", float(value), w)
        if first_pass:  # engine vs trainer on the same tokens, before any update of this step
            self._mismatch(logp.detach() if old_logp is None else old_logp, mb, acc)

    @staticmethod
    def _mismatch(trainer_logp: torch.Tensor, mb: MicroBatch, acc: "_Accumulator") -> None:
        mask = mb.loss_mask
        w = float(mask.sum())
        diff = (trainer_logp - mb.behaviour_logp) * mask  # [B, T]
        k3 = algo.kl("k3", mb.behaviour_logp, trainer_logp) * mask  # KL(behaviour || trainer) estimate
        acc.add("mismatch/logprob_abs_diff_mean", float(diff.abs().sum()) / max(w, 1), w)
        acc.add("mismatch/k3", float(k3.sum()) / max(w, 1), w)
        acc.add("mismatch/logprob_abs_diff_max", float(diff.abs().max()), 0.0)


def _split(samples: list[Sample], parts: int) -> list[list[Sample]]:
    parts = max(1, min(parts, len(samples)))
    size = math.ceil(len(samples) / parts)
    return [samples[i : i + size] for i in range(0, len(samples), size)]


class _Accumulator:
    """Weighted means of metrics across micro-batches (weight 0 keeps the maximum instead)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, key: str, value: float, weight: float) -> None:
        if weight == 0.0:
            self.sums[key] = max(self.sums.get(key, -math.inf), value)
            self.weights[key] = 0.0
            return
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: (v / self.weights[k] if self.weights[k] else v) for k, v in self.sums.items()}
