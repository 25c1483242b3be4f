"""MemReward: rewards for unlabelled rollouts propagated from labelled ones through a similarity graph over an
experience memory (`[reward.memreward] label_fraction` < 1, `seed`).

A prompt is labelled with probability `label_fraction` (fixed by the seed and its uid): its rollouts get the
wrapped reward (the verifier) and join the memory. The rollouts of an unlabelled prompt get the harmonic
label-propagation value (Zhu, Ghahramani and Lafferty 2003) on a graph whose nodes are the memory's labelled
rollouts and the batch's rollouts:

    W_ij = Jaccard(token bigrams of response i, token bigrams of response j), kept for each node's K nearest
    F_u  = (sum_l W_ul y_l + sum_{u'} W_uu' F_u' + eps * prior) / (sum_j W_uj + eps)     for every unlabelled u

solved exactly as one linear system; `prior` is the memory's mean reward and `eps` a weak edge to it (an
unlabelled rollout like nothing else gets the prior). `correct` of a propagated rollout is `F_u > 0.5`.

Paper: MemReward (see the seeds' abstracts): rollouts stored as experience memory, queries / thinking / answers
as nodes of a heterogeneous graph with similarity and structural edges, a GNN trained on labelled nodes
propagating rewards to unlabelled rollouts; 20% labels reach about 97% of the oracle. What departs, and why:
- Plain label propagation instead of a trained GNN (the issue allows either): no extra training, exact, and a
  floor a GNN must beat. One node per rollout, one similarity (token-bigram Jaccard of the response, no
  embedding model); the query and answer nodes and structural edges are not built.
- Labels are withheld per prompt (a query is labelled or not, as in the paper's label budget); the verifier is
  still called on every rollout so the error of the propagated reward can be measured: parts `oracle_reward`,
  `oracle_correct` and `memreward_abs_error` (|F - oracle| on propagated rollouts, 0 on labelled ones) next
  to `memreward_labelled` (1 on labelled rollouts). The oracle never reaches the update for unlabelled prompts.
- The memory keeps the newest `MEMORY_SIZE` labelled rollouts and is not checkpointed (a resumed run starts it
  empty). Only training rewards are propagated; held-out evaluation uses the verifier.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from pydantic import Field

from rollwise.config import RewardConfig
from rollwise.config_methods import MethodOptions
from rollwise.rewards.calling import as_result, call_reward, decide_correct
from rollwise.types import RewardResult, Sample

MEMORY_SIZE = 512  # labelled rollouts kept as experience memory
NEIGHBOURS = 8  # edges kept per node (its most similar nodes)
PRIOR_WEIGHT = 1e-3  # eps: the weak edge of every unlabelled node to the memory's mean reward

Bigrams = frozenset


def bigrams(ids: list[int]) -> Bigrams:
    return frozenset(zip(ids, ids[1:])) if len(ids) > 1 else frozenset((i,) for i in ids)


def jaccard(a: Bigrams, b: Bigrams) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def similarity_graph(nodes: list[Bigrams], neighbours: int = NEIGHBOURS) -> torch.Tensor:
    """[M, M] symmetric float64 weights: Jaccard similarities, each node keeping its `neighbours` largest
    (an edge stays when either end keeps it); zero diagonal."""
    m = len(nodes)
    w = torch.zeros((m, m), dtype=torch.float64)
    for i in range(m):
        for j in range(i + 1, m):
            w[i, j] = w[j, i] = jaccard(nodes[i], nodes[j])
    if m > neighbours + 1:
        keep = torch.zeros_like(w, dtype=torch.bool)
        top = w.topk(neighbours, dim=1).indices  # [M, K]
        keep.scatter_(1, top, True)
        w = torch.where(keep | keep.T, w, torch.zeros_like(w))
    return w


def propagate(w: torch.Tensor, labelled: torch.Tensor, values: torch.Tensor, prior: float,
              eps: float = PRIOR_WEIGHT) -> torch.Tensor:
    """Harmonic label propagation. w: [M, M] weights; labelled: [M] bool; values: [M] (read where labelled).
    Returns [M] float64: the labels where labelled, the solution of the module docstring's system elsewhere."""
    u = ~labelled
    out = values.to(torch.float64).clone()
    if not bool(u.any()):
        return out
    w_uu, w_ul = w[u][:, u], w[u][:, labelled]  # [U, U], [U, L]
    degree = w[u].sum(1) + eps  # [U]
    system = torch.diag(degree) - w_uu
    rhs = w_ul @ values.to(torch.float64)[labelled] + eps * prior  # [U]
    out[u] = torch.linalg.solve(system, rhs)
    return out


