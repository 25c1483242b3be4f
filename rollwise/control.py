"""The Control stage: assemble each step's batch of scored, informative groups.

One `Controller.collect` call runs generation rounds until the batch holds `rollout.prompts_per_step` groups:

- plain: one round of `prompts_per_step` new groups, scored and filtered.
- dynamic sampling (`control.dynamic_sampling`, DAPO, Yu et al. 2025): further rounds refill the groups the
  filters dropped, over-sampling by the observed keep rate, up to `control.max_sampling_rounds`.
- partial rollouts (`control.partial_rollouts`, APRIL, Zhou et al. 2025): a round starts
  `over_provision x needed` groups (unfinished groups from earlier steps first) and aborts the rest once enough
  are complete. Unfinished responses keep their tokens, behaviour log-probs and the policy version of every
  span, and continue in the next step under the new weights; complete groups beyond the batch wait in `ready`
  for a later step.
  No trained token is older than `max_staleness` versions (see `Controller`).
- asynchronous mode (`control.mode = "async"`): the first round of step `t` was submitted to the generation
  process `max_staleness` steps earlier, so generation overlaps training; a job for step `k` waits for
  weights of version `k - max_staleness` at least, and groups older than that are never trained on.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from rollwise import algo
from rollwise.config import Config
from rollwise.filter import apply_filters
from rollwise.generate.groups import StopRule, is_complete, new_groups, oldest_version, sampling_params
from rollwise.rewards import reward_metrics, score_batch
from rollwise.types import Group, Prompt, Sample, Status

PromptFn = Callable[[int], list[tuple[Prompt, list[int]]]]


@dataclass
class StepBatch:
    """What Control hands on: the groups to train on and every sample scored this step."""

    groups: list[Group]
    scored: list[Sample] = field(default_factory=list)  # scored without error, kept or not
    generated: list[Group] = field(default_factory=list)  # every group completed this step, kept or not
    replayed: list[Sample] = field(default_factory=list)  # set by the loop: samples drawn from the replay buffer
    trained: list[Sample] = field(default_factory=list)  # set by the loop: fresh + replayed samples
    record: Callable[[Sample], dict] = field(default=lambda sample: {})  # set by the loop: the method's log view
    metrics: dict[str, float] = field(default_factory=dict)
    generate_s: float = 0.0
    groups_short: int = 0  # groups the batch lacks after the filters (what `ssr` replay refills)


class Controller:
    """Runs the generation rounds of each step and keeps what crosses steps (unfinished and surplus groups,
    jobs already submitted to a generation process).

    The partial-rollout staleness bound, by construction: a group's age at trainer version `v` is `v` minus
    the version of its oldest token, and no group older than `max_staleness` is trained at `v`.
    - Each batch takes the oldest groups first (waiting in `ready` or complete in this step's round alike, by
      oldest token, then group id); younger complete groups wait in `ready`.
    - A group at age exactly `max_staleness` is trained in this step or never: a carried one is not aborted
      again but runs to completion in this step's round (a round runs for it alone when `ready` already fills
      the batch), and it sorts ahead of every younger group.
    - If more groups are at that age than `prompts_per_step`, the ready ones keep their slots, then the
      carried ones with most tokens; the other carried ones are dropped before more compute goes into them,
      and surplus complete ones at that age are dropped at the end of the step.
    - So what is left in `ready` or `carried` after a step is at most `max_staleness - 1` old: trainable at
      the next version. A group found older than the bound when a step starts (the version moved by more than
      one, or `max_staleness` was lowered on resume) is dropped.
    Drops are counted (`control/groups_stale_dropped`, `control/tokens_stale_dropped`); nothing else
    generated is lost: engine tokens = trained + carried + ready + dropped (tests/test_staleness_grid.py).

    Args:
        cfg: the run config (`rollout`, `control`, `algo.filter_zero_variance`).
        rollouts: `LocalRollouts` or `ProcessRollouts` (rollwise.rollout).
        next_prompts: `n -> [(prompt, ids)]`, the next `n` training prompts in data order.
        reward_fn: the run's reward function.
        timer: `StageTimer` of the loop (`rollout`, `reward`, `filter` stages).
    """

    def __init__(self, cfg: Config, rollouts, next_prompts: PromptFn, reward_fn):
        self.cfg = cfg
        self.rollouts = rollouts
        self.next_prompts = next_prompts
        self.reward_fn = reward_fn
        self.params = sampling_params(cfg.rollout)
        self.substitution = None  # rollwise.envs.substitution.HardSampleSubstitution, set by the session
        self.carried: list[Group] = []  # started, not complete (partial rollouts)
        self.ready: list[Group] = []  # complete, scored and kept, waiting for a batch (partial rollouts)
        self.inflight: deque[tuple[int, int, list[Group]]] = deque()  # async: (job, step, groups)
        self.next_group_id = 0
        self.next_job = 0
        self.next_prefetch_step = 0
        self.forced = 0  # partial rollouts: carried groups run to completion (staleness bound) this step
        self.keep_rate = 1.0  # running fraction of generated groups the filters keep (dynamic over-sampling)
        group_relative = algo.is_group_advantage(cfg.algo.advantage)
        self.filters = ["all_failed"] + (["zero_variance"] if cfg.algo.filter_zero_variance and group_relative else [])

    def keep_uniform_groups(self, keep: bool) -> None:
        """Keep groups whose rewards are all equal (teacher and SFT stages: the teacher's token signal, or the
        correct responses, do not need reward variance); otherwise drop them as `algo.filter_zero_variance` says."""
        group_relative = algo.is_group_advantage(self.cfg.algo.advantage)
        zero_variance = self.cfg.algo.filter_zero_variance and group_relative and not keep
        self.filters = ["all_failed"] + (["zero_variance"] if zero_variance else [])

    # -- one step -------------------------------------------------------------------------------------------
    def collect(self, step: int, version: int, timer) -> StepBatch:
        """The batch of step `step` for the trainer at policy `version`: generated by that version (sync), by
        versions down to `version - max_staleness` (async), or continued across versions (partial rollouts)."""
        control, target = self.cfg.control, self.cfg.rollout.prompts_per_step
        counts: Counter = Counter()
        self.forced = 0
        if control.partial_rollouts:
            self._age_out(version, target, counts)
        out = StepBatch(groups=self.ready)  # every ready group competes for the batch (`_trim`, oldest first)
        self.ready = []
        max_rounds = control.max_sampling_rounds if control.dynamic_sampling else 1
        while counts["rounds"] < max_rounds and (len(out.groups) < target or self._due(version)):
            counts["rounds"] += 1
            need = max(0, target - len(out.groups))
            with timer("rollout"):
                groups, result = self._generate(step, version, need, first=counts["rounds"] == 1)
            out.generate_s += result.generate_s
            complete = [g for g in groups if is_complete(g)]
            out.generated += complete
            ran = {id(g) for g in groups}
            self.carried = [g for g in self.carried if id(g) not in ran] + [g for g in groups if not is_complete(g)]
            complete = self._check_staleness(complete, result.version, version, counts)  # stale ones: not scored
            with timer("reward"):
                # one call for the round: a reward with a batch hook (worker processes, a judge's concurrent
                # requests) scores them together
                out.scored += score_batch([s for g in complete for s in g.samples], self.reward_fn,
                                          self.cfg.reward.timeout_s)
                counts["samples"] += sum(len(g.samples) for g in complete)
            if self.substitution is not None and complete:  # ToolExpander: rescue groups nothing solved
                with timer("rollout"):
                    added, removed = self.substitution(complete, self.params)
                gone = {id(s) for s in removed}
                out.scored = [s for s in out.scored if id(s) not in gone] + added
            with timer("filter"):
                kept, dropped = apply_filters(complete, self.filters)
            counts.update(dropped)
            counts["groups_generated"] += len(complete)
            counts["aborted"] += result.stats.aborted
            out.groups += kept
            if complete:
                self.keep_rate = 0.5 * self.keep_rate + 0.5 * len(kept) / len(complete)
        if control.mode == "async":
            self.prefetch(step + 1, version)
        self._trim(out, target, version, counts)
        out.groups_short = max(0, target - len(out.groups))
        out.metrics = self._metrics(out, counts, target)
        if self.substitution is not None:  # what hard-sample substitution did this step
            out.metrics.update(self.substitution.metrics())
        return out

    def _generate(self, step: int, version: int, need: int, first: bool):
        """Run one generation round; returns (the groups it ran, `JobResult`)."""
        control = self.cfg.control
        if control.mode == "async":
            if first:
                self.prefetch(step, version)
                job, _, groups = self.inflight.popleft()
            else:  # a refill round: any weights within the staleness bound will do
                groups = self._new(math.ceil(need / max(self.keep_rate, 0.25)))
                job = self._submit(groups, min_version=max(0, version - control.max_staleness))
            return groups, self.rollouts.wait(job)
        wanted = need if first else math.ceil(need / max(self.keep_rate, 0.25))
        stop = None
        if control.partial_rollouts:
            # a group whose oldest token is max_staleness versions old runs to completion in this round
            old = frozenset(g.group_id for g in self._due(version))
            self.forced += len(old)
            if need == 0:  # ready groups fill the batch: finish only the groups that cannot wait
                groups = [g for g in self.carried if g.group_id in old]
                return groups, self.rollouts.wait(self._submit(groups))
            wanted, stop = math.ceil(control.over_provision * need), StopRule(need, old)
        groups = self.carried + self._new(max(0, wanted - len(self.carried)))
        job = self._submit(groups, stop=stop)
        return groups, self.rollouts.wait(job)

    def _age(self, group: Group, version: int) -> int:
        """Versions between `version` and the group's oldest token (0 for a group with no token yet)."""
        return version - oldest_version(group.samples, version)

    def _due(self, version: int) -> list[Group]:
        """Carried groups at age `max_staleness`: finished and trained this step, or never."""
        return [g for g in self.carried if self._age(g, version) == self.cfg.control.max_staleness]

    def _age_out(self, version: int, target: int, counts: Counter) -> None:
        """Partial rollouts, before a step's rounds: drop (and count) what no batch can train within the bound.

        Ready and carried groups older than `max_staleness` go. Of the groups at age `max_staleness` (this
        step's batch or never), the ready ones keep their slots first; carried ones fill the slots left, those
        with most tokens first, and the rest are dropped before more compute goes into them.
        """
        bound = self.cfg.control.max_staleness
        stale = [g for g in self.ready + self.carried if self._age(g, version) > bound]
        self.ready = [g for g in self.ready if self._age(g, version) <= bound]
        due_ready = sum(self._age(g, version) == bound for g in self.ready)
        due = sorted(self._due(version), key=lambda g: (-sum(len(s.response_ids) for s in g.samples), g.group_id))
        stale += due[max(0, target - due_ready):]
        gone = {id(g) for g in stale}
        self.carried = [g for g in self.carried if id(g) not in gone and self._age(g, version) <= bound]
        self._drop(stale, counts)

    @staticmethod
    def _drop(groups: list[Group], counts: Counter) -> None:
        """Count groups dropped for the staleness bound (`control/groups_stale_dropped`, `.../tokens_...`)."""
        counts["stale"] += len(groups)
        counts["stale_tokens"] += sum(len(s.response_ids) for g in groups for s in g.samples)

    def _new(self, n: int) -> list[Group]:
        groups = new_groups(self.next_prompts(n), self.cfg.rollout.samples_per_prompt, self.next_group_id)
        self.next_group_id += n
        return groups

    def _submit(self, groups: list[Group], min_version: int = 0, stop: StopRule | None = None) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        self.rollouts.submit(job, groups, self.params, min_version=min_version, stop=stop)
        return job

    def prefetch(self, step: int, version: int) -> None:
        """Async mode: keep the first rounds of steps `step .. step + max_staleness` submitted; the job of step
        `k` waits for weights of version `k - max_staleness` at least."""
        staleness = self.cfg.control.max_staleness
        while self.next_prefetch_step <= step + staleness:
            k = self.next_prefetch_step
            groups = self._new(self.cfg.rollout.prompts_per_step)
            self.inflight.append((self._submit(groups, min_version=max(0, k - staleness)), k, groups))
            self.next_prefetch_step += 1

    def _check_staleness(self, groups: list[Group], generated_by: int, version: int, counts: Counter) -> list[Group]:
        """The groups within the staleness bound; older ones (async; a guard, not the rule) are marked FAILED
        with the reason, counted, and left out of scoring and training."""
        if self.cfg.control.mode != "async" or generated_by >= version - self.cfg.control.max_staleness:
            return groups
        counts["stale"] += len(groups)
        for g in groups:
            for s in g.samples:
                s.status = Status.FAILED
                s.reward_error = f"generated by policy version {generated_by}, older than the staleness bound"
        return []

    def _trim(self, out: StepBatch, target: int, version: int, counts: Counter) -> None:
        """Keep `target` groups. Partial rollouts: the oldest first (by oldest token, then group id), and the
        surplus waits in `ready` for a later step; otherwise the surplus is dropped."""
        if self.cfg.control.partial_rollouts:
            pool = sorted(out.groups, key=lambda g: (oldest_version(g.samples, version), g.group_id))
            out.groups, surplus = pool[:target], pool[target:]
            # the next batch trains at `version + 1`: a group already max_staleness old cannot go into it
            bound = self.cfg.control.max_staleness
            self.ready = [g for g in surplus if self._age(g, version) < bound]
            self._drop([g for g in surplus if self._age(g, version) >= bound], counts)
            return
        counts["surplus_dropped"] += len(out.groups[target:])
        out.groups = out.groups[:target]

    def _metrics(self, out: StepBatch, counts: Counter, target: int) -> dict[str, float]:
        considered = max(1, counts["groups_generated"])
        metrics = reward_metrics(out.scored, counts["samples"])
        for reason in ["all_failed", "zero_variance", *self.filters]:
            metrics[f"filter/{reason}_frac"] = counts[reason] / considered
        metrics["filter/kept_frac"] = (counts["groups_generated"] - sum(counts[r] for r in self.filters)) / considered
        metrics["filter/groups_kept"] = float(len(out.groups))
        carried_samples = [s for g in self.carried for s in g.samples if s.status not in (Status.PENDING,)]
        metrics.update({
            "control/sampling_rounds": float(counts["rounds"]),
            "control/groups_generated": float(counts["groups_generated"]),
            "control/batch_groups": float(len(out.groups)),
            "control/batch_short": float(out.groups_short),
            "control/groups_surplus_dropped": float(counts["surplus_dropped"]),
            "control/groups_ready": float(len(self.ready)),
            "control/groups_carried": float(len(self.carried)),
            "control/responses_aborted": float(counts["aborted"]),
            "control/tokens_carried": float(sum(len(s.response_ids) for s in carried_samples)),
            "control/groups_stale_dropped": float(counts["stale"]),
            "control/tokens_stale_dropped": float(counts["stale_tokens"]),
            "control/groups_finished_for_staleness": float(self.forced),
        })
        return metrics

    # -- checkpoint -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Unfinished and waiting groups, and the prompts of submitted jobs (generated again on resume)."""
        return {"carried": self.carried, "ready": self.ready, "next_group_id": self.next_group_id,
                "keep_rate": self.keep_rate, "inflight": [(k, groups) for _, k, groups in self.inflight]}

    def load_state_dict(self, state: dict) -> None:
        self.carried, self.ready = state["carried"], state["ready"]
        self.next_group_id, self.keep_rate = state["next_group_id"], state["keep_rate"]
        for k, groups in state["inflight"]:
            for g in groups:  # a job's results were never received: generate them again
                for s in g.samples:
                    s.status, s.response_ids, s.behaviour_logprobs, s.version_spans = Status.PENDING, [], [], []
                    s.full_logprobs, s.loss_mask, s.turns, s.tool_calls, s.episode = [], [], [], [], None
            staleness = self.cfg.control.max_staleness
            self.inflight.append((self._submit(groups, min_version=max(0, k - staleness)), k, groups))
            self.next_prefetch_step = k + 1


def staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """Token-weighted policy-version age of the trained samples at `version`: `control/off_policy_token_frac`,
    `control/staleness_mean`, `control/staleness_max` and `control/age_tokens_frac/<age>` (ages 0, 1, 2, 3+)."""
    ages: Counter = Counter()
    for s in samples:
        for start, end, span_version in s.version_spans:
            ages[max(0, version - span_version)] += end - start
    total = sum(ages.values())
    if total == 0:
        return {}
    metrics = {
        "control/off_policy_token_frac": 1.0 - ages[0] / total,
        "control/staleness_mean": sum(a * n for a, n in ages.items()) / total,
        "control/staleness_max": float(max(ages)),
        "control/samples_mixed_versions": float(sum(len({v for _, _, v in s.version_spans}) > 1 for s in samples)),
    }
    for age in range(3):
        metrics[f"control/age_tokens_frac/{age}"] = ages[age] / total
    metrics["control/age_tokens_frac/3+"] = sum(n for a, n in ages.items() if a >= 3) / total
    return metrics
