"""Behaviour vs untruncated log-probs with top-k / top-p, and `mismatch/*` on current-version tokens only.

The engine samples from temperature + top-k + top-p (renormalised); it returns that log-prob (the behaviour,
the importance-sampling proposal) and the log-prob under the same temperature without truncation, which is
what the trainer computes. `mismatch/*` compares the trainer with the latter, and only on tokens of the
trainer's own policy version; older tokens are reported as stale.
"""

import math
import pickle
import random

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.generate import GenerationProcess, TorchEngine
from rollwise.generate.groups import make_groups, make_requests, merge_result
from rollwise.generate.sampling import sample_with_full_logprobs
from rollwise.train.batching import collate, current_version_mask
from rollwise.train.logprobs import token_logprobs
from rollwise.train.trainer import Trainer
from rollwise.types import GenerationRequest, Prompt, Sample, SamplingParams, Status

TEMPERATURE = 0.7
TRUNCATED = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, top_k=5, top_p=0.8)
TEXTS = ["What is 7 + 3?", "Compute 12 - 5.", "How many letters are in the word 'banana'?"]


def _setup():
    tok = tiny_tokenizer()
    # a larger init than the default: peaked distributions, so top-p cuts inside the top 5
    model = tiny_llama(len(tok), seed=0, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return tok, model


def _prompts(tok):
    return [(Prompt(str(i), []), tok(t, add_special_tokens=False).input_ids) for i, t in enumerate(TEXTS)]


def _engine_samples(tok, model, samples_per_prompt=2, version=0) -> list[Sample]:
    """Samples of the engine (fp32, top-k 5, top-p 0.8, temperature 0.7), through `merge_result`."""
    engine = TorchEngine(model, tok, seed=1)
    engine.version = version
    prompts = _prompts(tok)
    results = engine.generate(make_requests(prompts, samples_per_prompt, TRUNCATED))
    samples = [s for g in make_groups(prompts, samples_per_prompt, results) for s in g.samples]
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    return samples


def _trainer_logp(model, samples, temperature=TEMPERATURE):
    mb = collate(samples, pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb, temperature=temperature)
    return mb, logp


def _full_logp_by_hand(model, ids: list[int], token: int) -> tuple[float, float]:
    """(full log-prob of `token` after `ids`, log of the mass top-k 5 then top-p 0.8 keep), in float64 by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double() / TEMPERATURE  # [V]
    p = torch.softmax(logits, dim=-1).tolist()
    top5 = sorted(range(len(p)), key=lambda t: -p[t])[:5]
    kept, before = [], 0.0
    for t in top5:  # nucleus over the renormalised top 5: keep while the mass before the token is < 0.8
        if before >= 0.8:
            break
        kept.append(t)
        before += p[t] / sum(p[u] for u in top5)
    assert token in kept, f"the engine sampled token {token}, outside the kept set {kept}"
    return math.log(p[token]), math.log(sum(p[t] for t in kept))


def test_full_logprobs_equal_the_trainer_and_behaviour_is_renormalised_upward():
    tok, model = _setup()
    samples = _engine_samples(tok, model)
    assert all(len(s.full_logprobs) == len(s.response_ids) == len(s.behaviour_logprobs) > 0 for s in samples)
    mb, logp = _trainer_logp(model, samples)
    valid = mb.valid
    # like with like: the untruncated engine log-probs are the trainer's, to fp32 rounding
    assert float((logp - mb.full_logp)[valid].abs().max()) <= 1e-4
    # truncation renormalises over fewer tokens: behaviour >= full everywhere, strictly on most tokens
    gap = (mb.behaviour_logp - mb.full_logp)[valid]
    assert float(gap.min()) >= -1e-6
    assert float((gap > 1e-3).float().mean()) > 0.5
    # one token by hand: the first response token of the first prompt
    s = samples[0]
    full, log_kept = _full_logp_by_hand(model, s.prompt_ids, s.response_ids[0])
    assert_close(s.full_logprobs[0], full, atol=1e-4, rtol=0)
    assert_close(s.behaviour_logprobs[0], full - log_kept, atol=1e-4, rtol=0)
    assert log_kept < math.log(0.9)  # the truncation was not negligible on this token


def test_sampling_scores_twice_and_equal_without_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    tok, lp, full = sample_with_full_logprobs(logits, 0.5, top_k=2, generator=gen)
    scaled = (logits / 0.5).double()
    kept = torch.logsumexp(scaled[0, :2], 0)  # top-2 of [4, 2, 1, 0, -2]
    t = int(tok)
    assert t in (0, 1)
    assert_close(float(full), float(scaled[0, t] - torch.logsumexp(scaled[0], 0)), atol=1e-6, rtol=0)
    assert_close(float(lp), float(scaled[0, t] - kept), atol=1e-6, rtol=0)
    _, lp, full = sample_with_full_logprobs(logits, 0.5, generator=gen)  # no truncation: one distribution
    assert torch.equal(lp, full)
    _, lp, full = sample_with_full_logprobs(logits, 0.0, top_k=2)  # greedy: the untempered distribution
    assert_close(float(full), float(torch.log_softmax(logits, -1)[0, 0]))
    assert torch.equal(lp, full)


def test_mismatch_is_numerical_only_with_top_k_and_top_p_in_fp32():
    tok, model = _setup()
    samples = _engine_samples(tok, model, version=4)
    mb, logp = _trainer_logp(model, samples)
    mask = mb.loss_mask
    old_style = float(((logp - mb.behaviour_logp).abs() * mask).sum() / mask.sum())  # what mismatch used to be
    gap = float(((mb.behaviour_logp - mb.full_logp) * mask).sum() / mask.sum())
    trainer = Trainer(model, TrainConfig(precision="fp32", lr=1e-3), AlgoConfig(), pad_id=tok.pad_token_id,
                      temperature=TEMPERATURE)
    metrics = trainer.step(samples, version=4)
    assert old_style > 0.05  # comparing with the truncated log-probs reports truncation as drift
    assert metrics["mismatch/logprob_abs_diff_mean"] < 1e-5
    assert metrics["mismatch/logprob_abs_diff_max"] < 1e-4
    assert abs(metrics["mismatch/k3"]) < 1e-8
    assert_close(metrics["mismatch/truncation_logprob_gap_mean"], gap, atol=1e-6, rtol=1e-5)
    assert metrics["mismatch/stale_token_frac"] == 0.0
    assert "mismatch/stale_logprob_abs_diff_mean" not in metrics


def _hand_samples(model, rng):
    """Three samples at trainer version 3: A has 2 tokens of version 2 then 3 of version 3, B is all version 3,
    C all version 2. Engine full log-probs = trainer's on current tokens, trainer's - 0.5 on older ones;
    behaviour = full + 0.1 (a constant truncation gap)."""
    prompt = [rng.randrange(4, 400) for _ in range(5)]
    spans = {"A": [(0, 2, 2), (2, 5, 3)], "B": [(0, 4, 3)], "C": [(0, 3, 2)]}
    samples = []
    for name, sp in spans.items():
        n = sp[-1][1]
        resp = [rng.randrange(4, 400) for _ in range(n)]
        samples.append(Sample(Prompt(name, []), prompt, resp, [0.0] * n, [1] * n, Status.COMPLETED, 0,
                              version_spans=sp, advantage=1.0 if name != "B" else -1.0))
    mb, logp = _trainer_logp(model, samples)
    for row, s in enumerate(mb.samples):
        old = [v != 3 for start, end, v in s.version_spans for _ in range(start, end)]
        s.full_logprobs = [lp - (0.5 if o else 0.0) for lp, o in zip(logp[row, : len(s.response_ids)].tolist(), old)]
        s.behaviour_logprobs = [f + 0.1 for f in s.full_logprobs]
    return samples


def test_current_version_mask_from_version_spans():
    samples = [Sample(Prompt("p", []), [1], [5] * n, [0.0] * n, [1] * n, Status.COMPLETED, 0, version_spans=sp)
               for n, sp in [(5, [(0, 2, 2), (2, 5, 3)]), (3, [(0, 3, 2)]), (2, [])]]
    want = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(current_version_mask(samples, 5, version=3), want)  # no spans: counted as current
    assert torch.equal(current_version_mask(samples, 5, version=None), collate(samples, 0).valid)
    assert torch.equal(collate(samples, 0, version=3).current, want)


def test_older_version_tokens_are_excluded_from_mismatch_and_counted_stale():
    rng = random.Random(0)
    _, model = _setup()
    samples = _hand_samples(model, rng)
    trainer = Trainer(model, TrainConfig(precision="fp32", lr=1e-3), AlgoConfig(), pad_id=0, temperature=TEMPERATURE)
    metrics = trainer.step(samples, version=3)
    # 12 trained tokens: 5 of version 2 (A's first 2, C's 3), 7 of version 3
    assert metrics["mismatch/logprob_abs_diff_mean"] < 1e-5
    assert metrics["mismatch/logprob_abs_diff_max"] < 1e-5
    assert_close(metrics["mismatch/stale_logprob_abs_diff_mean"], 0.5, atol=1e-5, rtol=0)
    assert_close(metrics["mismatch/stale_token_frac"], 5 / 12, atol=1e-7, rtol=0)
    assert_close(metrics["mismatch/truncation_logprob_gap_mean"], 0.1, atol=1e-5, rtol=0)
    # without a version every token counts as current: the staleness lands in the numerical gap
    _, model = _setup()
    samples = _hand_samples(model, random.Random(0))
    trainer = Trainer(model, TrainConfig(precision="fp32", lr=1e-3), AlgoConfig(), pad_id=0, temperature=TEMPERATURE)
    mixed = trainer.step(samples)
    assert_close(mixed["mismatch/logprob_abs_diff_mean"], 0.5 * 5 / 12, atol=1e-5, rtol=0)
    assert mixed["mismatch/stale_token_frac"] == 0.0


def test_continuation_carries_full_logprobs():
    tok, model = _setup()
    engine = TorchEngine(model, tok, seed=3)
    (prompt, ids), = _prompts(tok)[:1]
    first = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, top_k=5, top_p=0.8)
    (part,) = engine.generate([GenerationRequest(0, ids, first)])
    assert part.status == Status.TRUNCATED and len(part.full_logprobs) == 4
    # with the twin field: the engine keeps the earlier values
    (rest,) = engine.generate([GenerationRequest(1, ids, TRUNCATED, part.response_ids, part.logprobs,
                                                 part.full_logprobs)])
    assert rest.full_logprobs[:4] == part.full_logprobs and len(rest.full_logprobs) == len(rest.response_ids)
    # without it (a request built from behaviour log-probs only), merge_result keeps the sample's own
    sample = Sample(prompt, ids, [], [], [], Status.PENDING, 0)
    merge_result(sample, part)
    (rest,) = engine.generate([GenerationRequest(2, ids, TRUNCATED, part.response_ids, part.logprobs)])
    assert rest.full_logprobs[:4] == part.logprobs  # the engine could only fall back to behaviour
    merge_result(sample, rest)
    assert sample.full_logprobs[:4] == part.full_logprobs
    assert sample.full_logprobs[4:] == rest.full_logprobs[4:]
    mb, logp = _trainer_logp(model, [sample])
    assert float((logp - mb.full_logp)[mb.valid].abs().max()) <= 1e-4


def test_full_logprobs_survive_pickling_and_old_samples_fall_back():
    tok, model = _setup()
    samples = _engine_samples(tok, model, samples_per_prompt=1)
    again = pickle.loads(pickle.dumps(samples))  # checkpoints (replay, controller) and the process queue pickle
    assert [s.full_logprobs for s in again] == [s.full_logprobs for s in samples]
    for s in again:  # a sample pickled before the field existed reads as its behaviour log-probs
        del s.full_logprobs
    assert torch.equal(collate(again, 0).full_logp, collate(again, 0).behaviour_logp)


@pytest.mark.slow  # spawns a child (imports torch and transformers): ~15 s on a busy machine
def test_generation_process_returns_full_logprobs():
    tok, model = _setup()
    requests = make_requests(_prompts(tok), 2, TRUNCATED)
    want = TorchEngine(model, tok, seed=5, max_batch_size=8).generate(requests)
    with GenerationProcess(model, tok, threads=1, max_batch_size=8, seed=5) as proc:
        proc.submit(0, requests)
        got = proc.receive(timeout=300).results
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert len(g.full_logprobs) == len(g.response_ids)
        assert_close(g.full_logprobs, w.full_logprobs, atol=1e-5, rtol=0)
        assert all(b >= f - 1e-6 for b, f in zip(g.logprobs, g.full_logprobs))
