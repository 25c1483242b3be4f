"""`duet`: DUal-controlled tokEn allocaTion (DUET, the DUET paper among the seeds): a step's rollout token budget
controlled along two axes at once: how many rollouts each prompt gets, from a cheap pre-rollout surrogate of its
informativeness, and when a rollout stops, by a marker-gated abort rule with importance reweighting of what
remains.

Two halves, set together (`rollout.strategy = "duet"` and `algo.method = "duet"`;
--dry-run checks the method's side, the strategy refuses to start without the method):

- `DuetStrategy` (the rollout, a `rollout.strategy` plugin):
  * surrogate: the prompt's running pass rate p (an exponential average over its past groups,
    `rollout.duet.momentum`); a prompt not seen yet takes its family's (for arith the operator, `info["op"]`,
    within its `[[data.mix]]` source), then the running rate over all prompts (0.5 before any). Informativeness
    is the Bernoulli variance `u = p (1 - p)`, the expected reward variance of its group, which GRPO's signal
    needs.
  * counts: the round's budget `rollout.duet.budget_tokens` buys `R = floor(budget / L)` rollouts, `L` the
    running mean tokens per rollout (`rollout.max_new_tokens` before the first round), within
    `[min_samples, samples_per_prompt] x prompts`. Each prompt gets `min_samples`; the rest go one at a
    time to the prompt with the largest `(u + 1e-3) / (n + 1)` below `samples_per_prompt` (D'Hondt's rule:
    counts proportional to u, a tiny floor so that solved and hopeless prompts are not starved below the
    minimum only by ties). The group keeps the first n of its samples; the others are never generated.
  * abort rule: every rollout first runs `rollout.duet.abort_tokens` tokens; one that reached it without having
    written `rollout.duet.marker` is aborted there (kept as a truncated response, `info["duet_aborted"]`), the
    others continue to `rollout.max_new_tokens`. Tokens not generated are logged (`duet/tokens_saved`).
- `DUET` (the method): aborted responses stay in their group's baseline with the reward their prefix earns
  (usually 0: the answer comes after the marker) and leave the update; the survivors of a group of n with s
  survivors are importance-weighted by `n / s`, the inverse of the group's estimated survival rate, so each
  prompt still weighs what its allocation bought.

What the abstract leaves open, filled in here: the surrogate (a running pass rate; the paper's is not described),
the informativeness measure `p (1 - p)`, the integer allocation rule, the fate of aborted responses (dropped
from the update, kept in the baseline) and the form of the importance weight (per-group inverse survival rate).
The budget is per generation round (a dynamic-sampling refill round gets the same budget).

Metrics: from the strategy `duet/rollouts` (this round), `duet/count_min`, `duet/count_max`,
`duet/aborted_frac`, `duet/tokens_saved` (tokens the counts and the abort rule did not generate against
`samples_per_prompt x max_new_tokens` per prompt), `duet/tokens_per_rollout` (L), `duet/pass_rate_prior`; from
the method `duet/trained_frac` and `duet/weight_mean` (over survivors).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.errors import UserError
from rollwise.generate.groups import GenerateStats, StopRule, is_complete
from rollwise.methods.base import Prepared, StepInput, outcome_advantage_errors
from rollwise.methods.rl import RL
from rollwise.rollout import run_groups
from rollwise.types import Group, Prompt, SamplingParams, Status

DUET_STRATEGY = "duet"  # ROLLOUT_STRATEGIES entry (rollwise.rollout_strategies) of `duet_strategy` below
FLOOR = 1e-3  # informativeness floor in the allocation (see the module docstring)


def allocate(informativeness: list[float], total: int, min_samples: int, max_samples: int) -> list[int]:
    """Rollout counts per prompt: `min_samples` each, then one at a time to the prompt with the largest
    `(u + FLOOR) / (n + 1)` among those below `max_samples` (ties: the first); `total` is clipped to
    `[min_samples, max_samples] x prompts`."""
    counts = [min_samples] * len(informativeness)
    left = min(total, max_samples * len(counts)) - sum(counts)
    for _ in range(max(0, left)):
        open_ = [i for i, n in enumerate(counts) if n < max_samples]
        best = max(open_, key=lambda i: ((informativeness[i] + FLOOR) / (counts[i] + 1), -i))
        counts[best] += 1
    return counts


def family(prompt: Prompt) -> str:
    """The surrogate's fallback key of a prompt: its mix source and, for arith, its operator."""
    return f"{prompt.origin}/{prompt.info.get('op', '')}"


