"""Teachers (rollwise.distill.teacher) and the trainer's distillation terms (rollwise.distill.terms).

Teacher scores are checked against a plain full forward pass of the teacher on its own prompt followed by the
student's response ids; the trainer terms against hand-computed advantages and the F.kl_div / full-vocabulary
GKD of rollwise.algo.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise import algo
from rollwise.config_distill import TeacherConfig
from rollwise.data.prompts import PromptEncoder
from rollwise.distill.teacher import (Teacher, TeacherError, check_same_tokenizer, context_template,
                                      privileged_messages)
from rollwise.distill.terms import StepMarks, StepTerms, gkd_topk, with_tail
from rollwise.train.batching import collate
from rollwise.train.logprobs import response_hidden
from rollwise.types import Prompt, Sample, Status


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _prompt(uid: str, text: str, answer: str = "7", **info) -> Prompt:
    return Prompt(uid=uid, messages=[{"role": "user", "content": text}], answer=answer, source=f"rows.jsonl:{uid}",
                  info=info)


def _samples(tok, encoder, n_prompts: int = 2, per_prompt: int = 3, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = _prompt(str(p), f"What is {p} + 3?", answer=str(p + 3))
        ids = encoder.encode(prompt)
        for _ in range(per_prompt):
            n = int(torch.randint(2, 7, (1,), generator=gen))
            resp = torch.randint(5, len(tok) - 5, (n,), generator=gen).tolist()
            out.append(Sample(prompt=prompt, prompt_ids=ids, response_ids=resp, behaviour_logprobs=[0.0] * n,
                              loss_mask=[1] * n, status=Status.COMPLETED, group_id=p))
    return out


def _reference_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
    """log p(response_t | prompt, response_<t) by one plain forward pass (no packing, no shared attention)."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    logp = torch.log_softmax(logits, dim=-1)
    P = len(prompt_ids)
    return [float(logp[P - 1 + t, tok_id]) for t, tok_id in enumerate(response_ids)]


