"""TRB warm-up sampler for on-policy distillation.

TRB (Trust-Region behavior Blending, a warm-up for on-policy distillation): for the first steps of training,
sample each token from the policy closest to the teacher inside a KL trust region around the student. Per token
that policy is the geometric mixture `pi_lam(v) ∝ s(v)^(1-lam) * t(v)^lam` (s, t: student and teacher next-token distributions at
the same temperature) with the largest `lam` in [0, 1] such that `KL(pi_lam || s) <= budget`. As the budget
anneals to 0 the sampler becomes plain student sampling.

Our choices, not the paper's: `lam` is found per token by bisection (KL(pi_lam || s) is increasing in lam: its
derivative is `lam * Var_pi(log t - log s) >= 0`), returning the feasible end of the bracket so the budget is
never exceeded; the budget anneals linearly (`budget_at`). The behaviour log-prob of each token is
log pi_lam(token), so importance corrections against it stay exact; the student's untruncated log-prob at the
same temperature is returned too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rollwise.models.compat import cache_kwargs


def mixture_logp(student_logp: torch.Tensor, teacher_logp: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Normalised log pi_lam = log softmax((1-lam) log s + lam log t).

    student_logp, teacher_logp: [B, V] log-probs (may hold -inf); lam: [B] in [0, 1] -> [B, V]. At lam 0 the
    result is exactly the student row (renormalised), at lam 1 the teacher row, with no 0 * -inf.
    """
    lam = lam.to(student_logp.dtype)[:, None]  # [B, 1]
    mixed = torch.where(lam == 0, student_logp,
                        torch.where(lam == 1, teacher_logp, (1 - lam) * student_logp + lam * teacher_logp))
    return mixed - torch.logsumexp(mixed, dim=-1, keepdim=True)  # [B, V]


def kl_to_student(student_logp: torch.Tensor, teacher_logp: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """KL(pi_lam || s) per row: [B, V], [B, V], [B] -> [B] (terms with pi_lam(v) = 0 count 0)."""
    logp = mixture_logp(student_logp, teacher_logp, lam)  # [B, V]
    terms = torch.where(logp > float("-inf"), logp.exp() * (logp - student_logp), torch.zeros_like(logp))
    return terms.sum(-1)  # [B]


def trust_region_lambda(student_logp: torch.Tensor, teacher_logp: torch.Tensor, budget: float,
                        iters: int = 20) -> torch.Tensor:
    """The largest lam in [0, 1] per row with KL(pi_lam || s) <= budget.

    student_logp, teacher_logp: [B, V] -> lam [B] (dtype of student_logp). Rows whose KL at lam 1 is finite and
    within budget get exactly 1; the others are bisected `iters` times (bracket width 2**-iters) and return the
    lower, feasible end. budget <= 0 gives exact zeros.
    """
    rows = student_logp.shape[0]
    lo = torch.zeros(rows, dtype=student_logp.dtype, device=student_logp.device)  # [B]
    if budget <= 0:
        return lo
    kl_one = kl_to_student(student_logp, teacher_logp, torch.ones_like(lo))  # [B]
    whole = torch.isfinite(kl_one) & (kl_one <= budget)
    hi = torch.ones_like(lo)
    for _ in range(iters):
        mid = (lo + hi) / 2
        ok = kl_to_student(student_logp, teacher_logp, mid) <= budget  # [B]
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return torch.where(whole, torch.ones_like(lo), lo)


def budget_at(step: int, warmup_steps: int, budget0: float) -> float:
    """Per-token KL budget at training `step`: budget0 * (1 - step / warmup_steps), 0 at and after warmup_steps
    (our choice: a linear anneal)."""
    if step < 0:
        raise ValueError(f"TRB budget_at: step must be >= 0, got {step}")
    if warmup_steps <= 0 or step >= warmup_steps:
        return 0.0
    return budget0 * (1 - step / warmup_steps)


@dataclass
class _Decoder:
    """One model's incremental decoding state over a left-padded batch: KV cache, attention mask [B, L],
    next position id per row [B]."""

    model: torch.nn.Module
    cache: DynamicCache
    mask: torch.Tensor
    next_pos: torch.Tensor

    @classmethod
    def prefill(cls, model, prompts: list[list[int]]) -> tuple["_Decoder", torch.Tensor]:
        """Run the left-padded prompts: (state, last-position logits [B, V] fp32)."""
        width = max(len(p) for p in prompts)
        device = next(model.parameters()).device
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        state = cls(model, DynamicCache(), mask, mask.sum(-1))
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **cache_kwargs(model, state.cache))
        return state, out.logits[:, -1].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] long): next-token logits [B, V] fp32."""
        tokens = tokens.to(self.mask.device)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)  # [B, L+1]
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                         use_cache=True, **cache_kwargs(self.model, self.cache))
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()


def _token_logps(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs at `temperature` on the student's device, the narrower vocabulary padded
    with -inf (a teacher with padded extra rows is common): [B, Vs], [B, Vt] -> [B, V], [B, V]."""
    s = torch.log_softmax(student_logits / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.to(s.device) / temperature, dim=-1)
    if s.shape[-1] > t.shape[-1]:
        raise ValueError(f"TRB: the student's vocabulary ({s.shape[-1]}) is wider than the teacher's "
                         f"({t.shape[-1]}); use a teacher whose embedding covers every student token id")
    s = torch.nn.functional.pad(s, (0, t.shape[-1] - s.shape[-1]), value=float("-inf"))
    return s, t