class DuetOptions(MethodOptions, section="rollout", name="duet"):
    """`[rollout.duet]`: DUET's rollout allocation and abort rule (with `algo.method = "duet"`)."""

    budget_tokens: int = Field(0, ge=0, description="rollout tokens one generation round may spend; the rollouts it "
                               "buys go to prompts by informativeness; 0 = samples_per_prompt for every prompt")
    min_samples: int = Field(2, ge=2, description="rollouts every prompt gets, whatever its informativeness")
    abort_tokens: int = Field(0, ge=0, description="a rollout that has not written the marker after this many tokens "
                              "is aborted there (and left out of the update); 0 = no abort rule")
    marker: str = Field("The answer is", min_length=1, description="the text whose appearance lets a rollout "
                        "continue past abort_tokens")
    momentum: float = Field(0.5, ge=0.0, lt=1.0, description="running pass rate = momentum x old + (1 - momentum) x "
                            "the new group's; also the running tokens per rollout")


class DuetStrategy:
    """The rollout half of DUET (see the module docstring).

    Args:
        cfg: the run config (`[rollout.duet]`, `samples_per_prompt`, `max_new_tokens`).
    """

    def __init__(self, cfg) -> None:
        r, o = cfg.rollout, DuetOptions.of(cfg)
        self.budget_tokens, self.min_samples, self.max_samples = o.budget_tokens, o.min_samples, r.samples_per_prompt
        self.abort_tokens, self.marker, self.momentum = o.abort_tokens, o.marker, o.momentum
        self.tokens_per_rollout = float(r.max_new_tokens)
        self.pass_rate: dict[str, float] = {}  # prompt uid or family -> running pass rate
        self.overall = 0.5
        self._last: list[Group] = []
        self._metrics: dict[str, float] = {}

    def prior(self, prompt: Prompt) -> float:
        return self.pass_rate.get(prompt.uid, self.pass_rate.get(family(prompt), self.overall))

    def observe(self, groups: list[Group]) -> None:
        """Learn the running pass rates from the scored samples of `groups` (the previous round's)."""
        m = self.momentum
        for g in groups:
            graded = [s for s in g.samples if s.correct is not None]
            if not graded:
                continue
            rate = sum(bool(s.correct) for s in graded) / len(graded)
            for key in (g.prompt.uid, family(g.prompt)):
                self.pass_rate[key] = m * self.pass_rate.get(key, self.overall) + (1 - m) * rate
            self.overall = m * self.overall + (1 - m) * rate

    def counts(self, groups: list[Group]) -> list[int]:
        """Rollouts per group of this round (see `allocate`); every prompt gets the most without a budget."""
        if self.budget_tokens == 0:
            return [self.max_samples] * len(groups)
        rollouts = int(self.budget_tokens // max(1.0, self.tokens_per_rollout))
        return allocate([p * (1 - p) for p in map(self.prior, (g.prompt for g in groups))], rollouts,
                        self.min_samples, self.max_samples)

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        self.observe(self._last)
        self._last = list(groups)
        counts = self.counts(groups)
        for g, n in zip(groups, counts):  # the samples beyond n are never generated
            if all(s.status == Status.PENDING and not s.response_ids for s in g.samples):
                g.samples = g.samples[:n]
        samples = [s for g in groups for s in g.samples]
        gated = 0 < self.abort_tokens < params.max_new_tokens
        stats = run_groups(engine, groups, replace(params, max_new_tokens=self.abort_tokens) if gated else params,
                           ids, stop)
        aborted = []
        if gated:
            at_gate = [s for s in samples if s.status == Status.TRUNCATED and len(s.response_ids) >= self.abort_tokens]
            for s in at_gate:
                if self.marker in s.response_text:
                    s.status = Status.PENDING  # continues from its tokens to max_new_tokens
                else:
                    s.info["duet_aborted"] = True
                    aborted.append(s)
            more = run_groups(engine, groups, params, ids, stop)
            stats = GenerateStats(stats.requests + more.requests, stats.aborted + more.aborted,
                                  sum(is_complete(g) for g in groups))
        generated = sum(len(s.response_ids) for s in samples)
        if samples:
            m = self.momentum
            self.tokens_per_rollout = m * self.tokens_per_rollout + (1 - m) * generated / len(samples)
        self._metrics = {
            "duet/rollouts": float(len(samples)),
            "duet/count_min": float(min(counts, default=0)),
            "duet/count_max": float(max(counts, default=0)),
            "duet/aborted_frac": len(aborted) / len(samples) if samples else 0.0,
            "duet/tokens_saved": float(len(groups) * self.max_samples * params.max_new_tokens - generated),
            "duet/tokens_per_rollout": self.tokens_per_rollout,
            "duet/pass_rate_prior": self.overall,
        }
        return stats

    def metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out

    def state_dict(self) -> dict:
        """The surrogate (pass rates, overall rate, tokens per rollout), the last round's scored samples folded in
        as the next `run` would fold them first: a resumed run allocates as the uninterrupted one does."""
        self.observe(self._last)
        self._last = []
        return {"pass_rate": dict(self.pass_rate), "overall": self.overall,
                "tokens_per_rollout": self.tokens_per_rollout}

    def load_state_dict(self, state: dict) -> None:
        self.pass_rate, self.overall = dict(state["pass_rate"]), float(state["overall"])
        self.tokens_per_rollout = float(state["tokens_per_rollout"])


def duet_strategy(cfg, context=None) -> DuetStrategy:
    """The `rollout.strategy` factory of DUET; the method half (`algo.method = "duet"`) must run with it."""
    if cfg.algo.method != "duet":
        raise UserError(f"rollout.strategy = {DUET_STRATEGY!r} aborts responses whose weight algo.method = 'duet' "
                        f"restores; algo.method = {cfg.algo.method!r}: set algo.method = 'duet'")
    return DuetStrategy(cfg)


duet_strategy.options = DuetOptions


class DUET(RL):
    """The method half of DUET: aborted responses leave the update, the survivors of a group are weighted by
    `n / s` (then the plain RL step)."""

    @classmethod
    def checks(cls, cfg) -> list[str]:
        r, o, errors = cfg.rollout, DuetOptions.of(cfg), []
        if r.strategy != DUET_STRATEGY:
            errors.append(f"algo.method = 'duet' allocates rollouts in its rollout strategy: set rollout.strategy = "
                          f"{DUET_STRATEGY!r} (now {r.strategy!r})")
        if o.min_samples > r.samples_per_prompt:
            errors.append(f"rollout.duet.min_samples = {o.min_samples} is above rollout.samples_per_prompt = "
                          f"{r.samples_per_prompt}: lower it")
        if o.abort_tokens >= r.max_new_tokens:
            errors.append(f"rollout.duet.abort_tokens = {o.abort_tokens} is not below rollout.max_new_tokens = "
                          f"{r.max_new_tokens}: the abort rule would never act; lower it, or 0 to turn it off")
        return errors + outcome_advantage_errors("duet", cfg, "weighs outcome advantages")

    def prepare(self, step: StepInput) -> Prepared:
        kept, weights = [], []
        for g in step.groups:
            usable = g.usable()
            survivors = [s for s in usable if not s.info.get("duet_aborted")]
            for s in survivors:
                s.advantage *= len(usable) / len(survivors)
                weights.append(len(usable) / len(survivors))
            kept += survivors
        ids = {id(s) for s in kept}
        fresh = [s for s in step.samples if id(s) in ids]
        prepared = super().prepare(StepInput(step.step, step.stage, step.groups, fresh))
        prepared.metrics.update({
            "duet/trained_frac": len(fresh) / len(step.samples) if step.samples else 0.0,
            "duet/weight_mean": sum(weights) / len(weights) if weights else 0.0,
        })
        return prepared
