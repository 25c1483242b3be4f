"""TRB warm-up sampler (rollwise/distill/trb.py): the mixture, the trust-region lambda, the anneal, and
`trb_generate` re-scored against full forward passes of tiny random Llamas."""

from __future__ import annotations

import math

import pytest
import torch

from helpers_model import tiny_llama
from rollwise.distill.trb import budget_at, kl_to_student, mixture_logp, trb_generate, trust_region_lambda

VOCAB = 16
PROMPTS = [([1, 2, 3, 4, 5], [9, 8]), ([6], [7, 7, 7, 10, 11, 12]), ([13, 14, 15], [1, 2, 3])]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only contend on a shared CPU (10x slower here), so use one."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def student():
    return tiny_llama(VOCAB, seed=0)


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(VOCAB, seed=1)


def test_mixture_logp_by_hand():
    s = torch.tensor([[0.5, 0.5]]).log()
    t = torch.tensor([[0.8, 0.2]]).log()
    # lam 1/2: sqrt(.5*.8) = sqrt(.4), sqrt(.5*.2) = sqrt(.1); sqrt(.4) / sqrt(.1) = 2, so [2/3, 1/3]
    torch.testing.assert_close(mixture_logp(s, t, torch.tensor([0.5])).exp(), torch.tensor([[2 / 3, 1 / 3]]))
    torch.testing.assert_close(mixture_logp(s, t, torch.tensor([0.0])), s)
    torch.testing.assert_close(mixture_logp(s, t, torch.tensor([1.0])), t)


def test_lambda_by_hand_on_two_tokens():
    # s uniform, t = [.8, .2]: pi_lam ∝ t^lam, so pi_lam(0) = 4^lam / (4^lam + 1) and KL(pi||s) = log 2 - H(pi).
    # lam = 1/4: pi(0) = sqrt2 / (sqrt2 + 1) = 2 - sqrt2; take that KL as the budget, bisection must find 1/4.
    p = 2 - math.sqrt(2)
    budget = math.log(2) + p * math.log(p) + (1 - p) * math.log(1 - p)  # ≈ 0.01462
    s = torch.tensor([[0.5, 0.5]]).log()
    t = torch.tensor([[0.8, 0.2]]).log()
    torch.testing.assert_close(trust_region_lambda(s, t, budget), torch.tensor([0.25]))
    # KL(t||s) = log 2 + .8 log .8 + .2 log .2 ≈ 0.19274: any budget above it gives exactly 1
    assert trust_region_lambda(s, t, 0.2).tolist() == [1.0]
    assert trust_region_lambda(s, t, 0.0).tolist() == [0.0]
    # three tokens, teacher == student: KL is 0 at every lam, so lam is 1 even for a tiny budget
    s3 = torch.tensor([[0.5, 0.25, 0.25]]).log()
    assert trust_region_lambda(s3, s3.clone(), 1e-9).tolist() == [1.0]


def test_lambda_is_the_edge_of_the_trust_region():
    gen = torch.Generator().manual_seed(0)
    s = torch.log_softmax(3 * torch.randn(8, 50, generator=gen), -1)  # [8, 50]
    t = torch.log_softmax(3 * torch.randn(8, 50, generator=gen), -1)
    budget = 0.05
    lam = trust_region_lambda(s, t, budget)  # [8]
    assert ((lam > 0) & (lam < 1)).all()
    pi = mixture_logp(s, t, lam).exp()
    kl = (pi * (pi.log() - s)).sum(-1)  # written out again, not through kl_to_student
    assert (kl <= budget).all()
    # bisection invariant: one bracket (2**-20) further in lam leaves the trust region
    assert (kl_to_student(s, t, lam + 2 ** -20) > budget).all()
    assert (kl - budget).abs().max() < 1e-4


def test_budget_anneals_linearly_to_zero():
    assert budget_at(0, 10, 0.2) == 0.2
    assert budget_at(5, 10, 0.2) == pytest.approx(0.1)
    assert budget_at(10, 10, 0.2) == 0.0
    assert budget_at(12, 10, 0.2) == 0.0
    assert budget_at(0, 0, 0.2) == 0.0
    with pytest.raises(ValueError, match="step must be >= 0"):
        budget_at(-1, 10, 0.2)


def rescore(student, teacher, prompt, result, temperature):
    """Full forward passes (no cache, no padding) over prompt + response: (log s(token) [T], log pi_lam(token)
    with the returned lam [T], student log-probs [T, V], teacher log-probs [T, V], T)."""
    ids = result["response_ids"]
    n = len(ids)
    with torch.no_grad():
        s_logits = student(torch.tensor([prompt[0] + ids])).logits[0, len(prompt[0]) - 1:-1]  # [T, V]
        t_logits = teacher(torch.tensor([prompt[1] + ids])).logits[0, len(prompt[1]) - 1:-1]  # [T, V]
    s = torch.log_softmax(s_logits / temperature, -1)
    t = torch.log_softmax(t_logits / temperature, -1)
    tok = torch.tensor(ids)[:, None]
    mix = mixture_logp(s, t, torch.tensor(result["lam"]))
    return s.gather(1, tok)[:, 0], mix.gather(1, tok)[:, 0], s, t, n


