"""The chunked LM-head log-probability function: values and gradients equal plain autograd."""

import torch
from torch.testing import assert_close

from rollwise.train.logprobs import _HeadLogprob


def _reference(h, weight, targets):
    logp_all = torch.log_softmax(h @ weight.T, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_values_and_gradients_match_autograd():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 3, 10, 3, 7, 1])
    g_logp, g_ent = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    h1, w1 = h.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = _reference(h1, w1, targets)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    h2, w2 = h.clone().requires_grad_(), weight.clone().requires_grad_()
    logp2, ent2 = _HeadLogprob.apply(h2, w2, targets, True)
    assert_close(logp2, logp.float())  # computed in fp32 whatever the input dtype
    assert_close(ent2, ent.float())
    ((logp2 * g_logp).sum() + (ent2 * g_ent).sum()).backward()
    assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-6)
    assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)


def test_gradient_of_logp_alone_and_no_entropy():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(4, 5, generator=gen, requires_grad=True)
    weight = torch.randn(7, 5, generator=gen, requires_grad=True)
    targets = torch.tensor([6, 0, 2, 2])
    logp, ent = _HeadLogprob.apply(h, weight, targets, False)
    assert ent is None
    logp.sum().backward()
    # d/dh sum_i log p(t_i | h_i) = W[t_i] - sum_j p_ij W[j]
    probs = torch.softmax(h.detach() @ weight.detach().T, dim=-1)
    expected = weight.detach()[targets] - probs @ weight.detach()
    assert_close(h.grad, expected)


def test_bf16_autocast_gives_fp32_outputs_close_to_fp32():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(5, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    targets = torch.tensor([1, 2, 3, 4, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = _HeadLogprob.apply(h.bfloat16(), weight.bfloat16(), targets, True)
    ref_logp, ref_ent = _reference(h, weight, targets)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert_close(logp, ref_logp, atol=0.15, rtol=0.05)  # bf16 inputs: ~3 significant digits
    assert_close(ent, ref_ent, atol=0.15, rtol=0.05)
