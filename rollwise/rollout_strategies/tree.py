"""Tree-search rollouts (rStar-Math, Guan et al. 2025, "rStar-Math: Small LLMs Can Master Math Reasoning with
Self-Evolved Deep Thinking"; MedS3, Jiang et al. 2025, "MedS3: Towards Medical Small Language Models with
Self-Evolved Slow Thinking"): Monte Carlo tree search over reasoning steps, each step valued by a process
reward, and the policy trained on the search's trajectories and step values.

`rollout.strategy = "tree"`, per prompt (all of a round's prompts searched in lockstep, one engine call per
phase):
1. a tree whose nodes are steps: a step is the text the policy writes up to and including a token that contains
   a newline, or `rollout.tree.step_tokens` tokens, whichever comes first (tokens sampled past a newline inside
   the step budget are dropped; what is kept was sampled in its exact context);
2. selection from the root by UCT: an unvisited child first (in order), else the child maximising
   Q(c) + `rollout.tree.c_puct` x sqrt(ln N(parent) / N(c)); it descends until a node that is not expanded yet
   or is terminal (ended by EOS / a stop string, or at `rollout.max_new_tokens`);
3. expansion: `rollout.tree.branches` child steps sampled from the policy engine, continuing the node's path;
4. simulation: the first new child is rolled out by the policy engine to the end of the response, and the whole
   response (path + roll-out) is scored by the run's reward (`reward.fn`; a terminal node is scored as it is);
5. backup: N += 1 and W += reward on the node and every ancestor; Q = W / N, the mean outcome reward of the
   completions below a node: a Monte-Carlo process reward, as rStar-Math's Q-values from rollouts.
`rollout.tree.simulations` simulations per prompt. Each simulation yields one complete root-to-leaf response; the
group's `rollout.samples_per_prompt` samples are the responses of the last simulations (the most searched).
Every policy token of a sample was sampled by the engine with the sample's own earlier tokens as context, so
its behaviour log-probs are the engine's (loss mask 1 everywhere; `mismatch/*` checks it).
A sample's reward stays its outcome reward (Control scores it again, as every sample); the step values go to
`Sample.info["step_values"]` = [(start, end, Q)] over response token positions (the roll-out tail below the
last tree node is one step valued by its own reward) and `info["root_value"]` = Q(root), so a method can train
on Q(step) - Q(parent) (the step's advantage).

Departures and what the abstracts leave open: the process reward is the Monte-Carlo Q of the search itself, not
a trained process preference model (rStar-Math) or value model (MedS3): training a PRM is out of scope here;
the policy is trained by the run's RL objective on the searched responses (outcome reward; the step values are
exposed, not used by GRPO itself), not by SFT on the best trajectories over rounds of self-evolution; no
code-augmented step verification (rStar-Math executes Python in each step); UCT without a prior term (no PRM
gives one); the leaf reward is the run's reward function before verifier noise and label propagation (those
apply to the trained samples in Control).
Metrics: `tree/q_mean` (mean root Q: the mean leaf reward), `tree/nodes` (step nodes per tree),
`tree/simulations` (per tree), `tree/depth_mean` (tree steps per sample), `tree/leaf_reward_failures`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import count
from typing import Callable

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.generate.groups import FINAL, GenerateStats, StopRule, is_complete
from rollwise.rewards import score_batch
from rollwise.rollout_strategies import StrategyContext, generate_on, require_continuation
from rollwise.types import GenerationRequest, Group, Sample, SamplingParams, Status


class TreeOptions(MethodOptions, section="rollout", name="tree"):
    """`[rollout.tree]`: rStar-Math / MedS3 tree-search rollouts."""

    simulations: int = Field(16, ge=1, description="MCTS simulations per prompt (each yields one complete response; "
                             "the group keeps the last rollout.samples_per_prompt of them)")
    branches: int = Field(2, ge=1, description="child steps the policy samples when a node is expanded")
    step_tokens: int = Field(16, ge=1, description="most tokens of one step (a step also ends after a token "
                             "containing a newline)")
    c_puct: float = Field(1.0, ge=0.0, description="UCT exploration constant c in Q(child) + c sqrt(ln N(parent) / "
                          "N(child))")

    def errors(self, cfg) -> list[str]:
        spp = cfg.rollout.samples_per_prompt
        if self.simulations < spp:
            return [f"rollout.tree.simulations = {self.simulations} gives fewer responses than "
                    f"rollout.samples_per_prompt = {spp}; set rollout.tree.simulations >= {spp}"]
        return []


def tree_strategy(cfg, context: StrategyContext) -> "TreeStrategy":
    r, o = cfg.rollout, TreeOptions.of(cfg)
    if context.reward_fn is None:
        raise ValueError("rollout.strategy = 'tree' scores its leaves with the run's reward; this run built none")
    tokenizer = context.tokenizer

    @lru_cache(maxsize=None)
    def is_newline(token: int) -> bool:
        return "\n" in tokenizer.decode([token])

    return TreeStrategy(context.reward_fn, is_newline, o.step_tokens, o.branches, o.simulations, o.c_puct,
                        r.samples_per_prompt, cfg.reward.timeout_s)


tree_strategy.options = TreeOptions


@dataclass
class Node:
    """One step: its tokens, their behaviour and untruncated log-probs, and the search statistics."""

    ids: list[int]
    logprobs: list[float]
    full: list[float]
    parent: "Node | None" = None
    terminal: bool = False
    status: Status = Status.PENDING
    text: str = ""
    children: list["Node"] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0

    @property
    def q(self) -> float:
        """Mean reward of the completions below this node (0 before any)."""
        return self.value_sum / self.visits if self.visits else 0.0

    def path(self) -> list["Node"]:
        """The nodes from the root's first child down to this one."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def prefix(self) -> tuple[list[int], list[float], list[float]]:
        """Tokens, behaviour and untruncated log-probs of the response up to and including this step."""
        ids, lp, full = [], [], []
        for n in self.path():
            ids, lp, full = ids + n.ids, lp + n.logprobs, full + n.full
        return ids, lp, full