def _check_args(prompts, max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"trb_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"trb_generate: temperature must be > 0 (TRB samples), got {temperature}")
    for i, (student_ids, teacher_ids) in enumerate(prompts):
        if not student_ids or not teacher_ids:
            raise ValueError(f"trb_generate: prompt {i} has an empty student or teacher prompt; give both at "
                             "least one token")


@torch.no_grad()
def trb_generate(student, teacher, prompts: list[tuple[list[int], list[int]]], max_new_tokens: int,
                 temperature: float, budget: float, eos_ids: set[int],
                 generator: torch.Generator) -> list[dict]:
    """Sample one response per prompt from the per-token TRB mixture, batched, each model with its own KV cache.

    `prompts[i]` is (student prompt ids, teacher prompt ids): the teacher may see a privileged prompt; both models
    then read the same sampled response. A response stops after an eos token (kept) or at max_new_tokens.
    Returns, per prompt: response_ids [T] ints, behaviour_logprobs [T] (log pi_lam), student_logprobs [T]
    (log s at `temperature`, untruncated), lam [T], truncated (no eos within max_new_tokens).
    """
    _check_args(prompts, max_new_tokens, temperature)
    student_state, student_logits = _Decoder.prefill(student, [p[0] for p in prompts])
    teacher_state, teacher_logits = _Decoder.prefill(teacher, [p[1] for p in prompts])
    rows = len(prompts)
    out = [{"response_ids": [], "behaviour_logprobs": [], "student_logprobs": [], "lam": [], "truncated": True}
           for _ in range(rows)]
    active = [True] * rows
    for step in range(max_new_tokens):
        s, t = _token_logps(student_logits, teacher_logits, temperature)  # [B, V] each
        lam = trust_region_lambda(s, t, budget)  # [B]
        mix = mixture_logp(s, t, lam)  # [B, V]
        tokens = torch.multinomial(mix.exp().to(generator.device), 1, generator=generator)[:, 0]
        tokens = tokens.to(mix.device)  # [B]
        behaviour = mix.gather(1, tokens[:, None])[:, 0].tolist()
        own = s.gather(1, tokens[:, None])[:, 0].tolist()
        for row, (tok, lam_row) in enumerate(zip(tokens.tolist(), lam.tolist())):
            if not active[row]:
                continue
            rec = out[row]
            rec["response_ids"].append(tok)
            rec["behaviour_logprobs"].append(behaviour[row])
            rec["student_logprobs"].append(own[row])
            rec["lam"].append(lam_row)
            if tok in eos_ids:
                rec["truncated"], active[row] = False, False
        if step == max_new_tokens - 1 or not any(active):
            break
        student_logits = student_state.step(tokens)
        teacher_logits = teacher_state.step(tokens)
    return out