def test_hint_template_rewrites_only_the_last_user_turn():
    prompt = Prompt("a", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": "A1"}, {"role": "user", "content": "What is 2+5?"}], "7")
    messages = privileged_messages(prompt, context_template("hint"))
    assert messages[-1]["content"] == "What is 2+5? (Hint: the correct answer is 7.)"
    assert messages[:3] == prompt.messages[:3] and prompt.messages[-1]["content"] == "What is 2+5?"
    custom = privileged_messages(prompt, context_template("Known result: {answer}"))
    assert custom[-1]["content"] == "What is 2+5?\n\nKnown result: 7"
    replaced = privileged_messages(prompt, context_template("{answer} is the answer to: {prompt}"))
    assert replaced[-1]["content"] == "7 is the answer to: What is 2+5?"


def test_solution_context_needs_the_row_key_and_names_the_row():
    with_solution = _prompt("1", "Q", solution="2 + 5 = 7")
    assert privileged_messages(with_solution, context_template("solution"))[-1]["content"].endswith("2 + 5 = 7")
    with pytest.raises(TeacherError, match=r"rows.jsonl:2.*'solution'"):
        privileged_messages(_prompt("2", "Q"), context_template("solution"))


@pytest.mark.parametrize("bad", ["{anwser}", "no fields at all", "{answer"])
def test_bad_context_templates_fail_before_any_model_loads(bad):
    with pytest.raises(TeacherError, match="teacher.context"):
        context_template(bad)


def test_different_tokenizers_are_refused_with_the_difference(tok):
    other = tiny_tokenizer(vocab_size=300)
    with pytest.raises(TeacherError, match=r"teacher 'x': its tokenizer differs.*vocabularies of \d+ and \d+"):
        check_same_tokenizer(tok, other, "'x'")
    check_same_tokenizer(tok, tiny_tokenizer(), "'same'")  # an equal one passes


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("context", ["none", "hint"])
def test_teacher_scores_the_student_ids_exactly_behind_its_own_prompt(tok, share_prompt, context):
    teacher_model = tiny_llama(len(tok), seed=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    encoder = PromptEncoder(tok, "Solve it.", 256)
    samples = _samples(tok, encoder)
    responses = [list(s.response_ids) for s in samples]
    cfg = TeacherConfig(weights="base", context=context, temperature=0.7)
    teacher = Teacher(teacher_model, cfg, encoder, tok.pad_token_id, micro_batch_tokens=64, share_prompt=share_prompt)
    marks = StepMarks()
    teacher.score(samples, marks)
    plain = tiny_llama(len(tok), seed=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for s, resp in zip(samples, responses):
        assert s.response_ids == resp  # never re-tokenised
        teacher_ids = teacher.prompt_ids(s)
        hinted = tok.decode(teacher_ids)
        assert ("Hint: the correct answer is " + s.prompt.answer) in hinted if context == "hint" else teacher_ids == s.prompt_ids
        expected = _reference_logprobs(plain, teacher_ids, resp, temperature=0.7)
        assert marks.logprobs[id(s)] == pytest.approx(expected, abs=2e-5)


def test_topk_scores_are_the_teachers_largest_log_probs(tok):
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)
    marks = StepMarks()
    Teacher(model, TeacherConfig(weights="base"), encoder, tok.pad_token_id, 256, top_k=4).score(samples, marks)
    s = samples[0]
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(s.prompt_ids) - 1:-1]  # [T, V]
    values, top_ids = logp.topk(4, dim=-1)
    assert torch.tensor(marks.topk[id(s)][1]).tolist() == top_ids.tolist()
    assert torch.tensor(marks.topk[id(s)][0]) == pytest.approx(values, abs=2e-5)


def _micro_batch(tok, samples, teacher_logps):
    """The micro-batch of `samples` and a step's marks holding their teacher log-probs."""
    marks = StepMarks()
    for s, t in zip(samples, teacher_logps):
        marks.logprobs[id(s)] = t
    marks.hold(samples)
    return collate(samples, tok.pad_token_id), marks


def test_opd_advantage_in_the_trainer_terms_is_hand_computed(tok):
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)[:2]
    for s, a in zip(samples, (0.5, -1.0)):
        s.advantage = a
    lens = [len(s.response_ids) for s in samples]
    teacher = [[-1.0] * lens[0], [-2.0] * lens[1]]
    mb, marks = _micro_batch(tok, samples, teacher)
    old = torch.full(mb.targets.shape, -1.5)
    terms = StepTerms(teacher=True, coef=2.0, reward_weight=0.5, marks=marks)
    adv, metrics = terms.advantages(old, mb), terms.metrics()
    # A_t = 0.5 * A - 2 * (old - teacher): row 0: 0.25 - 2 * (-0.5) = 1.25; row 1: -0.5 - 2 * 0.5 = -1.5
    assert adv[0, :lens[0]].tolist() == pytest.approx([1.25] * lens[0])
    assert adv[1, :lens[1]].tolist() == pytest.approx([-1.5] * lens[1])
    kl = (-0.5 * lens[0] + 0.5 * lens[1]) / sum(lens)
    assert metrics["distill/teacher_kl"] == pytest.approx(kl)


def test_teacher_equal_to_the_student_leaves_only_the_reward_advantage(tok):
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=3)
    for s, a in zip(samples, (1.0, 0.0, -1.0)):
        s.advantage = a
    old = torch.randn(len(samples), max(len(s.response_ids) for s in samples))
    mb, marks = _micro_batch(tok, samples, [old[i, :len(s.response_ids)].tolist() for i, s in enumerate(samples)])
    terms = StepTerms(teacher=True, coef=3.0, reward_weight=1.0, marks=marks)
    adv, metrics = terms.advantages(old, mb), terms.metrics()
    expected = mb.advantages[:, None].expand_as(adv) * mb.loss_mask
    assert torch.allclose(adv, expected, atol=1e-6)
    assert metrics["distill/teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    pure = StepTerms(teacher=True, reward_weight=0.0, marks=marks).advantages(old, mb)
    assert torch.count_nonzero(pure) == 0  # pure OPD with teacher == student: nothing to learn


def test_unscored_samples_get_no_teacher_term(tok):
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)
    marks = StepMarks()
    marks.logprobs[id(samples[0])] = [-9.0] * len(samples[0].response_ids)  # samples[1] was never scored
    samples[0].advantage = samples[1].advantage = 0.5
    mb = collate(samples, tok.pad_token_id)
    adv = StepTerms(teacher=True, reward_weight=1.0, marks=marks).advantages(torch.zeros(mb.targets.shape), mb)
    n1 = len(samples[1].response_ids)
    assert adv[1, :n1].tolist() == pytest.approx([0.5] * n1)
    assert adv[0, 0] == pytest.approx(0.5 - 9.0)


