"""What a teacher or SFT step adds to the trainer's loss: the OPD token advantage, the GKD and SFT loss terms.

`StepTerms` is a `rollwise.train.terms.LossTerms`: the trainer calls `start` once per update, `advantages` before
its policy loss and `extra_loss` after it, per micro-batch, and `metrics` at the end. What the step decided about
each sample lives in its `StepMarks`, by sample identity, never on the `Sample`: the teacher's log-probs and top-k,
and the loss weights (reward advantage, teacher term, SFT NLL) that Self-Routing and the stage set. A sample the
step did not mark (a replayed one) gets the default weights (1, 1, 0) and no teacher term.

    A_t  = w_reward * reward_weight * A_reward - w_teacher * coef * (logp_own_t - logp_teacher_t)      (opd)
    loss = policy_loss(A) + coef * agg(w_teacher * GJSD_beta(T_topk+tail || S_topk+tail))               (gkd)
         + sft_coef * agg(w_sft * -logp_t)                                                              (sft)

`logp_own` is the student's own untruncated log-prob of the sampled token (no top-k / top-p, no TRB mixture):
the trainer's old log-probs, or the engine's `full_logp` with `train.old_logprobs = "behaviour"`.
An SFT stage (`sft_only`) trains the NLL alone (no policy loss: demonstrations have no advantage).

The `distill/*` metrics are over the whole step's batch, not means of per-micro-batch values: each micro-batch's
first pass (before any update of this step) records its per-token gaps, entropies and term sums, and
`metrics` takes the means and the top-gap share once over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollwise import algo
from rollwise.algo.distillation import generalized_jsd
from rollwise.distill.guards import gap_metrics
from rollwise.train.batching import MicroBatch
from rollwise.train.logprobs import CHUNK_TOKENS, row_chunks
from rollwise.types import Sample

DEFAULT_WEIGHTS = (1.0, 1.0, 0.0)  # (reward advantage, teacher term, sft NLL) of a sample no step marked


@dataclass
class StepMarks:
    """What one step decided about its samples, keyed by `id(sample)` (the samples are kept alive in `held`):
    the teacher's log-probs `[T]` and top-k `([T][k] log-probs, [T][k] ids)`, the Self-Routing route and the loss
    weights. Nothing of it outlives the step (a replayed sample starts unmarked)."""

    logprobs: dict[int, list[float]] = field(default_factory=dict)
    topk: dict[int, tuple[list, list]] = field(default_factory=dict)
    routes: dict[int, str] = field(default_factory=dict)
    weights: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    held: list[Sample] = field(default_factory=list, repr=False)

    def hold(self, samples: list[Sample]) -> None:
        self.held.extend(samples)

    def weight(self, sample: Sample) -> tuple[float, float, float]:
        return self.weights.get(id(sample), DEFAULT_WEIGHTS)

    def set_weights(self, sample: Sample, weights: tuple[float, float, float]) -> None:
        self.hold([sample])
        self.weights[id(sample)] = weights

    def record(self, sample: Sample) -> dict:
        """What `samples/step-N.jsonl` shows of a marked sample: the mean gap between the sampling log-probs and
        the teacher's over the trained tokens (None when none was scored), their count, the teacher's summed
        log-prob, and the route."""
        teacher = self.logprobs.get(id(sample))
        if teacher is None:
            return {"route": self.routes.get(id(sample))} if id(sample) in self.routes else {}
        own = sample.full_logprobs or sample.behaviour_logprobs
        pairs = [(o, t) for o, t, m in zip(own, teacher, sample.loss_mask) if m]
        return {"teacher_gap_mean": sum(o - t for o, t in pairs) / len(pairs) if pairs else None,
                "teacher_tokens": len(pairs), "teacher_logprob_sum": sum(t for _, t in pairs),
                "route": self.routes.get(id(sample))}

    def tensors(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """`(weights [S, 3], teacher_logp [S, T] (NaN where not scored) or None, (topk_logp [S, T, k],
        topk_ids [S, T, k]) or None)` of the micro-batch's samples."""
        samples, (S, T), cpu = mb.samples, mb.targets.shape, torch.device("cpu")  # built on the CPU, moved once
        weights = torch.tensor([list(self.weight(s)) for s in samples], dtype=torch.float32, device=cpu)  # [S, 3]
        teacher = None
        if any(id(s) in self.logprobs for s in samples):
            teacher = torch.full((S, T), float("nan"), device=cpu)
            for b, s in enumerate(samples):
                lp = self.logprobs.get(id(s))
                if lp is not None:
                    _check_length(s, len(lp), "teacher log-probs")
                    teacher[b, :len(lp)] = torch.tensor(lp, device=cpu)
            teacher = teacher.to(mb.device)
        return weights.to(mb.device), teacher, self._topk(samples, S, T, mb.device)

    def _topk(self, samples: list[Sample], S: int, T: int, device: torch.device) -> tuple | None:
        found = [self.topk.get(id(s)) for s in samples]
        k = next((len(t[0][0]) for t in found if t is not None and t[0]), 0)  # an empty response's is ([], [])
        if not k:
            return None
        cpu = torch.device("cpu")
        lp, ids = torch.zeros((S, T, k), device=cpu), torch.zeros((S, T, k), dtype=torch.long, device=cpu)
        for b, (s, t) in enumerate(zip(samples, found)):
            if t is not None and t[0]:
                _check_length(s, len(t[0]), "teacher top-k")
                n = len(t[0])
                lp[b, :n], ids[b, :n] = torch.tensor(t[0], device=cpu), torch.tensor(t[1], device=cpu)
        return lp.to(device), ids.to(device)


