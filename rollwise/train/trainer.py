"""The Train stage: policy-gradient updates on scored samples.

One `Trainer.step(samples)` = `ppo_epochs` passes over the batch, each split into
`minibatches_per_epoch` optimizer steps, each accumulated over micro-batches bounded by
`micro_batch_tokens`. Losses come from `rollwise.algo` by name.
"""

from __future__ import annotations

import math
import re
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from rollwise.errors import UserError
from rollwise import algo
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.hardware import bf16_is_native
from rollwise.train.accumulator import Accumulator as _Accumulator
from rollwise.train.activation_checkpointing import configure_checkpointing
from rollwise.train.compile_layers import compile_layers
from rollwise.train.batching import MicroBatch, collate, split_by_tokens
from rollwise.train.critic import ValueHead
from rollwise.train.logprobs import response_hidden, token_logprobs
from rollwise.train.objective import Objective
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION
from rollwise.train.terms import LossTerms, PolicyTerms
from rollwise.train.trainable import freeze_for_trainer
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


class FrozenReference:
    """The KL reference as a frozen model of its own (`model`): the starting policy."""

    def __init__(self, model) -> None:
        self.model = model

    def logprobs(self, trainer: "Trainer", mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return trainer._frozen_logprobs(self.model, mbs)


class Trainer:
    """Owns the policy's optimizer, schedule and (optionally) a KL reference, and the policy version.

    `version` counts the RL steps applied (each `step` or `skip_step` adds one): the one policy version of a run,
    pushed to the engines by the Sync stage and stamped on the samples they generate. `updates` counts optimizer
    steps (several per RL step with minibatches or epochs); it seeds the stochastic loss entries.

    `reference`: where KL reference log-probs come from (`FrozenReference`, or with LoRA the policy with its
    adapters off, `rollwise.train.lora.AdapterOffReference`); None = no reference."""

    has_adapter = False  # trains a LoRA adapter it can write alone (`rollwise.train.lora_trainer`)
    world_size = 1  # processes that hold a shard of the policy (FSDP2)

    def __init__(self, model, train_cfg: TrainConfig, algo_cfg: AlgoConfig, pad_id: int, ref_model=None,
                 temperature: float = 1.0, max_new_tokens: int = 64, reference=None):
        self.model = model
        self.cfg = train_cfg
        self.algo = algo_cfg
        self.pad_id = pad_id
        self.ref_model = ref_model
        self.reference = reference if reference is not None else (
            FrozenReference(ref_model) if ref_model is not None else None)
        self.version = 0
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = next(model.parameters()).device  # the policy's (train.device): every batch moves here once
        self.device_type = self.device.type
        self.bf16 = use_bf16(train_cfg.precision, self.device_type)
        if self.bf16 and ref_model is not None:
            _store_linears_in(ref_model, torch.bfloat16)
        if train_cfg.share_prompt:  # block attention for prompt-shared rows (plain SDPA for every other call)
            for m in (model, ref_model):
                if m is not None:
                    m.set_attn_implementation(SHARED_ATTENTION)
        self.objective = Objective(algo_cfg, max_new_tokens)  # fails early on unknown names and options
        self.value_head = ValueHead(model.config.hidden_size).to(self.device) \
            if algo.is_token_advantage(algo_cfg.advantage) else None
        self.trainable = freeze_for_trainer(self, model, train_cfg.trainable)  # a layer subset: the rest frozen
        self.gradient_checkpointing = configure_checkpointing(self)  # train.gradient_checkpointing, resolved
        self.compiled_layers = compile_layers(model) if train_cfg.compile else 0  # train.compile
        params = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if self.value_head is not None:  # a fresh layer: its own, larger learning rate
            params.append({"params": list(self.value_head.parameters()), "lr": algo_cfg.value_lr})
        self.updates = 0  # optimizer steps so far: seeds the stochastic loss entries
        self.terms: LossTerms = PolicyTerms()  # the running step's (an argument of `step`)
        self.nonfinite_streak = 0  # RL steps in a row with an optimizer step skipped for NaN/Inf
        self._nonfinite_loss = False  # set by `_backward` when a micro-batch loss is NaN/Inf
        self.optimizer = torch.optim.AdamW(  # fused: one kernel per step instead of one per op and tensor
            params, lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay, eps=1e-8,
            fused=self.device_type in ("cpu", "cuda"),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(train_cfg))

    def _autocast(self):
        if self.bf16:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()

    def _micro_batches(self, samples: list[Sample], version: int | None = None) -> list[MicroBatch]:
        return [mb.to(self.device) for mb in self._collated(samples, version)]

    def _collated(self, samples: list[Sample], version: int | None = None) -> list[MicroBatch]:
        """The micro-batches of `samples`, still on the CPU (where collate builds them)."""
        share = self.cfg.share_prompt
        groups = split_by_tokens(samples, self.cfg.micro_batch_tokens, share_prompt=share)
        return [collate(g, self.pad_id, share_prompt=share, version=version) for g in groups]

    @torch.no_grad()
    def _frozen_logprobs(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        with self._autocast():
            return [self._logprobs(model, mb, with_entropy=False)[0] for mb in mbs]

    def _logprobs(self, model, mb: MicroBatch, with_entropy: bool = True, hidden_out: list | None = None):
        """`token_logprobs` of `model` on `mb` at the rollout temperature (FSDP2 routes the policy's through its
        root module)."""
        return token_logprobs(model, mb, self.temperature, with_entropy=with_entropy, hidden_out=hidden_out)

    def _share(self, plan: list[MicroBatch]) -> list[tuple[int, MicroBatch]]:
        """(index in `plan`, micro-batch) pairs this process runs: all of them here. Data parallel (FSDP2) runs
        every N-th and pads with stand-ins of index -1 (zero-weight passes, so every rank issues the same
        collectives)."""
        return list(enumerate(plan))

    def _merged(self, acc: "_Accumulator") -> "_Accumulator":
        """The step's metrics over every process (data parallel: summed over ranks); here `acc` itself."""
        return acc

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def _reference_logprobs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Reference log-probs per micro-batch ([S, T] each), from `reference`."""
        return self.reference.logprobs(self, mbs)

    def step(self, samples: list[Sample], version: int | None = None, terms: LossTerms | None = None
             ) -> dict[str, float]:
        """One RL update on `samples` (advantages already set) with a method's `terms` (None: `PolicyTerms`, the
        plain policy loss). Returns `train/*`, `mismatch/*` and the terms' metrics; the version moves on by one.

        `version` is the policy version the trainer holds (the weights before this update): `mismatch/*`
        measures the numerical gap on tokens that version generated and reports older ones as stale; None
        counts every token as current."""
        self.terms = terms if terms is not None else PolicyTerms()
        self.version += 1
        self.model.train()
        minibatches = _split(samples, self.cfg.minibatches_per_epoch)
        single_update = self.cfg.ppo_epochs == 1 and len(minibatches) == 1
        from_engine = self.cfg.old_logprobs == "behaviour"
        collated = [self._collated(mb, version) for mb in minibatches]  # on the CPU
        batch_norms = [algo.batch_normalisers([mb.loss_mask for mb in plan]) for plan in collated]  # no device sync
        plans = [[mb.to(self.device) for mb in plan] for plan in collated]
        shares = [self._share(plan) for plan in plans]  # [(j, micro-batch)] this process runs
        mine = [[mb for _, mb in share] for share in shares]
        old = None if from_engine or single_update else [self._frozen_logprobs(self.model, p) for p in mine]
        ref = None
        if self.algo.kl_coef > 0 and not self.algo.kl_in_reward and self.has_reference:
            ref = [self._reference_logprobs(p) for p in mine]
        critic = [self._critic_targets(p) for p in mine] if self.value_head is not None else None
        self.terms.start()  # a method's metrics are taken over the whole batch at the end (`terms.metrics`)
        acc = _Accumulator()
        skipped = 0
        for epoch in range(self.cfg.ppo_epochs):
            for k, share in enumerate(shares):
                norms = batch_norms[k]
                # engine-vs-trainer mismatch: measured on weights that sampled the batch (before any update)
                measure = epoch == 0 and (k == 0 or old is not None)
                for i, (j, mb) in enumerate(share):
                    old_logp = mb.behaviour_logp if from_engine else None if old is None else old[k][i]
                    self._backward(mb, norms, old_logp, None if ref is None else ref[k][i], acc, measure,
                                   None if old is None else old[k][i], None if critic is None else critic[k][i],
                                   seed=self.updates * 1000 + j, stand_in=j < 0)
                skipped += not self._optimizer_step(acc)
        self.scheduler.step()
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        self._check_finite_weights("after the update")
        out = self._merged(acc).means()
        out.update(self.terms.metrics())
        out["train/nonfinite_steps"] = float(skipped)  # optimizer steps skipped for a NaN/Inf loss or gradient
        out["train/nonfinite_streak"] = float(self.nonfinite_streak)
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        out["train/optimizer_steps"] = float(self.cfg.ppo_epochs * len(plans))
        real = sum(mb.real_tokens for p in plans for mb in p)
        computed = sum(mb.computed_tokens for p in plans for mb in p)
        out["train/tokens"] = float(real * self.cfg.ppo_epochs)
        out["perf/train_padding_eff"] = real / max(1, computed)
        passes = {"update": self.cfg.ppo_epochs, "old_logprobs": old is not None, "reference": ref is not None,
                  "critic": critic is not None}  # passes over the batch this step ran (perf.py counts their FLOPs)
        out.update({f"train/passes/{k}": float(v) for k, v in passes.items()})
        return out

    def _check_finite_weights(self, where: str) -> None:
        check_finite_weights(self.model, where=where)

    def _optimizer_step(self, acc: "_Accumulator") -> bool:
        """Clip and apply the accumulated gradients; False (nothing applied) when the loss or gradient norm
        of this minibatch is NaN/Inf: weights and optimizer state stay as they were."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        flag = torch.as_tensor(self._nonfinite_loss, dtype=torch.float32, device=norm.device)
        grad_norm, nonfinite = torch.stack([norm.float(), flag]).tolist()  # the optimizer step's one read-back
        return self._apply_if_finite(acc, grad_norm, bool(nonfinite))

    def _apply_if_finite(self, acc: "_Accumulator", grad_norm: float, nonfinite_loss: bool) -> bool:
        """Record the (clipped) gradient norm; step the optimizer unless it or a micro-batch loss was NaN/Inf;
        clear the gradients either way. True when the step was applied."""
        acc.add("train/grad_norm", grad_norm, 1.0)
        finite = math.isfinite(grad_norm) and not nonfinite_loss
        self._nonfinite_loss = False
        if finite:
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return finite

    # -- the backend's weights and state (session.py and sync/ call these; FSDP2 and LoRA override them) -----
    def policy_state(self) -> dict[str, torch.Tensor]:
        """The full policy weights under the model's HF parameter names (what an engine loads)."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of `token_ids[1:]` under the policy (the Sync stage's check)."""
        from rollwise.models.probe import model_probe_logprobs

        return model_probe_logprobs(self.model, token_ids)

    def checkpoint_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights a checkpoint's HF model holds; None = the policy module's own."""
        return None

    def write_checkpoint(self, directory: Path) -> None:
        """Write what this backend keeps beside the HF model and `trainer_state.pt` (nothing here)."""

    def state_dict(self) -> dict[str, Any]:
        """The trainer's part of `trainer_state.pt`: optimizer, schedule, counters, value head."""
        return {"optimizer": self.optimizer.state_dict(), "fsdp": None, **self._replicated_state()}

    def _replicated_state(self) -> dict[str, Any]:
        """What every backend saves the same way (one copy, not sharded)."""
        return {"scheduler": self.scheduler.state_dict(), "updates": self.updates,
                "nonfinite_streak": self.nonfinite_streak,
                "value_head": None if self.value_head is None else self.value_head.state_dict()}

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore `state_dict` (from the checkpoint at `checkpoint`); the version is the checkpoint's step.
        ValueError (one line) for a checkpoint another backend wrote."""
        if state.get("fsdp") is not None:
            raise ValueError(f"checkpoint step-{state.get('step')} holds optimizer state sharded over "
                             f"{state['fsdp']['world_size']} FSDP2 ranks; resume it with train.backend = 'fsdp2' and "
                             f"train.world_size = {state['fsdp']['world_size']}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_replicated(state)

    def _load_replicated(self, state: dict[str, Any]) -> None:
        """What every backend restores the same way: schedule, counters, value head, version."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state.get("updates", 0)
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
        self.version = state["step"]
        if self.value_head is not None and state.get("value_head") is not None:
            self.value_head.load_state_dict(state["value_head"])

    def close(self) -> None:
        """Nothing to release in one process."""

    def kl_penalties(self, samples: list[Sample]) -> list[float]:
        """`algo.kl_in_reward`: per-sample summed KL penalty `-kl_coef * sum_t k(behaviour, ref)`, in order."""
        if not self.has_reference:
            return [0.0] * len(samples)
        mbs = self._micro_batches(samples)
        penalty: dict[int, float] = {}
        for mb, ref_logp in zip(mbs, self._reference_logprobs(mbs)):
            rows = algo.kl_reward_penalty(self.algo.kl_estimator, mb.behaviour_logp, ref_logp, mb.loss_mask,
                                          self.algo.kl_coef, per_sequence=True)  # [S]
            for sample, value in zip(mb.samples, rows.tolist()):
                penalty[id(sample)] = value
        return [penalty[id(s)] for s in samples]

    @torch.no_grad()
    def _critic_targets(self, mbs: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """GAE on the current values: per micro-batch (old_values [S, T], returns [S, T]); sets mb.advantages."""
        out = []
        for mb in mbs:
            with self._autocast():
                hidden = self._hidden(mb)
            values = self.value_head(hidden, mb)  # [S, T], fp32 as in the training pass
            rewards = torch.tensor([s.reward if s.train_reward is None else s.train_reward for s in mb.samples],
                                   dtype=torch.float32, device=mb.device)
            mb.advantages, returns = algo.token_advantage(self.algo.advantage, rewards, values, mb.loss_mask,
                                                          gamma=self.algo.gamma, lam=self.algo.lam)
            out.append((values, returns))
        return out

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        """`response_hidden` of the policy on `mb`: [n, H]."""
        return response_hidden(self.model, mb)

    def skip_step(self) -> None:
        """A step without an update (every group was filtered out): the version and the lr schedule move on."""
        self.version += 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()

    def _backward(self, mb: MicroBatch, norms: dict, old_logp, ref_logp, acc: "_Accumulator", measure: bool,
                  pre_update_logp=None, critic=None, seed: int = 0, stand_in: bool = False) -> None:
        """Accumulate gradients of one micro-batch. `old_logp` None = on-policy (the detached current logp);
        `pre_update_logp`, when given, is the trainer's logp before this step's updates; `critic` is
        (old_values, returns) [S, T] each. A `stand_in` (data parallel padding) adds zero gradients and no
        metrics."""
        mask = mb.loss_mask  # [B, T]
        terms = self.terms
        hidden: list | None = [] if critic is not None or terms.needs_hidden else None
        with self._autocast():
            logp, entropy = self._logprobs(self.model, mb, hidden_out=hidden)  # [B, T] each
        old = logp.detach() if old_logp is None else old_logp
        # the teacher gap compares the student's own untruncated log-probs (not top-p / TRB behaviour ones)
        own = mb.full_logp if self.cfg.old_logprobs == "behaviour" else old
        metrics: dict[str, float] = {}
        loss = logp.new_zeros(())
        if terms.policy_loss:
            advantages = terms.advantages(own, mb, entropy)  # [B] or [B, T]
            loss, metrics = self.objective.loss(logp, old, mb.behaviour_logp, advantages, mask, norms, seed,
                                                entropy=entropy, ref_logp=ref_logp)
        loss = loss + terms.extra_loss(logp, hidden[0] if hidden else None, self.model.get_output_embeddings().weight,
                                       mb, lambda per_token, m: self.objective.aggregate(per_token, m, norms),
                                       entropy=entropy)
        measure = measure and terms.compares_engine
        if critic is not None:
            old_values, returns = critic
            per_token, value_metrics = algo.value_loss(self.value_head(hidden[0], mb), old_values, returns, mask,
                                                       clip=self.algo.value_clip)
            loss = loss + self.algo.vf_coef * self.objective.aggregate(per_token, mask, norms)
            metrics.update({f"value/{k}": _detached(v) for k, v in value_metrics.items()})
        if stand_in:
            (loss * 0.0).backward()
            return
        loss.backward()
        self._nonfinite_loss = torch.logical_or(torch.as_tensor(self._nonfinite_loss, device=loss.device),
                                                ~torch.isfinite(loss.detach()))  # read back at the optimizer step
        w = mask.sum()  # metrics stay on the device until the step's end (`_Accumulator.means`)
        acc.add_total("train/loss", loss.detach() * norms["num_tokens"], w)
        acc.add_total("train/entropy", (entropy.detach() * mask).sum(), w)
        for key, value in metrics.items():
            acc.add_total(key, value * w, w)
        if measure:  # engine vs trainer on the same tokens, before any update of this step
            self._mismatch(logp.detach() if pre_update_logp is None else pre_update_logp, mb, acc)

    @staticmethod
    def _mismatch(trainer_logp: torch.Tensor, mb: MicroBatch, acc: "_Accumulator") -> None:
        """Engine vs trainer log-probs of the same tokens, before any update of this step (trainer_logp [B, T]).

        Like is compared with like: the trainer's log-probs against the engine's untruncated ones
        (`full_logp`, same temperature, no top-k / top-p), so truncation does not count as drift.
        - numerical gap, on tokens of the trainer's own version (`mb.current`): `logprob_abs_diff_mean`,
          `logprob_abs_diff_max`, `k3` (KL(engine || trainer) estimate); absent when no token is current;
        - staleness, on older tokens (partial rollouts, async, replay), where the weights differ too:
          `stale_logprob_abs_diff_mean` (absent when none) and `stale_token_frac` of the trained tokens;
        - truncation, on every trained token: `truncation_logprob_gap_mean` = mean(behaviour - full) >= 0,
          i.e. -log of the probability mass top-k / top-p kept.
        """
        mask = mb.loss_mask  # [B, T]
        current = mask * mb.current  # [B, T]
        stale = mask - current  # [B, T]
        w, w_current, w_stale = mask.sum(), current.sum(), stale.sum()  # on the device: no read-back here
        diff = (trainer_logp - mb.full_logp).abs()  # [B, T]
        k3 = algo.kl("k3", mb.full_logp, trainer_logp) * current  # [B, T]
        acc.add_total("mismatch/logprob_abs_diff_mean", (diff * current).sum(), w_current)
        acc.add_total("mismatch/k3", k3.sum(), w_current)
        acc.keep_max("mismatch/logprob_abs_diff_max", torch.where(current > 0, diff, -math.inf).max())
        acc.add_total("mismatch/stale_logprob_abs_diff_mean", (diff * stale).sum(), w_stale)
        acc.add_total("mismatch/stale_token_frac", w_stale, w)
        acc.add_total("mismatch/truncation_logprob_gap_mean", ((mb.behaviour_logp - mb.full_logp) * mask).sum(), w)


class NonFiniteError(UserError, RuntimeError):
    """Training produced NaN/Inf: a loss or gradient for too many steps in a row, or the weights themselves."""


def check_finite_weights(model, where: str) -> None:
    """Raise NonFiniteError naming the first parameter that holds a NaN or Inf.

    One fused check and one read-back (the norms of all parameters: a NaN/Inf anywhere makes its norm
    non-finite); only when it fails are the parameters scanned one by one for the name."""
    params = [p.detach() for p in model.parameters()]
    if not params or bool(torch.isfinite(torch.stack(torch._foreach_norm(params))).all()):
        return
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise NonFiniteError(f"parameter {name} holds NaN/Inf {where}; lower train.lr or check the loss")


def _store_linears_in(model, dtype: torch.dtype) -> None:
    """Keep a frozen model's linear weights in `dtype`, as autocast would cast them on every call.

    Only `nn.Linear` weights inside the body change (not norms, embeddings or the LM head, which autocast
    leaves in fp32), so the numbers are those of autocast with fp32 weights, minus the per-call casts.
    """
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.data = module.weight.data.to(dtype)
                if module.bias is not None:
                    module.bias.data = module.bias.data.to(dtype)


def _detached(value):
    """A metric as it is accumulated: a tensor stays on its device (read back once per step)."""
    return value.detach() if isinstance(value, torch.Tensor) else float(value)


def _split(samples: list[Sample], parts: int) -> list[list[Sample]]:
    parts = max(1, min(parts, len(samples)))
    size = math.ceil(len(samples) / parts)
    return [samples[i : i + size] for i in range(0, len(samples), size)]