def test_gkd_with_every_token_in_the_topk_equals_full_vocabulary_gkd(tok):
    model = tiny_llama(len(tok), seed=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    teacher = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)
    marks = StepMarks()
    Teacher(teacher, TeacherConfig(weights="base"), encoder, tok.pad_token_id, 256, top_k=len(tok)).score(samples,
                                                                                                         marks)
    mb = collate(samples, tok.pad_token_id)
    topk = marks.tensors(mb)[2]
    hidden = response_hidden(model, mb).detach().requires_grad_(True)
    head = model.get_output_embeddings().weight
    for beta in (0.0, 0.5, 1.0):
        per_token = gkd_topk(hidden, head, mb, topk, beta, temperature=1.0)
        with torch.no_grad():
            t_logits = (response_hidden(teacher, mb) @ teacher.get_output_embeddings().weight.T)
        full, _ = algo.distill("gkd", hidden @ head.T, t_logits, torch.ones(t_logits.shape[0]), beta=beta)
        assert per_token[mb.valid].tolist() == pytest.approx(full.detach().tolist(), abs=1e-5)
    per_token.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0  # the student gets the gradient


def test_the_tail_bucket_holds_the_rest_of_the_mass():
    top = torch.log(torch.tensor([[0.5, 0.2]]))
    assert with_tail(top).exp().tolist()[0] == pytest.approx([0.5, 0.2, 0.3])
    assert math.isfinite(float(with_tail(torch.log(torch.tensor([[0.6, 0.4]]))).sum()))


def test_a_teacher_that_gives_nan_stops_with_the_row_named(tok):
    model = tiny_llama(len(tok), seed=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.get_output_embeddings().weight[7].fill_(float("nan"))  # a broken teacher checkpoint
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)
    marks = StepMarks()
    with pytest.raises(TeacherError, match=r"rows.jsonl:0: the teacher gave NaN/Inf log-probs to \d+ response"):
        Teacher(model, TeacherConfig(weights="base"), encoder, tok.pad_token_id, 256).score(samples, marks)
    assert not marks.logprobs  # nothing half-scored is left behind


def test_an_unmarked_batch_has_the_default_weights_and_no_teacher_tensors(tok):
    """Samples a step did not mark (replayed ones): weights (1, 1, 0), no teacher log-probs, no top-k."""
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder, n_prompts=1, per_prompt=2)
    weights, teacher, topk = StepMarks().tensors(collate(samples, tok.pad_token_id))
    assert weights.tolist() == [[1.0, 1.0, 0.0]] * 2 and teacher is None and topk is None


def test_a_soft_capped_teacher_scores_as_its_own_forward(tok):
    """Gemma 2 caps its final logits (`final_logit_softcapping`): the teacher's scores are its forward's, cap
    included, at a temperature other than 1 (cap / T on the scaled logits), with shared and plain rows."""
    from helpers_model import tiny_arch
    from rollwise.models.arch import exact_attention

    model = tiny_arch("gemma2", len(tok), seed=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      final_logit_softcapping=2.0)
    exact_attention(model)
    encoder = PromptEncoder(tok, None, 256)
    samples = _samples(tok, encoder)
    for share_prompt in (True, False):
        marks = StepMarks()
        teacher = Teacher(model, TeacherConfig(weights="base", temperature=0.7), encoder, tok.pad_token_id, 256,
                          share_prompt=share_prompt)
        teacher.score(samples, marks)
        for s in samples:
            expected = _reference_logprobs(model, s.prompt_ids, s.response_ids, temperature=0.7)
            assert marks.logprobs[id(s)] == pytest.approx(expected, abs=2e-5)
