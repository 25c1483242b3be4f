"""The trainer's distillation terms at the step level (rollwise.distill.terms through `Trainer.step`):

- the OPD gap uses the student's own untruncated log-probs (`full_logprobs`), not the top-p-truncated behaviour
  ones, with `train.old_logprobs = "behaviour"`;
- `distill/*` metrics are taken once over the whole step's batch, not averaged over micro-batches;
- the GKD term goes through the LM head in row chunks: same value and gradient as one block, and no
  `[n, V]` tensor is ever allocated.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.distill.terms import StepMarks, StepTerms, gkd_topk
from rollwise.train.batching import collate
from rollwise.train.logprobs import CHUNK_TOKENS, token_logprobs
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

TOK = tiny_tokenizer()


def _trainer(old_logprobs: str = "behaviour", micro_batch_tokens: int = 1024) -> Trainer:
    model = tiny_llama(len(TOK), seed=5, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    cfg = TrainConfig(old_logprobs=old_logprobs, micro_batch_tokens=micro_batch_tokens, share_prompt=False,
                      precision="fp32", lr=1e-4)
    return Trainer(model, cfg, AlgoConfig(kl_coef=0.0), TOK.pad_token_id)


MARKS = StepMarks()  # the teacher's scores of the samples `_sample` builds, as a teacher step records them


def _sample(i: int, response: list[int], behaviour: list[float], full: list[float], teacher: list[float],
            advantage: float = 0.0) -> Sample:
    """A sample; `teacher` (empty: not scored) goes into `MARKS`, by sample, as `Teacher.score` records it."""
    prompt = Prompt(str(i), [{"role": "user", "content": "q"}])
    n = len(response)
    sample = Sample(prompt=prompt, prompt_ids=[10 + i, 11, 12], response_ids=response, behaviour_logprobs=behaviour,
                    full_logprobs=full, loss_mask=[1] * n, status=Status.COMPLETED, group_id=i, advantage=advantage)
    if teacher:
        MARKS.hold([sample])
        MARKS.logprobs[id(sample)] = teacher
    return sample


def _terms(**kwargs) -> StepTerms:
    return StepTerms(marks=MARKS, **kwargs)


# ------------------------------------------------------------------ the OPD gap: the student's own log-probs


def test_the_opd_gap_uses_the_untruncated_logprobs_with_behaviour_old_logprobs():
    # top-p sampling: behaviour = log of the renormalised, truncated distribution >= full (the student's own)
    a = _sample(0, [20, 21, 22], behaviour=[-0.1, -0.2, -0.3], full=[-0.5, -1.0, -0.9], teacher=[-1.5, -0.5, -1.9])
    b = _sample(1, [23, 24], behaviour=[-0.05, -0.4], full=[-0.25, -1.4], teacher=[-0.25, -2.4])
    trainer = _trainer("behaviour")
    metrics = trainer.step([a, b], terms=_terms(teacher=True, coef=1.0, reward_weight=1.0))
    # gaps full - teacher: a: 1.0, -0.5, 1.0; b: 0.0, 1.0 -> mean 2.5 / 5 = 0.5 (with behaviour: 5.5 / 5 = 1.1)
    assert metrics["distill/teacher_kl"] == pytest.approx(0.5, abs=1e-6)
    assert metrics["distill/gap_mean"] == pytest.approx(0.5, abs=1e-6)
    # positions: a has length 3, b length 2; 4 buckets: a's tokens in q1, q2, q3; b's in q1, q3
    assert metrics["distill/gap_pos_q1"] == pytest.approx((1.0 + 0.0) / 2, abs=1e-6)
    assert metrics["distill/gap_pos_q2"] == pytest.approx(-0.5, abs=1e-6)
    assert metrics["distill/gap_pos_q3"] == pytest.approx((1.0 + 1.0) / 2, abs=1e-6)


def test_the_opd_advantage_in_the_trainer_uses_the_untruncated_logprobs(monkeypatch):
    a = _sample(0, [20, 21], behaviour=[-0.1, -0.2], full=[-0.5, -1.0], teacher=[-1.5, -0.5], advantage=0.25)
    trainer = _trainer("behaviour")
    seen = []
    real = trainer.objective.loss

    def spy(logp, old_logp, behaviour_logp, advantages, *args, **kwargs):
        seen.append(advantages.detach().clone())
        return real(logp, old_logp, behaviour_logp, advantages, *args, **kwargs)

    monkeypatch.setattr(trainer.objective, "loss", spy)
    trainer.step([a], terms=_terms(teacher=True, coef=2.0, reward_weight=1.0))
    # A_t = 0.25 - 2 * (full - teacher) = 0.25 - 2 * (1.0, -0.5) = (-1.75, 1.25); with behaviour: (-2.55, -0.35)
    assert seen[0].tolist() == [pytest.approx([-1.75, 1.25])]


# ------------------------------------------------------------ distill/* over the whole step, not per micro-batch


def test_entropy_at_top_gap_takes_the_top_share_of_both_micro_batches_by_hand():
    # mb 1: gaps 1..10, entropies 0.1..1.0; mb 2: gaps 0.1..1.0, entropies 5, 6, ... 14. Batch of 20 tokens: the
    # top 10% is 2 tokens, gaps 10 and 9, both in mb 1: entropies 1.0 and 0.9 -> 0.95. (Per micro-batch, top 1
    # each: 1.0 and 14 -> a mean of 7.5.)
    a = _sample(0, list(range(20, 30)), [0.0] * 10, [0.0] * 10, [-g for g in range(1, 11)])
    b = _sample(1, list(range(30, 40)), [0.0] * 10, [0.0] * 10, [-g / 10 for g in range(1, 11)])
    terms = _terms(teacher=True)
    terms.start()
    for sample, entropy in ((a, [e / 10 for e in range(1, 11)]), (b, [float(e) for e in range(5, 15)])):
        mb = collate([sample], TOK.pad_token_id)
        terms.advantages(mb.full_logp, mb, torch.tensor([entropy]))
    metrics = terms.metrics()
    assert metrics["distill/entropy_at_top_gap"] == pytest.approx(0.95)
    assert metrics["distill/entropy_mean"] == pytest.approx((5.5 + 95) / 20)  # (0.1 + ... + 1.0 + 5 + ... + 14) / 20
    assert metrics["distill/gap_mean"] == pytest.approx((55 + 5.5) / 20)
    terms.start()
    assert terms.metrics() == {}  # a new update starts empty


def test_entropy_at_top_gap_in_the_trainer_is_the_whole_batchs_top_share():
    # 10 samples x 10 tokens; sample 0 holds the 10 largest gaps (the batch's top 10%). With two micro-batches
    # of 5 samples, a per-micro-batch top 10% takes 5 tokens of sample 0 and 5 small-gap tokens of the other half.
    gen = torch.Generator().manual_seed(0)
    gaps, samples = {}, []
    for i in range(10):
        gaps[i] = [5.0 + 0.1 * t for t in range(10)] if i == 0 else (torch.rand(10, generator=gen) * 0.5).tolist()
        own = [-1.0] * 10
        samples.append(_sample(i, torch.randint(20, 400, (10,), generator=gen).tolist(), behaviour=own, full=own,
                               teacher=[o - g for o, g in zip(own, gaps[i])]))
    trainer = _trainer("behaviour", micro_batch_tokens=5 * (3 + 10))
    with torch.no_grad():  # a peaked head: entropies that differ from token to token
        trainer.model.get_output_embeddings().weight.mul_(6.0)
    plan = trainer._micro_batches(samples)
    assert len(plan) == 2 and all(len(mb.samples) == 5 for mb in plan)
    with torch.no_grad():  # the policy's entropies before the update, in one block, outside the trainer
        _, entropy = token_logprobs(trainer.model, collate(samples, TOK.pad_token_id))  # [10, 10], in sample order
    expected = float(entropy[0].mean())  # the 10 tokens of sample 0
    per_mb = []  # what a mean of per-micro-batch top-10% values gives
    for mb in plan:
        rows = [s.group_id for s in mb.samples]
        g = torch.tensor([gaps[r] for r in rows]).flatten()
        per_mb.append(float(entropy[rows].flatten()[g.topk(5).indices].mean()))
    metrics = trainer.step(samples, terms=_terms(teacher=True))
    assert metrics["distill/entropy_at_top_gap"] == pytest.approx(expected, abs=1e-4)
    assert metrics["distill/entropy_mean"] == pytest.approx(float(entropy.mean()), abs=1e-4)
    assert abs(sum(per_mb) / 2 - expected) > 0.05  # the two ways differ here by more than the tolerance


def test_step_metrics_skip_unscored_samples_instead_of_diluting_them():
    scored = _sample(0, [20, 21], behaviour=[-1.0, -1.0], full=[-1.0, -1.0], teacher=[-3.0, -2.0])
    replayed = _sample(1, [22, 23, 24], behaviour=[-1.0] * 3, full=[-1.0] * 3, teacher=[])  # not scored this step
    trainer = _trainer("behaviour")  # one micro-batch holds both
    metrics = trainer.step([scored, replayed], terms=_terms(teacher=True))
    assert metrics["distill/teacher_kl"] == pytest.approx(1.5, abs=1e-6)  # (2 + 1) / 2, not (2 + 1 + 0 * 3) / 5
    only_unscored = _trainer("behaviour")
    assert not any(k.startswith("distill/") for k in only_unscored.step([replayed], terms=_terms(teacher=True)))


# ------------------------------------------------------------------------------- GKD in row chunks


def _gkd_batch(n_samples: int = 8, length: int = 32, vocab: int = 4096, k: int = 4):
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(n_samples):
        n = length - i  # ragged: padding inside the micro-batch
        logits = torch.randn(n, vocab, generator=gen) * 2
        lp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
        s = _sample(i, torch.randint(0, vocab, (n,), generator=gen).tolist(), [-1.0] * n, [-1.0] * n, [-1.0] * n)
        MARKS.topk[id(s)] = (lp.tolist(), ids.tolist())
        samples.append(s)
    mb = collate(samples, pad_id=0)
    n_valid = int(mb.valid.sum())
    hidden = torch.randn(n_valid, 16, generator=gen)
    head = torch.randn(vocab, 16, generator=gen) * 0.3
    return mb, hidden, head, MARKS.tensors(mb)[2]


def _value_and_grads(mb, hidden, head, topk, beta: float, **chunking):
    h = hidden.clone().requires_grad_(True)
    w = head.clone().requires_grad_(True)
    per_token = gkd_topk(h, w, mb, topk, beta, 0.7, **chunking)
    (per_token * torch.linspace(0.5, 1.5, per_token.numel()).view_as(per_token)).sum().backward()
    return per_token.detach(), h.grad, w.grad


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_chunked_gkd_equals_one_block_in_value_and_gradient(beta):
    mb, hidden, head, topk = _gkd_batch()
    n = hidden.shape[0]
    whole = _value_and_grads(mb, hidden, head, topk, beta, chunk_tokens=n)
    chunked = _value_and_grads(mb, hidden, head, topk, beta, chunk_tokens=7)  # uneven: the last chunk is short
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert whole[1].abs().sum() > 0 and whole[2].abs().sum() > 0


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op returns while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_gkd_peak_is_one_chunk_of_logits_not_the_whole_micro_batch():
    mb, hidden, head, topk = _gkd_batch(n_samples=16, length=136, vocab=2048)
    n, V = hidden.shape[0], head.shape[0]  # 2056 positions x 2048 tokens
    with LargestTensor() as probe:  # the trainer's default chunk: CHUNK_TOKENS = 512 positions
        _value_and_grads(mb, hidden, head, topk, 0.5)
    whole_bytes, chunk_bytes = n * V * 4, CHUNK_TOKENS * V * 4  # fp32 logits: 16.8 MB in one block, 4.2 MB a chunk
    assert probe.largest <= chunk_bytes  # the largest tensor of the forward and backward passes is one chunk's
    assert probe.largest < whole_bytes / 3
    # at SmolLM2's vocabulary (49152) and the trainer's chunk (512 positions): 100.7 MB per [chunk, V] block,
    # against 805 MB for a 4096-token micro-batch in one block
    assert math.isclose(CHUNK_TOKENS * 49152 * 4 / 1e6, 100.663296) and math.isclose(4096 * 49152 * 4 / 1e6, 805.306368)


def test_a_scored_empty_response_first_in_a_micro_batch_leaves_the_others_top_k_intact():
    empty = _sample(0, [], [], [], [])
    scored = _sample(1, [20, 21], [-1.0] * 2, [-1.0] * 2, [-1.0] * 2)
    marks = StepMarks()
    marks.topk[id(empty)] = ([], [])  # what the teacher records for a response of no tokens
    marks.topk[id(scored)] = ([[-0.5, -1.5]] * 2, [[3, 4]] * 2)
    mb = collate([empty, scored], TOK.pad_token_id)
    lp, ids = marks.tensors(mb)[2]  # [2, 2, 2] each
    assert lp[1].tolist() == [[-0.5, -1.5]] * 2 and ids[1].tolist() == [[3, 4]] * 2
    assert lp[0].tolist() == [[0.0, 0.0]] * 2  # padding
