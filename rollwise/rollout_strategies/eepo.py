"""EEPO (Exploration-Enhanced Policy Optimization, 2025; the abstract in ../shared/seeds): two-stage rollouts
with unlearning. The policy samples the first half of each group; a lightweight unlearning step on a temporary
copy of the policy suppresses those responses; the copy samples the second half, pushed away from the modes the
first half already covered ("sample-then-forget").

`rollout.strategy = "eepo"`, each round:
1. the first `ceil(n / 2)` samples of every group come from the policy's engine;
2. a scratch copy of the current policy (reset from it every round) takes `rollout.eepo.unlearn_steps` AdamW
   steps at `rollout.eepo.unlearn_lr` that lower the mean per-token log-likelihood of all those first-half
   responses (gradient ascent on their NLL), all groups in one batch;
3. the copy's weights go into a second torch engine (kept across rounds, tagged with the policy's version) that
   samples the other samples of every group.
The second half's behaviour log-probs are the copy's: the distribution they were really sampled from. The
trainer's update then sees them as off-policy tokens: with `train.old_logprobs = "recompute"` and an importance
correction (`algo.is_correction`, e.g. `tis_token`, as the recipe sets) the update is weighted by
pi_old / pi_copy, and `mismatch/*` shows the gap the unlearning made. The whole group (both halves) is one GRPO
group.

Filled in / departures: the abstract's "adaptive" unlearning is a fixed number of steps and learning rate here
(no schedule on the policy's entropy or on the group's outcome); the unlearning objective is plain likelihood
minimisation of the sampled responses (no retain term); the copy is a full copy, not an adapter.
Metrics: `eepo/unlearn_logp_before` and `eepo/unlearn_logp_after` (mean per-token log-prob of the first-half
responses under the copy before and after unlearning: the suppression), `eepo/distinct_frac_first` and
`eepo/distinct_frac_second` (distinct responses / responses in each half, over the round's groups).
"""

from __future__ import annotations

import copy
import math
from itertools import count

import torch

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.generate.groups import FINAL, GenerateStats, StopRule, is_complete
from rollwise.rollout_strategies import (StrategyContext, continue_samples, engine_rng_state, require_continuation,
                                        set_engine_rng_state)
from rollwise.types import Group, Sample, SamplingParams, Status


class EEPOOptions(MethodOptions, section="rollout", name="eepo"):
    """`[rollout.eepo]`: EEPO, the second half of each group from an unlearned copy."""

    unlearn_steps: int = Field(1, ge=0, description="AdamW steps that lower the likelihood of the first half's "
                               "responses on the temporary copy (0 = no unlearning)")
    unlearn_lr: float = Field(1e-5, gt=0.0, description="learning rate of those steps")

    def errors(self, cfg) -> list[str]:
        if cfg.lora.rank > 0 or cfg.train.backend != "local":
            return ["rollout.strategy = 'eepo' unlearns on a copy of the whole local policy: set lora.rank = 0 and "
                    "train.backend = 'local'"]
        return []


def eepo_strategy(cfg, context: StrategyContext) -> "EEPOStrategy":
    from rollwise.generate.factory import engine_dtype
    from rollwise.generate.torch_engine import TorchEngine

    r = cfg.rollout
    explorer = TorchEngine(context.model, context.tokenizer,
                           dtype=engine_dtype(cfg.model.dtype, next(context.model.parameters()).device),
                           max_batch_size=r.max_batch_size, seed=context.seed + 11)
    pad_id = context.tokenizer.pad_token_id if context.tokenizer.pad_token_id is not None else explorer.pad_id
    o = EEPOOptions.of(cfg)
    return EEPOStrategy(context.model, explorer, o.unlearn_steps, o.unlearn_lr, pad_id)


eepo_strategy.options = EEPOOptions


