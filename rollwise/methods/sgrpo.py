"""SGRPO (Supergroup Relative Policy Optimization): a set-level diversity reward, redistributed to rollouts by
leave-one-out contribution and combined with the utility reward (`algo.method = "sgrpo"`).

For each prompt, its responses (the supergroup) are split into `algo.sgrpo.sets` candidate sets `S`. Diversity
is distinct-n over token ids (n = `algo.sgrpo.ngram`), a set-level and embedding-free measure:

    D(S)     = |union of the n-grams of the responses in S| / (total n-grams of the responses in S)   in [0, 1]
    c_i      = max(0, D(S) - D(S \\ {i}))                       leave-one-out contribution of response i
    d_i      = |S| * D(S) * c_i / sum_{j in S} c_j             (d_i = D(S) for all i when every c_j = 0)
    r'_i     = u_i + coef * d_i

`d` hands the set's diversity reward `|S| * D(S)` out to its members in proportion to what each adds (a
duplicate adds nothing), so its mean over a set is `D(S)`: a response in a more diverse set gets more, and the
GRPO-style estimator (`algo.advantage`) then compares `r'` across the whole supergroup, i.e. across sets.
`u_i` is the utility reward (the training reward after shaping).

Paper: SGRPO (see the seeds' abstracts): "samples a supergroup of candidate sets, compares their diversity under
the same condition, and redistributes the group diversity reward to individual rollouts through leave-one-out
diversity contributions before combining it with rollout-level utility". What is filled in, and why:
- The diversity metric is left open by the paper; distinct-n over token ids needs no embedding model and is a
  ratio (distinct over all n-grams), so a long response that repeats itself lowers its set's D; a long response
  of new n-grams still contributes more than a short one (no further length correction).
- The redistribution rule (proportional to the clipped leave-one-out contribution, conserving the set's total)
  and the additive combination with a coefficient are our reading of "redistributes ... before combining".
- The supergroup is a prompt's group as the rollout stage samples it (`rollout.samples_per_prompt` responses),
  split into contiguous sets in sampling order (the order carries no information, so the split is random).
- Groups whose utility rewards are all equal are kept (`keeps_uniform_groups`): diversity alone trains them.
"""

from __future__ import annotations

import torch

from rollwise import algo
from rollwise.algo.options import estimator_options
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.types import Sample


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    """The n-grams of one response (empty when it has fewer than n tokens)."""
    return [tuple(ids[k:k + n]) for k in range(len(ids) - n + 1)]


def distinct_n(grams: list[list[tuple[int, ...]]]) -> float:
    """D of a set given each member's n-grams: distinct n-grams / all n-grams (0 for a set with none)."""
    total = sum(len(g) for g in grams)
    return len({x for g in grams for x in g}) / total if total else 0.0


def set_credits(responses: list[list[int]], n: int) -> tuple[list[float], float]:
    """Per-response diversity credit `d_i` of one set and the set's D (see the module docstring)."""
    grams = [ngrams(r, n) for r in responses]
    whole = distinct_n(grams)
    loo = [max(0.0, whole - distinct_n(grams[:i] + grams[i + 1:])) for i in range(len(grams))]
    total = sum(loo)
    if total <= 0.0:
        return [whole] * len(responses), whole
    return [len(responses) * whole * c / total for c in loo], whole


def split_sets(members: list[int], sets: int) -> list[list[int]]:
    """`members` (indices) in `sets` contiguous, near-equal parts (fewer when there are fewer members)."""
    sets = max(1, min(sets, len(members)))
    size, extra = divmod(len(members), sets)
    out, start = [], 0
    for k in range(sets):
        end = start + size + (1 if k < extra else 0)
        out.append(members[start:end])
        start = end
    return out


def diversity_credits(samples: list[Sample], sets: int, n: int) -> tuple[list[float], list[float]]:
    """`d_i` of every sample (`[N]`, in order) with the D of every set, grouping supergroups by `group_id`."""
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id, []).append(i)
    credits, set_d = [0.0] * len(samples), []
    for members in by_group.values():
        for part in split_sets(members, sets):
            values, whole = set_credits([samples[i].response_ids for i in part], n)
            set_d.append(whole)
            for i, v in zip(part, values):
                credits[i] = v
    return credits, set_d


