"""The chunked LM-head log-probability function: values and gradients equal plain autograd."""

import pytest
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


# -- the chunked kernel against the plain full-logits autograd reference --------------------------------------
# Reference: logits = h @ W.T over all rows at once (soft-capped where asked), log_softmax, gather; entropy from
# the same log-probs; gradients by autograd. fp32: torch.testing.assert_close defaults.

from rollwise.train.logprobs import head_kernel, token_logprobs  # noqa: E402


def _full_reference(h, weight, targets, softcap=None):
    logits = (h @ weight.T).float()  # bf16 inputs: bf16 logits, then fp32 as autocast runs log_softmax
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _case(n, H=16, V=50, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=gen) * scale
    weight = torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (n,), generator=gen)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return h, weight, targets, g_logp, g_ent


def _run(fn, h, weight, targets, g_logp, g_ent, temperature, frozen=False):
    """Values and gradients of sum(g_logp * logp + g_ent * entropy) through `fn`, logits at `temperature`."""
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
    logp, ent = fn(h / temperature, weight, targets)
    loss = (logp * g_logp).sum() if g_logp is not None else 0.0
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad, weight.grad


@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_kernel_equals_full_logits_autograd_fp32(with_entropy, entropy_grad, temperature, softcap):
    n = 37  # chunks of 8: four full ones and a last of 5
    h, weight, targets, g_logp, g_ent = _case(n, scale=2.0)
    cap = softcap / temperature if softcap else None
    ours = _run(lambda a, w, t: _HeadLogprob.apply(a, w, t, with_entropy, cap, 8), h, weight, targets, g_logp,
                g_ent if entropy_grad else None, temperature)
    ref = _run(lambda a, w, t: _full_reference(a, w, t, cap), h, weight, targets, g_logp,
               g_ent if entropy_grad else None, temperature)
    assert_close(ours[0], ref[0])
    if with_entropy:
        assert_close(ours[1], ref[1])
    else:
        assert ours[1] is None
    assert_close(ours[2], ref[2])
    assert_close(ours[3], ref[3])


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_entropy_gradient_alone(softcap):
    h, weight, targets, _, g_ent = _case(19, scale=2.0, seed=3)
    ours = _run(lambda a, w, t: _HeadLogprob.apply(a, w, t, True, softcap, 4), h, weight, targets, None, g_ent, 1.0)
    ref = _run(lambda a, w, t: _full_reference(a, w, t, softcap), h, weight, targets, None, g_ent, 1.0)
    for a, b in zip(ours, ref):
        assert_close(a, b)


@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_frozen_head_gradient_of_the_hidden_states(with_entropy, entropy_grad, softcap):
    """A head without gradient (LoRA): d logp / dh made in forward when it can be, the recompute otherwise."""
    h, weight, targets, g_logp, g_ent = _case(21, scale=2.0, seed=4)
    g_ent = g_ent if entropy_grad else None
    ours = _run(lambda a, w, t: _HeadLogprob.apply(a, w, t, with_entropy, softcap, 8), h, weight, targets, g_logp,
                g_ent, 0.7, frozen=True)
    ref = _run(lambda a, w, t: _full_reference(a, w, t, softcap), h, weight, targets, g_logp, g_ent, 0.7,
               frozen=True)
    assert ours[3] is None and ref[3] is None
    assert_close(ours[0], ref[0])
    assert_close(ours[2], ref[2])


def test_no_rows():
    h, weight, targets, _, _ = _case(0)
    h, weight = h.requires_grad_(), weight.requires_grad_()
    logp, ent = _HeadLogprob.apply(h, weight, targets, True, None, 8)
    assert logp.shape == (0,) and ent.shape == (0,) and logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 16)
    assert_close(weight.grad, torch.zeros_like(weight))


def test_no_gradient_pass_and_one_chunk_equal_many():
    h, weight, targets, _, _ = _case(30, seed=5)
    with torch.no_grad():
        one = _HeadLogprob.apply(h, weight, targets, True, None, 512)
        many = _HeadLogprob.apply(h, weight, targets, True, None, 7)
    assert_close(one, many)