def response_logp(model, samples: list[Sample], pad_id: int) -> torch.Tensor:
    """Mean per-token log-prob of each sample's response under `model` (with gradient): [S]."""
    device = next(model.parameters()).device
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    target_mask = torch.zeros((len(seqs), width), dtype=torch.float32, device=device)
    for b, (s, q) in enumerate(zip(samples, seqs)):
        ids[b, :len(q)] = torch.tensor(q, device=device)
        attention[b, :len(q)] = 1
        target_mask[b, len(s.prompt_ids):len(q)] = torch.tensor(s.loss_mask, dtype=torch.float32, device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # [S, W-1, V]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [S, W-1]
    mask = target_mask[:, 1:]
    return (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


class EEPOStrategy:
    """Args:
        policy: the trained model (read at each round: its current weights).
        explorer: the torch engine that samples the second halves (receives the unlearned copy's weights).
        unlearn_steps: AdamW steps of the unlearning (0 = the copy is the policy: plain two-stage sampling).
        unlearn_lr: their learning rate.
        pad_id: padding id of the unlearning batch.
    """

    def __init__(self, policy, explorer, unlearn_steps: int, unlearn_lr: float, pad_id: int):
        self.policy, self.explorer = policy, explorer
        self.unlearn_steps, self.unlearn_lr, self.pad_id = unlearn_steps, unlearn_lr, pad_id
        self.scratch = None  # the temporary copy, allocated once and reset from the policy every round
        self._metrics: dict[str, list[float]] = {}

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        require_continuation(engine)
        first, second = [], []
        for g in groups:
            half = math.ceil(len(g.samples) / 2)
            for i, s in enumerate(g.samples):
                if s.status not in FINAL:
                    (first if i < half else second).append(s)
        continue_samples(engine, first, params, ids, params.max_new_tokens)
        done = [s for s in first if s.status in FINAL and s.response_ids]
        if second:
            self._unlearn(done, engine.version)
            continue_samples(self.explorer, second, params, ids, params.max_new_tokens, counted_on=engine)
        self._record("eepo/distinct_frac_first", _distinct_frac(groups, first))
        self._record("eepo/distinct_frac_second", _distinct_frac(groups, second))
        todo = first + second
        return GenerateStats(requests=len(todo), aborted=sum(s.status == Status.ABORTED for s in todo),
                             groups_completed=sum(is_complete(g) for g in groups))

    def _unlearn(self, samples: list[Sample], version: int) -> None:
        """Reset the copy from the policy, lower the likelihood of `samples` under it, load it into the explorer."""
        if self.scratch is None:
            self.scratch = copy.deepcopy(self.policy).float().requires_grad_(True)
        with torch.no_grad():
            for mine, theirs in zip(self.scratch.parameters(), self.policy.parameters(), strict=True):
                mine.copy_(theirs)
        self.scratch.eval()  # no dropout: the step sees the model that samples
        if samples and self.unlearn_steps > 0:
            optimizer = torch.optim.AdamW(self.scratch.parameters(), lr=self.unlearn_lr, weight_decay=0.0)
            for step in range(self.unlearn_steps):
                logp = response_logp(self.scratch, samples, self.pad_id).mean()
                if step == 0:
                    self._record("eepo/unlearn_logp_before", float(logp.detach()))
                optimizer.zero_grad(set_to_none=True)
                logp.backward()  # minimise the log-likelihood of what the first half sampled
                optimizer.step()
            with torch.no_grad():
                self._record("eepo/unlearn_logp_after", float(response_logp(self.scratch, samples, self.pad_id).mean()))
            del optimizer
        self.scratch.zero_grad(set_to_none=True)
        self.explorer.update_weights({n: p.detach() for n, p in self.scratch.named_parameters()}, version)

    def state_dict(self) -> dict:
        """The explorer's sampling RNG: a resumed run samples the second halves as the uninterrupted one does (its
        weights need nothing: every round resets the copy from the policy)."""
        return {"explorer_rng": engine_rng_state(self.explorer)}

    def load_state_dict(self, state: dict) -> None:
        set_engine_rng_state(self.explorer, state.get("explorer_rng"))

    def _record(self, key: str, value: float | None) -> None:
        if value is not None:
            self._metrics.setdefault(key, []).append(value)

    def metrics(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self._metrics.items() if v}
        self._metrics = {}
        return out


def _distinct_frac(groups: list[Group], samples: list[Sample]) -> float | None:
    """Distinct responses / responses of `samples`, counted within each group, over all groups."""
    if not samples:
        return None
    mine = {id(s) for s in samples}
    distinct = sum(len({tuple(s.response_ids) for s in g.samples if id(s) in mine}) for g in groups)
    return distinct / len(samples)