def _check_length(sample: Sample, n: int, what: str) -> None:
    if n != len(sample.response_ids):
        raise ValueError(f"sample of group {sample.group_id}: {what} of {n} tokens for {len(sample.response_ids)} "
                         "response tokens")


@dataclass
class StepTerms:
    """One step's distillation and SFT terms (a method builds them from `[distill]`, the stage and its marks)."""

    teacher: bool = False  # this stage's samples were scored by the teacher
    objective: str = "opd"
    coef: float = 1.0
    reward_weight: float = 1.0
    gkd_beta: float = 0.5
    temperature: float = 1.0  # gkd: the student's logits are compared at the teacher's temperature
    sft_coef: float = 0.0
    sft_only: bool = False
    marks: StepMarks = field(default_factory=StepMarks)
    softcap: float | None = None  # gkd: the student's final-logit soft-cap (Gemma 2), None for most models
    chunk_tokens: int = CHUNK_TOKENS  # gkd: response positions per LM-head chunk
    record: "StepRecord" = field(default_factory=lambda: StepRecord(), repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def policy_loss(self) -> bool:
        return not self.sft_only

    @property
    def compares_engine(self) -> bool:
        return not self.sft_only  # demonstrations have no engine log-probs to compare

    @property
    def needs_hidden(self) -> bool:
        return self.teacher and self.objective == "gkd"

    def start(self) -> None:
        """Forget the metrics of an earlier update (the trainer calls this before its first micro-batch)."""
        self.record = StepRecord()

    def metrics(self) -> dict[str, float]:
        """`distill/*` of the step's batch (see the module docstring); {} when nothing was recorded."""
        return self.record.metrics(opd=self.teacher and self.objective == "opd")

    def _tensors(self, mb: MicroBatch):
        """`StepMarks.tensors` of `mb`, built once per micro-batch."""
        key = id(mb)
        if key not in self._cache:
            self._cache[key] = (mb, self.marks.tensors(mb))  # mb kept: its id stays unique while cached
        return self._cache[key][1]

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The advantages the policy loss uses: `[S]` (no teacher term) or `[S, T]` (opd).

        `own_logp [S, T]`: the student's own untruncated log-probs of the sampled tokens (no gradient needed);
        `entropy [S, T]`: the policy's, recorded with the gaps for `distill/entropy_at_top_gap`."""
        w, teacher_logp, _ = self._tensors(mb)  # [S, 3], [S, T] or None
        route = w[:, 0] if mb.advantages.dim() == 1 else w[:, 0:1]  # outcome [S] or critic (gae) [S, T] advantages
        base = mb.advantages * route * (self.reward_weight if self.teacher else 1.0)
        if not self.teacher or teacher_logp is None:
            return base
        scored = torch.isfinite(teacher_logp)  # [S, T]
        teacher = torch.where(scored, teacher_logp, own_logp)  # unscored tokens: no gap
        self.record.gaps(mb, own_logp - teacher, mb.loss_mask * scored, entropy)
        if self.objective != "opd":
            return base
        adv, _ = algo.distill("opd", own_logp, teacher, mb.loss_mask, reward_advantage=base,
                              coef=self.coef * w[:, 1:2])
        return adv

    def extra_loss(self, logp: torch.Tensor, hidden: torch.Tensor | None, head: torch.Tensor, mb: MicroBatch,
                   aggregate, entropy: torch.Tensor | None = None) -> torch.Tensor:
        """GKD and SFT loss terms of one micro-batch (a 0-d tensor, 0.0 when neither applies).

        `logp [S, T]` the policy's log-probs (with gradient); `hidden [n, H]` its final hidden states at the valid
        response positions (gkd only); `head [V, H]` the LM head; `aggregate(per_token, mask)` the run's
        loss aggregation."""
        loss = logp.new_zeros(())
        w, teacher_logp, topk = self._tensors(mb)
        sft_coef = 1.0 if self.sft_only else self.sft_coef
        if sft_coef > 0 and bool((w[:, 2] > 0).any()):
            sft_mask = mb.loss_mask * (w[:, 2:3] > 0)  # [S, T]
            per_token, _ = algo.distill("sft", logp, None, sft_mask)
            loss = loss + sft_coef * aggregate(per_token * w[:, 2:3], mb.loss_mask)
            self.record.total(mb, "distill/sft_nll", per_token.detach().sum(), sft_mask.sum())
        if self.needs_hidden and topk is not None and hidden is not None:
            per_token = gkd_topk(hidden, head, mb, topk, self.gkd_beta, self.temperature, self.chunk_tokens,
                                 self.softcap)
            mask = mb.loss_mask * torch.isfinite(teacher_logp)
            loss = loss + self.coef * aggregate(per_token * w[:, 1:2] * mask, mb.loss_mask)
            self.record.total(mb, "distill/gkd", (per_token.detach() * mask).sum(), mask.sum())
        return loss


@dataclass
class StepRecord:
    """Per-token gaps and term sums of one step's micro-batches, the first pass over each (by identity)."""

    rows: dict = field(default_factory=dict)  # id(mb) -> (gap [S, T], mask [S, T], entropy [S, T] or None)
    sums: dict = field(default_factory=dict)  # metric -> {id(mb): (sum, count)}

    def gaps(self, mb: MicroBatch, gap: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None) -> None:
        if id(mb) not in self.rows:
            self.rows[id(mb)] = (gap.detach().float(), mask.detach().float(),
                                 None if entropy is None else entropy.detach().float())

    def total(self, mb: MicroBatch, key: str, value: torch.Tensor, count: torch.Tensor) -> None:
        self.sums.setdefault(key, {}).setdefault(id(mb), (float(value), float(count)))

    def metrics(self, opd: bool) -> dict[str, float]:
        out = {}
        for key, parts in self.sums.items():
            count = sum(c for _, c in parts.values())
            if count > 0:
                out[key] = sum(v for v, _ in parts.values()) / count
        if self.rows:
            rows = list(self.rows.values())
            width = max(gap.shape[1] for gap, _, _ in rows)
            pad = lambda t: F.pad(t, (0, width - t.shape[1]))  # noqa: E731  [S, T] -> [S, width], zeros
            entropy = None if any(e is None for _, _, e in rows) else torch.cat([pad(e) for _, _, e in rows])
            gaps = gap_metrics(torch.cat([pad(g) for g, _, _ in rows]), torch.cat([pad(m) for _, m, _ in rows]),
                               entropy)
            out.update(gaps)
            if opd and "distill/gap_mean" in gaps:
                out["distill/teacher_kl"] = gaps["distill/gap_mean"]
        return out


def gkd_topk(hidden: torch.Tensor, head: torch.Tensor, mb: MicroBatch, topk: tuple[torch.Tensor, torch.Tensor],
             beta: float, temperature: float, chunk_tokens: int = CHUNK_TOKENS,
             softcap: float | None = None) -> torch.Tensor:
    """Normalised generalized JSD (`rollwise.algo.distillation.generalized_jsd`) over the teacher's top-k tokens
    plus one tail bucket, per response token `[S, T]`.

    Both distributions are reduced to k + 1 buckets: the teacher's top-k ids, and everything else (log of one
    minus their mass). The student's come from its full softmax at `temperature` (`hidden [n, H]` of the valid
    positions, `head [V, H]`); the teacher's, `topk = (log-probs [S, T, k], ids [S, T, k])`, from scoring. The student's `[n, V]` logits are
    never built for the whole micro-batch: rows go through the head `chunk_tokens` at a time
    (`rollwise.train.logprobs.row_chunks`), and each chunk is recomputed in the backward pass
    (`torch.utils.checkpoint`) instead of keeping its `[chunk, V]` softmax, so the peak is a few
    `chunk_tokens x V` fp32 blocks whatever n is."""
    t_lp, ids = topk  # [S, T, k] each
    valid = mb.valid
    S, T = mb.targets.shape
    h = (hidden / temperature).to(head.dtype)  # [n, H]
    teacher = with_tail(t_lp[valid])  # [n, k + 1]
    top_ids = ids[valid]  # [n, k]
    if h.shape[0] == 0:
        return torch.zeros(S, T, device=h.device)
    cap = softcap / temperature if softcap else None  # the cap of the logits at this temperature
    per = torch.cat([checkpoint(_gkd_rows, h[rows], head, top_ids[rows], teacher[rows], beta, cap,
                                use_reentrant=False)
                     for rows in row_chunks(h.shape[0], chunk_tokens)])  # [n]
    return torch.zeros(S, T, dtype=per.dtype, device=per.device).masked_scatter(valid, per)


def _gkd_rows(h: torch.Tensor, head: torch.Tensor, top_ids: torch.Tensor, teacher: torch.Tensor,
              beta: float, cap: float | None = None) -> torch.Tensor:
    """One chunk: `h [C, H]`, `head [V, H]`, `top_ids [C, k]`, teacher buckets `[C, k + 1]` -> GJSD `[C]`. `cap`:
    the final-logit soft-cap at this temperature (Gemma 2), or None."""
    logits = (h @ head.T).float()  # [C, V]
    if cap:
        logits = torch.tanh(logits / cap) * cap
    student = torch.log_softmax(logits, dim=-1).gather(-1, top_ids)  # [C, k]
    return generalized_jsd(with_tail(student), teacher, beta)


def with_tail(top_logp: torch.Tensor) -> torch.Tensor:
    """`[..., k]` log-probs of k tokens -> `[..., k + 1]`: the tokens and the rest of the vocabulary."""
    mass = top_logp.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-6)
    return torch.cat([top_logp, torch.log1p(-mass)], dim=-1)