def uct_child(node: Node, c_puct: float) -> Node:
    """The first unvisited child, else argmax Q(c) + c_puct sqrt(ln N(node) / N(c)) (first on ties)."""
    for child in node.children:
        if child.visits == 0:
            return child
    log_n = math.log(node.visits)
    return max(node.children, key=lambda ch: ch.q + c_puct * math.sqrt(log_n / ch.visits))


def backup(node: Node, reward: float) -> None:
    """N += 1, W += reward on `node` and each ancestor (the root included)."""
    while node is not None:
        node.visits += 1
        node.value_sum += reward
        node = node.parent


@dataclass
class Trajectory:
    """One simulation's complete response: the tree node it went through last and the roll-out below it."""

    node: Node
    ids: list[int]
    logprobs: list[float]
    full: list[float]
    status: Status
    text: str
    reward: float | None = None


class TreeStrategy:
    """Args:
        reward_fn: the run's reward (scores each simulation's complete response).
        is_newline: whether a token's text contains a newline (a step ends after it).
        step_tokens: most tokens of one step.
        branches: child steps sampled per expansion.
        simulations: simulations per prompt (>= samples_per_prompt).
        c_puct: the UCT exploration constant.
        samples_per_prompt: responses each group keeps (those of the last simulations).
        timeout_s: the reward's time limit per response.
    """

    def __init__(self, reward_fn, is_newline: Callable[[int], bool], step_tokens: int, branches: int,
                 simulations: int, c_puct: float, samples_per_prompt: int, timeout_s: float | None = None):
        if simulations < samples_per_prompt:
            raise ValueError(f"rollout.tree.simulations = {simulations} gives fewer responses than "
                             f"rollout.samples_per_prompt = {samples_per_prompt}; raise it")
        self.reward_fn, self.is_newline, self.timeout_s = reward_fn, is_newline, timeout_s
        self.step_tokens, self.branches, self.simulations = step_tokens, branches, simulations
        self.c_puct, self.samples_per_prompt = c_puct, samples_per_prompt
        self._counts = {"trees": 0, "nodes": 0, "root_q": 0.0, "samples": 0, "depth": 0, "failures": 0}

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        require_continuation(engine)
        todo = [g for g in groups if any(s.status not in FINAL for s in g.samples)]
        roots = [Node([], [], []) for _ in todo]
        done: list[list[Trajectory]] = [[] for _ in todo]
        scored = failed = 0
        first_error = ""
        for _ in range(self.simulations):
            leaves = [self._descend(root) for root in roots]
            self._expand(engine, [(g, n) for g, n in zip(todo, leaves) if not n.terminal], params, ids)
            picked = [n if n.terminal else n.children[0] for n in leaves]
            trajectories = self._roll_out(engine, todo, picked, params, ids)
            for traj, out in zip(trajectories, done):
                out.append(traj)
            errors = self._score(todo, trajectories)
            scored += len(trajectories) - len(errors)
            failed += len(errors)
            first_error = first_error or (errors[0] if errors else "")
        if todo and scored == 0:
            raise RuntimeError(f"rollout.strategy 'tree': the reward failed on every leaf of the search "
                               f"({failed} responses), e.g. {first_error}; fix reward.fn")
        version = getattr(engine, "version", 0)
        for group, root, trajectories in zip(todo, roots, done):
            self._write(group, root, trajectories[-self.samples_per_prompt:], version)
        self._counts["failures"] += failed
        return GenerateStats(requests=len(todo) * self.simulations, aborted=0,
                             groups_completed=sum(is_complete(g) for g in groups))

    def _descend(self, root: Node) -> Node:
        node = root
        while node.children and not node.terminal:
            node = uct_child(node, self.c_puct)
        return node

    def _expand(self, engine, todo: list[tuple[Group, Node]], params: SamplingParams, ids: count) -> None:
        """`branches` child steps of each node, in one engine call."""
        requests, owner = [], {}
        for group, node in todo:
            prefix, lp, full = node.prefix()
            budget = SamplingParams(**{**params.__dict__,
                                       "max_new_tokens": min(len(prefix) + self.step_tokens, params.max_new_tokens)})
            for _ in range(self.branches):
                req = GenerationRequest(next(ids), group.samples[0].prompt_ids, budget, response_ids=list(prefix),
                                        response_logprobs=list(lp), response_full_logprobs=list(full))
                owner[req.request_id] = (node, len(prefix))
                requests.append(req)

        def on_finish(result) -> None:
            node, start = owner[result.request_id]
            new = list(result.response_ids[start:])
            full = result.full_logprobs if len(result.full_logprobs) == len(result.response_ids) else result.logprobs
            cut = next((k + 1 for k, t in enumerate(new) if self.is_newline(t)), len(new))
            ended = cut == len(new) and (result.status == Status.COMPLETED
                                         or start + len(new) >= params.max_new_tokens or not new)
            status = result.status if ended and result.status in FINAL else Status.TRUNCATED
            node.children.append(Node(new[:cut], list(result.logprobs[start:start + cut]),
                                      list(full[start:start + cut]), parent=node, terminal=ended,
                                      status=status if ended else Status.PENDING, text=result.text))

        if requests:
            generate_on(engine, engine, requests, on_finish)
        self._counts["nodes"] += self.branches * len(todo)

    def _roll_out(self, engine, groups: list[Group], picked: list[Node], params: SamplingParams,
                  ids: count) -> list[Trajectory]:
        """Each picked node's response to its end (one engine call); a terminal node is its own response."""
        out: list[Trajectory | None] = [None] * len(picked)
        requests, owner = [], {}
        for k, (group, node) in enumerate(zip(groups, picked)):
            prefix, lp, full = node.prefix()
            if node.terminal:
                out[k] = Trajectory(node, prefix, lp, full, node.status, node.text)
                continue
            req = GenerationRequest(next(ids), group.samples[0].prompt_ids, params, response_ids=list(prefix),
                                    response_logprobs=list(lp), response_full_logprobs=list(full))
            owner[req.request_id] = (k, node, full)
            requests.append(req)

        def on_finish(result) -> None:
            k, node, known = owner[result.request_id]
            full = list(result.full_logprobs if len(result.full_logprobs) == len(result.response_ids)
                        else result.logprobs)
            full[:len(known)] = known
            out[k] = Trajectory(node, list(result.response_ids), list(result.logprobs), full,
                                result.status if result.status in FINAL else Status.TRUNCATED, result.text)

        if requests:
            generate_on(engine, engine, requests, on_finish)
        return out

    def _score(self, groups: list[Group], trajectories: list[Trajectory]) -> list[str]:
        """Score each response with the run's reward and back its reward up the tree; the failures' errors."""
        samples = [_sample(g, t, version=0) for g, t in zip(groups, trajectories)]
        ok = {id(s) for s in score_batch(samples, self.reward_fn, self.timeout_s)}
        errors = []
        for sample, traj in zip(samples, trajectories):
            if id(sample) in ok:
                traj.reward = float(sample.reward)
                backup(traj.node, traj.reward)
            else:
                errors.append(sample.reward_error or "unknown error")
        return errors

    def _write(self, group: Group, root: Node, trajectories: list[Trajectory], version: int) -> None:
        """The group's samples from the kept trajectories, with their step values."""
        self._counts["trees"] += 1
        self._counts["root_q"] += root.q
        for sample, traj in zip(group.samples, trajectories):
            fresh = _sample(group, traj, version)
            for name in ("response_ids", "behaviour_logprobs", "full_logprobs", "loss_mask", "status",
                         "version_spans", "response_text"):
                setattr(sample, name, getattr(fresh, name))
            steps, start = [], 0
            for node in traj.node.path():
                steps.append((start, start + len(node.ids), node.q))
                start += len(node.ids)
            if start < len(traj.ids):  # the roll-out below the last tree node: valued by its own reward
                steps.append((start, len(traj.ids), traj.reward if traj.reward is not None else traj.node.q))
            sample.info["step_values"] = steps
            sample.info["root_value"] = root.q
            self._counts["samples"] += 1
            self._counts["depth"] += len(traj.node.path())

    def metrics(self) -> dict[str, float]:
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        trees = max(1, c["trees"])
        return {
            "tree/q_mean": c["root_q"] / trees,
            "tree/nodes": c["nodes"] / trees,
            "tree/simulations": float(self.simulations) if c["trees"] else 0.0,
            "tree/depth_mean": c["depth"] / max(1, c["samples"]),
            "tree/leaf_reward_failures": float(c["failures"]),
        }


def _sample(group: Group, traj: Trajectory, version: int) -> Sample:
    """A sample of `group` holding `traj`'s response (every token the policy's: loss mask 1)."""
    base = group.samples[0]
    n = len(traj.ids)
    return Sample(prompt=group.prompt, prompt_ids=base.prompt_ids, response_ids=list(traj.ids),
                  behaviour_logprobs=list(traj.logprobs), loss_mask=[1] * n, status=traj.status,
                  group_id=group.group_id, version_spans=[(0, n, version)] if n else [],
                  full_logprobs=list(traj.full), response_text=traj.text)