def check_against_full_forward(student, teacher, prompts, results, temperature, budget):
    for prompt, res in zip(prompts, results):
        s_tok, mix_tok, s, t, n = rescore(student, teacher, prompt, res, temperature)
        assert len(res["behaviour_logprobs"]) == len(res["student_logprobs"]) == len(res["lam"]) == n
        torch.testing.assert_close(torch.tensor(res["behaviour_logprobs"]), mix_tok, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(res["student_logprobs"]), s_tok, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(res["lam"]), trust_region_lambda(s, t, budget), atol=1e-4, rtol=0)


def test_batched_and_single_calls_match_full_forward(student, teacher):
    gen = torch.Generator().manual_seed(1)
    results = trb_generate(student, teacher, PROMPTS, 6, 1.0, 0.01, set(), gen)
    assert [len(r["response_ids"]) for r in results] == [6, 6, 6] and all(r["truncated"] for r in results)
    lams = [x for r in results for x in r["lam"]]
    assert any(0 < x < 1 for x in lams), "budget should bind somewhere, or the check proves little"
    check_against_full_forward(student, teacher, PROMPTS, results, 1.0, 0.01)
    for prompt in PROMPTS:  # one prompt at a time (no padding) must be just as exact
        single = trb_generate(student, teacher, [prompt], 4, 0.7, 0.02, set(), gen)
        check_against_full_forward(student, teacher, [prompt], single, 0.7, 0.02)


def test_zero_budget_is_plain_student_sampling(student, teacher):
    results = trb_generate(student, teacher, PROMPTS, 5, 1.0, 0.0, set(), torch.Generator().manual_seed(2))
    for res in results:
        assert res["lam"] == [0.0] * 5
        torch.testing.assert_close(torch.tensor(res["behaviour_logprobs"]), torch.tensor(res["student_logprobs"]))
    check_against_full_forward(student, teacher, PROMPTS, results, 1.0, 0.0)


def test_teacher_equal_to_student_gives_lambda_one(student):
    twin = tiny_llama(VOCAB, seed=0)
    same = [(p[0], p[0]) for p in PROMPTS]
    results = trb_generate(student, twin, same, 5, 1.0, 0.05, set(), torch.Generator().manual_seed(3))
    for res in results:
        assert res["lam"] == [1.0] * 5
        torch.testing.assert_close(torch.tensor(res["behaviour_logprobs"]), torch.tensor(res["student_logprobs"]))


def test_stops_after_eos_or_at_max_new_tokens(student, teacher):
    prompts = PROMPTS * 4
    eos = set(range(8))  # half the vocabulary, so some rows stop early and some run out
    results = trb_generate(student, teacher, prompts, 3, 1.0, 0.01, eos, torch.Generator().manual_seed(4))
    for res in results:
        ids = res["response_ids"]
        assert not any(tok in eos for tok in ids[:-1])
        assert res["truncated"] == (ids[-1] not in eos)
        assert len(ids) == 3 or not res["truncated"]
    assert {r["truncated"] for r in results} == {True, False}
    assert any(len(r["response_ids"]) < 3 for r in results)
    check_against_full_forward(student, teacher, prompts, results, 1.0, 0.01)


def test_tokens_are_drawn_from_the_mixture(student, teacher):
    # 8,000 draws of the first token of one prompt: counts within 5 sigma of pi_lam, and NOT of the student
    n, prompt = 8_000, PROMPTS[0]
    results = trb_generate(student, teacher, [prompt] * n, 1, 1.0, 0.01, set(), torch.Generator().manual_seed(5))
    counts = torch.bincount(torch.tensor([r["response_ids"][0] for r in results]), minlength=VOCAB).double()
    _, _, s, t, _ = rescore(student, teacher, prompt, results[0], 1.0)
    lam = torch.tensor(results[0]["lam"])
    assert 0 < lam.item() < 1
    pi = mixture_logp(s, t, lam)[0].exp().double()  # [V]

    def sigmas(p):
        return ((counts - n * p).abs() / (n * p * (1 - p)).sqrt()).max().item()

    assert sigmas(pi) < 5
    assert sigmas(s[0].exp().double()) > 5


def test_wider_teacher_vocabulary_is_padded(student):
    wide = tiny_llama(VOCAB + 4, seed=1)
    results = trb_generate(student, wide, PROMPTS, 4, 1.0, 0.5, set(), torch.Generator().manual_seed(6))
    assert all(0 <= tok < VOCAB for r in results for tok in r["response_ids"])
    assert all(x < 1 for r in results for x in r["lam"])  # the teacher's extra tokens make KL at lam 1 infinite


def test_bad_arguments_say_what_to_fix(student, teacher):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="prompt 1 has an empty"):
        trb_generate(student, teacher, [([1], [2]), ([], [3])], 2, 1.0, 0.1, set(), gen)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        trb_generate(student, teacher, PROMPTS, 2, 0.0, 0.1, set(), gen)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        trb_generate(student, teacher, PROMPTS, 0, 1.0, 0.1, set(), gen)
    with pytest.raises(ValueError, match="student's vocabulary"):
        trb_generate(tiny_llama(VOCAB + 4), teacher, PROMPTS, 2, 1.0, 0.1, set(), gen)