@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_bf16_autocast_matches_the_bf16_reference(with_entropy, entropy_grad, softcap):
    """bf16 inputs: both sides make bf16 logits and the fp32 math after them. Documented tolerances: log-probs and
    entropies 1e-2 (a matmul of another shape may round a bf16 logit one ulp apart; here they are equal);
    gradients, which are bf16, 2e-2 relative with an absolute floor of 2e-2 x their largest entry (each side
    rounds to bf16 in another order: here the softmax output or the scaled h and the weight gradient once per
    chunk, there g * p once; measured: within 7e-3 of the largest entry, and 1.0-1.9x the bf16 reference's own
    distance from fp64)."""
    n, V = 37, 300
    h, weight, targets, g_logp, g_ent = _case(n, H=32, V=V, seed=6, scale=1.0)
    h, weight = h.bfloat16(), (weight * 0.5).bfloat16()
    g_ent = g_ent if entropy_grad else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _run(lambda a, w, t: _HeadLogprob.apply(a, w, t, with_entropy, softcap, 8), h, weight, targets,
                    g_logp, g_ent, 1.0)
        ref = _run(lambda a, w, t: _full_reference(a, w, t, softcap), h, weight, targets, g_logp, g_ent, 1.0)
    assert ours[0].dtype == torch.float32
    assert_close(ours[0], ref[0], atol=1e-2, rtol=1e-2)
    if with_entropy:
        assert ours[1].dtype == torch.float32
        assert_close(ours[1], ref[1], atol=1e-2, rtol=1e-2)
    for a, b in zip(ours[2:], ref[2:]):
        assert a.dtype == torch.bfloat16
        assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.float().abs().max()))


def test_token_logprobs_equal_the_full_head_on_a_model():
    """token_logprobs (temperature, soft cap of Gemma 2, chunks smaller than the response tokens) against the plain
    full-logits reference on the same hidden states; parameter gradients too."""
    from helpers_model import tiny_arch

    from rollwise.train.batching import collate
    from rollwise.train.logprobs import response_hidden
    from rollwise.types import Prompt, Sample, Status

    vocab = 61
    samples = [Sample(Prompt(str(g), []), [3 + g, 5, 7 + g], list(range(10 + g, 10 + g + k)), [0.0] * k, [1] * k,
                      Status.COMPLETED, g) for g, k in enumerate([4, 7, 1, 6])]
    for name in ("llama", "gemma2"):
        model = tiny_arch(name, vocab, seed=1)
        mb = collate(samples, pad_id=0)
        temperature = 0.8
        grads = []
        for chunk in (5, None):
            model.zero_grad()
            if chunk:
                logp, ent = token_logprobs(model, mb, temperature=temperature, chunk_tokens=chunk)
                logp, ent = logp[mb.valid], ent[mb.valid]
            else:
                cap = getattr(model.config, "final_logit_softcapping", None)
                h = response_hidden(model, mb) / temperature
                logp, ent = _full_reference(h, model.get_output_embeddings().weight, mb.targets[mb.valid],
                                            cap / temperature if cap else None)
            g = torch.linspace(-1, 1, logp.numel())
            ((logp * g).sum() + 0.3 * ent.sum()).backward()
            grads.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
        (lp, en, gr), (rlp, ren, rgr) = grads
        assert lp.numel() == sum(len(s.response_ids) for s in samples)
        assert_close(lp, rlp, msg=name)
        assert_close(en, ren, msg=name)
        for k in rgr:
            assert_close(gr[k], rgr[k], msg=f"{name} {k}")


def test_kernel_choice_without_a_gpu():
    """The own kernel on the CPU always; liger-kernel only on CUDA, installed, and without entropy (it has none)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert head_kernel(cpu, False) == "own" and head_kernel(cpu, False, liger_available=True) == "own"
    assert head_kernel(cuda, True, liger_available=True) == "own"
    assert head_kernel(cuda, False, liger_available=True) == "liger"
    assert head_kernel(cuda, False, liger_available=False) == "own"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:  # this machine: not installed, so the CUDA choice falls back too
        assert head_kernel(cuda, False) == "own"
