"""`hrr`: hindsight relabelling of failed responses (Hindsight Response Replay of ZipRL, and Learning from
Hindsight, LfH; both among the seeds).

A failed response is a success at a different goal: the goal it did reach. Each step, the failed responses of
the step's groups are relabelled with that goal (the prompt's target is rewritten), scored by the run's reward
under the relabelled prompt, and replayed into the step's update next to the original responses (LfH: "the
policy trains on the relabeled and original rollouts jointly").

The relabel is a task hook, `relabel(task, sample) -> Prompt | None` (`RELABELERS`, by task name; None when the
response reached no goal the task can state). Built in: `arith`, where the goal reached is the number the
response computed (a response that ended; a truncated one concluded nothing): for a prompt `a op b` answered
`N != a op b`, the relabelled prompt is `a op b'` with the `b'` that makes `a op b' = N` (`b' = N - a`, `a - N`,
or `N / a` when that is a non-negative integer), written "What is a op b'?" with answer N. A relabelled prompt that lands in the task's held-out split
(`task.is_held_out`) is not used, so evaluation never meets a trained relabel. Other tasks have no hook:
`algo.method = "hrr"` on them fails at --dry-run.

What the abstracts leave open, and what is filled in here:

- the advantage of a relabelled response (ZipRL: "HRR into GRPO via generalized advantage reshaping"): it has
  no group of its own under the new prompt, so it is scored against the group it was sampled in:
  `A = weight x (r_relabelled - mean reward of its original group)`; in a group that failed everywhere
  (the case hindsight is for, LfH) that is `weight x r_relabelled`. No std normalisation: the std of an
  all-failed group is 0.
- groups whose rewards are all equal reach the method (`keeps_uniform_groups`): their failures are what gets
  relabelled; their original responses, advantage 0, still leave the update as the zero-variance filter would
  have dropped them (with `algo.filter_zero_variance`).
- "replay": relabelled responses join the update of the step that sampled them (one replay), at most
  `algo.hrr.max_per_group` per group; they are not stored for later steps.
- a relabelled response keeps the engine's behaviour log-probs, which were taken under the original prompt; the
  trainer's old log-probs must therefore be recomputed under the relabelled one (`train.old_logprobs =
  "recompute"`, checked) and no engine importance correction applies (`algo.is_correction = "none"`, checked).
  The step's `mismatch/*` metrics include these responses and read higher than the engine's true gap.

Metrics: `hrr/relabelled` (responses replayed under a relabelled goal), `hrr/relabel_frac` (of the step's
failed responses), `hrr/relabelled_reward_mean` (their reward under the relabelled goal),
`hrr/advantage_mean` (their advantage), `hrr/reward_failed` (relabelled responses the reward raised on: not
trained; the same reward scores every response of the run, so a reward that keeps failing stops the run there).
A logged failed response records `hrr_goal`, the answer it was relabelled with (absent when not relabelled).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from rollwise.data.tasks import task_factory, text_uid, user_prompt
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput, outcome_advantage_errors
from rollwise.rewards.scoring import build_reward_fn, score_batch
from rollwise.rewards.verifiers import final_integer
from rollwise.types import Prompt, Sample, Status


def arith_operand(a: int, op: str, reached: int) -> int | None:
    """The `b'` with `a op b' = reached` (a non-negative integer), or None when there is none."""
    if op == "+":
        b = reached - a
    elif op == "-":
        b = a - reached if reached >= 0 else -1
    elif op == "*":
        b = reached // a if a != 0 and reached % a == 0 else -1
    else:
        return None
    return b if b >= 0 else None


def relabel_arith(task: Any, sample: Sample) -> Prompt | None:
    """The arith goal a failed response reached: `a op b'` with answer N, the number it computed (see the module
    docstring); None when it did not end (truncated: it concluded nothing), gave no number, was right, no `b'`
    exists, or the prompt is held out."""
    info = sample.prompt.info
    if sample.status != Status.COMPLETED or not {"a", "b", "op"} <= set(info):
        return None
    a, op = int(info["a"]), str(info["op"])
    reached = final_integer(sample.response_text)
    if reached is None or str(reached) == str(sample.prompt.answer).strip():
        return None
    b = arith_operand(a, op, reached)
    if b is None:
        return None
    text = f"What is {a} {op} {b}?"
    new_info = {"a": a, "b": b, "op": op, "relabelled_from": sample.prompt.uid}
    if task.is_held_out(text, new_info):
        return None
    return user_prompt(text_uid("arith", text), text, str(reached), f"hrr:{sample.prompt.source}", new_info)


RELABELERS: dict[str, Callable[[Any, Sample], Prompt | None]] = {"arith": relabel_arith}


class HRROptions(MethodOptions, section="algo", name="hrr"):
    """`[algo.hrr]`."""

    weight: float = Field(1.0, gt=0.0, description="a relabelled response's advantage is weight x (its reward under "
                          "the relabelled goal - its group's mean reward)")
    max_per_group: int = Field(4, ge=1, description="at most this many failed responses of a group are relabelled "
                               "and replayed per step")


class HRR(Method):
    """The plain RL step plus failed responses replayed under the goal they reached."""

    options = HRROptions

    keeps_uniform_groups = True

    def __init__(self, setup) -> None:
        super().__init__(setup)
        cfg = setup.cfg
        self.task = task_factory(cfg.data.task)(cfg.data, cfg.train.seed)  # its held-out split
        self.relabel = RELABELERS[cfg.data.task]
        self.reward_fn = build_reward_fn(cfg.reward.model_copy(update={"isolate": False}), self.task.default_reward)
        self.goals: dict[int, str] = {}  # id(original sample) -> the answer it was relabelled with

    @classmethod
    def checks(cls, cfg) -> list[str]:
        errors = []
        if cfg.data.path is not None or getattr(cfg.data, "mix", None) or cfg.data.task not in RELABELERS:
            source = f"data.path = {cfg.data.path!r}" if cfg.data.path is not None else f"data.task = {cfg.data.task!r}"
            errors.append(f"algo.method = 'hrr' relabels failed responses with the goal they reached; {source} has no "
                          f"relabel hook (tasks with one: {', '.join(sorted(RELABELERS))}): set data.task = 'arith' "
                          "without data.path or [[data.mix]], or another algo.method")
        if cfg.train.old_logprobs != "recompute":
            errors.append("algo.method = 'hrr' trains responses under relabelled prompts the engine never saw: set "
                          "train.old_logprobs = 'recompute'")
        if cfg.algo.is_correction != "none":
            errors.append(f"algo.method = 'hrr': algo.is_correction = {cfg.algo.is_correction!r} weighs by the "
                          "engine's log-probs, taken under the original prompt; set algo.is_correction = 'none'")
        return errors + outcome_advantage_errors("hrr", cfg, "sets outcome advantages")

    def prepare(self, step: StepInput) -> Prepared:
        cfg = self.setup.cfg
        originals, relabelled, failed = [], [], 0
        for group in step.groups:
            usable = [s for s in group.usable() if s.reward is not None]
            if not usable:
                continue
            mean_reward = sum(s.reward for s in usable) / len(usable)
            uniform = len({s.reward for s in usable}) == 1
            if not (uniform and cfg.algo.filter_zero_variance):
                originals += usable
            failures = [s for s in usable if not s.correct]
            failed += len(failures)
            twins = 0
            for s in failures:
                twin = self.relabelled(s) if twins < self.opts.max_per_group else None
                if twin is not None:
                    twin.info["hrr_group_mean_reward"] = mean_reward
                    relabelled.append((s, twin))
                    twins += 1
        scored = {id(t) for t in score_batch([t for _, t in relabelled], self.reward_fn, cfg.reward.timeout_s)}
        unscored = len(relabelled) - len(scored)  # the reward raised on them: counted, not trained
        relabelled = [(s, t) for s, t in relabelled if id(t) in scored]
        for s, t in relabelled:
            t.train_reward = t.reward
            t.advantage = self.opts.weight * (t.reward - t.info["hrr_group_mean_reward"])
        self.goals = {id(s): t.prompt.answer for s, t in relabelled}
        twins = [t for _, t in relabelled]
        metrics = {
            "hrr/relabelled": float(len(twins)),
            "hrr/reward_failed": float(unscored),
            "hrr/relabel_frac": len(twins) / failed if failed else 0.0,
            "hrr/relabelled_reward_mean": sum(t.reward for t in twins) / len(twins) if twins else 0.0,
            "hrr/advantage_mean": sum(t.advantage for t in twins) / len(twins) if twins else 0.0,
        }
        return Prepared(originals + twins, metrics=metrics, record=self.record)

    def relabelled(self, sample: Sample) -> Sample | None:
        """A copy of `sample` under the goal it reached (prompt and prompt ids rewritten, reward not yet set), or
        None (no goal, or the relabelled prompt is too long for `data.max_prompt_tokens`)."""
        prompt = self.relabel(self.task, sample)
        if prompt is None:
            return None
        ids = self.setup.encoder.encode(prompt)
        if ids is None:
            return None
        twin = copy.copy(sample)
        twin.prompt, twin.prompt_ids = prompt, ids
        twin.info = {**sample.info, "hrr_goal": prompt.answer}
        twin.reward, twin.correct, twin.reward_parts = None, None, {}
        return twin

    def record(self, sample: Sample) -> dict:
        goal = self.goals.get(id(sample))
        return {} if goal is None else {"hrr_goal": goal}