class SGRPOOptions(MethodOptions, section="algo", name="sgrpo"):
    """`[algo.sgrpo]`."""

    coef: float = Field(0.1, ge=0.0, description="weight of the set-level diversity credit added to the utility "
                        "reward (one reply's credit can reach sets' size x D: at 0.5 it outweighs a 0/1 utility)")
    ngram: int = Field(2, ge=1, le=8, description="n of the distinct token n-grams that measure a set's diversity")
    sets: int = Field(2, ge=1, description="candidate sets each prompt's responses are split into (the "
                      "supergroup); rollout.samples_per_prompt must be a multiple of it, with at least 2 responses "
                      "per set")


class SGRPO(Method):
    """GRPO on `utility + coef * diversity credit` (see the module docstring)."""

    options = SGRPOOptions

    keeps_uniform_groups = True  # a group with equal utilities still differs in diversity

    @classmethod
    def checks(cls, cfg) -> list[str]:
        a, o, k = cfg.algo, SGRPOOptions.of(cfg), cfg.rollout.samples_per_prompt
        errors = []
        if algo.is_token_advantage(a.advantage) or a.advantage == "moa":
            errors.append(f"algo.method = 'sgrpo' recomputes outcome advantages from utility + diversity: "
                          f"algo.advantage = {a.advantage!r} cannot take them; use grpo, dr_grpo, rloo or "
                          "reinforce_pp")
        if k % o.sets or k // o.sets < 2:
            errors.append(f"algo.sgrpo.sets = {o.sets} must divide rollout.samples_per_prompt = {k} into sets "
                          "of at least 2 responses; choose a divisor of samples_per_prompt up to half of it")
        if cfg.rollout.max_new_tokens < o.ngram:
            errors.append(f"algo.sgrpo.ngram = {o.ngram} is longer than rollout.max_new_tokens = "
                          f"{cfg.rollout.max_new_tokens}: no response could have an n-gram; lower algo.sgrpo.ngram")
        return errors

    def prepare(self, step: StepInput) -> Prepared:
        samples = step.samples
        if not samples:
            return Prepared(samples)
        a = self.setup.cfg.algo
        credits, set_d = diversity_credits(samples, self.opts.sets, self.opts.ngram)
        utility = [s.train_reward if s.train_reward is not None else s.reward for s in samples]
        combined = torch.tensor([u + self.opts.coef * d for u, d in zip(utility, credits)], dtype=torch.float32)
        group_ids = torch.tensor([s.group_id for s in samples])  # [N]
        options = estimator_options(self.setup.cfg, samples)  # the same keywords as the plain estimator gets
        advantages = algo.advantage(a.advantage, combined, group_ids, **options)  # [N]
        credit_of = {}
        for s, adv, d in zip(samples, advantages.tolist(), credits):
            s.advantage = adv
            credit_of[id(s)] = d
        credit_t = torch.tensor(credits)
        metrics = {"sgrpo/set_diversity_mean": sum(set_d) / len(set_d), "sgrpo/credit_mean": float(credit_t.mean()),
                   "sgrpo/credit_std": float(credit_t.std()) if len(credits) > 1 else 0.0,
                   "sgrpo/uniform_utility_groups": float(uniform_groups(samples, utility))}
        return Prepared(samples, metrics=metrics,
                        record=lambda s: {"sgrpo_credit": credit_of[id(s)]} if id(s) in credit_of else {})


def uniform_groups(samples: list[Sample], utility: list[float]) -> int:
    """Groups whose utility rewards are all equal (GRPO alone would give them no signal)."""
    values: dict[int, set[float]] = {}
    for s, u in zip(samples, utility):
        values.setdefault(s.group_id, set()).add(u)
    return sum(len(v) == 1 for v in values.values())