def is_labelled(seed: int, sample: Sample, fraction: float) -> bool:
    """Whether the sample's prompt has a label: a draw fixed by (seed, prompt uid) below `fraction`."""
    key = f"{seed}\x00{sample.prompt.uid}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0 ** 64 < fraction


class MemReward:
    """`inner` (the verifier) for labelled prompts, label propagation for the rest (see the module docstring)."""

    def __init__(self, inner: Any, fraction: float, seed: int = 0) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"reward.memreward.label_fraction = {fraction} must be in (0, 1]")
        self.inner, self.fraction, self.seed = inner, fraction, seed
        self.memory: deque[tuple[Bigrams, float]] = deque(maxlen=MEMORY_SIZE)
        self.__name__ = f"memreward({getattr(inner, '__name__', type(inner).__name__)})"

    def __call__(self, sample: Sample) -> RewardResult:
        outcome = self.score_many([sample], None)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list[RewardResult | BaseException]:
        many = getattr(self.inner, "score_many", None)
        raw = many(samples, timeout_s) if callable(many) else [self._one(s, timeout_s) for s in samples]
        oracle: list[RewardResult | BaseException] = []
        for outcome in raw:
            try:
                oracle.append(outcome if isinstance(outcome, BaseException) else as_result(outcome))
            except Exception as exc:
                oracle.append(exc)
        ok = [i for i, o in enumerate(oracle) if isinstance(o, RewardResult)]
        labels = {i: is_labelled(self.seed, samples[i], self.fraction) for i in ok}
        prior_pool = [v for _, v in self.memory] + [oracle[i].value for i in ok if labels[i]]
        prior = sum(prior_pool) / len(prior_pool) if prior_pool else 0.0
        memory = list(self.memory)
        nodes = [b for b, _ in memory] + [bigrams(samples[i].response_ids) for i in ok]
        labelled = torch.tensor([True] * len(memory) + [labels[i] for i in ok])
        values = torch.tensor([v for _, v in memory] + [oracle[i].value for i in ok], dtype=torch.float64)
        spread = propagate(similarity_graph(nodes), labelled, values, prior)[len(memory):].tolist()
        out = list(oracle)
        for i, value in zip(ok, spread):
            out[i] = self._result(oracle[i], labels[i], value)
            if labels[i]:
                self.memory.append((nodes[len(memory) + ok.index(i)], oracle[i].value))
        return out

    def _result(self, clean: RewardResult, labelled: bool, value: float) -> RewardResult:
        clean_correct = decide_correct(clean)
        parts = {**clean.parts, "oracle_reward": float(clean.value), "oracle_correct": float(clean_correct),
                 "memreward_labelled": float(labelled),
                 "memreward_abs_error": 0.0 if labelled else abs(value - float(clean.value))}
        if labelled:
            return replace(clean, parts=parts)
        correct = value > 0.5
        if "correct" in parts:
            parts["correct"] = float(correct)
        return replace(clean, value=value, parts=parts, correct=correct)

    def _one(self, sample: Sample, timeout_s: float | None) -> RewardResult | BaseException:
        try:
            return call_reward(self.inner, sample, timeout_s)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            return exc


class MemRewardOptions(MethodOptions, section="reward", name="memreward", always=True):
    """`[reward.memreward]`: MemReward, label propagation to rollouts of unlabelled prompts, whatever reward.fn is."""

    label_fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of training prompts whose rollouts get "
                                  "the verifier's reward; the rest get rewards propagated from labelled rollouts "
                                  "over a similarity graph; 1 = off")
    seed: int = Field(0, description="seed of which prompts are labelled (fixed by seed and uid)")


def with_label_propagation(fn: Any, cfg: RewardConfig) -> Any:
    """The Control stage's reward: `fn` with MemReward when `[reward.memreward] label_fraction` < 1, else `fn`."""
    o = MemRewardOptions.of(cfg)
    return fn if o.label_fraction >= 1.0 else MemReward(fn, o.label_fraction, o.seed)
