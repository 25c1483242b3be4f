"""Every entry of every algorithm registry honours its registry's signature and output contract.

Each entry is called with default options on small tensors, so a future entry that breaks the contract
(shape, dtype, metrics that are not scalar tensors, a missing docstring) fails here.
"""

import inspect

import pytest
import torch

from rollwise import algo
from rollwise.algo import registries
from rollwise.registry import Registry

N, T = 4, 5
MASK = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [1.0] * 4 + [0.0]])


def _gen():
    return torch.Generator().manual_seed(0)


def _check_metrics(metrics):
    assert isinstance(metrics, dict)
    for key, value in metrics.items():
        assert isinstance(key, str)
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key
        assert not value.requires_grad, key
        assert torch.isfinite(value), key


def _entries(registry):
    return [pytest.param(fn, id=name) for name, fn in registry.items()]


def test_every_registry_is_covered_and_documented():
    found = {name for name, obj in vars(registries).items() if isinstance(obj, Registry)}
    assert found == set(CHECKED), "add a contract test for the new registry"
    for name in found:
        registry = getattr(registries, name)
        assert registry.names(), name
        for entry, fn in registry.items():
            assert inspect.getdoc(fn), f"{name}:{entry} needs a docstring"


@pytest.mark.parametrize("fn", _entries(algo.ADVANTAGES))
def test_advantage_contract(fn):
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    adv = fn(rewards, torch.tensor([3, 3, 8, 5]))  # includes single-sample groups
    assert adv.shape == (N,) and adv.dtype == torch.float32 and torch.isfinite(adv).all()


@pytest.mark.parametrize("fn", _entries(algo.TOKEN_ADVANTAGES))
@pytest.mark.parametrize("reward_shape", [(N,), (N, T)])
def test_token_advantage_contract(fn, reward_shape):
    values = torch.rand(N, T, generator=_gen())
    adv, returns = fn(torch.rand(reward_shape, generator=_gen()), values, MASK)
    for x in (adv, returns):
        assert x.shape == (N, T) and x.dtype == torch.float32 and torch.isfinite(x).all()
        assert (x[MASK == 0] == 0).all()


@pytest.mark.parametrize("fn", _entries(algo.POLICY_LOSSES))
@pytest.mark.parametrize("adv_shape", [(N,), (N, T)])
def test_policy_loss_contract(fn, adv_shape):
    gen = _gen()
    old = -torch.rand(N, T, generator=gen)
    logp = (old + 0.3 * torch.randn(N, T, generator=gen)).requires_grad_(True)
    adv = torch.randn(adv_shape, generator=gen)
    loss, metrics = fn(logp, old, adv, MASK, clip_low=0.2, clip_high=0.2)  # the trainer passes these to all
    assert loss.shape == (N, T) and loss.dtype == torch.float32 and torch.isfinite(loss).all()
    _check_metrics(metrics)
    assert {"clip_frac", "ratio_mean"} <= set(metrics)
    (loss * MASK).sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    default_loss, default_metrics = fn(logp.detach(), old, adv, MASK)  # defaults work too
    assert default_loss.shape == (N, T)
    _check_metrics(default_metrics)


@pytest.mark.parametrize("fn", _entries(algo.AGGREGATIONS))
def test_aggregation_contract(fn):
    loss = torch.randn(N, T, generator=_gen(), requires_grad=True)
    out = fn(loss, MASK)
    assert out.dim() == 0 and out.dtype == torch.float32
    out.backward()
    # micro-batch contract: with batch-global normalisers, the parts sum to the whole
    norms = algo.batch_normalisers([MASK[:1], MASK[1:]])
    parts = fn(loss[:1], MASK[:1], **norms) + fn(loss[1:], MASK[1:], **norms)
    torch.testing.assert_close(parts, fn(loss, MASK))


@pytest.mark.parametrize("fn", _entries(algo.KL_ESTIMATORS))
def test_kl_contract(fn):
    gen = _gen()
    logp = -torch.rand(N, T, generator=gen)
    out = fn(logp, -torch.rand(N, T, generator=gen))
    assert out.shape == (N, T) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (fn(logp, logp) == 0).all()  # zero when the two policies agree


@pytest.mark.parametrize("fn", _entries(algo.IS_CORRECTIONS))
def test_is_correction_contract(fn):
    gen = _gen()
    old = -torch.rand(N, T, generator=gen)
    weights, metrics = fn(old, old + 0.5 * torch.randn(N, T, generator=gen), MASK)
    assert weights.shape == (N, T) and weights.dtype == torch.float32
    assert not weights.requires_grad and torch.isfinite(weights).all() and (weights >= 0).all()
    _check_metrics(metrics)
    assert {"weight_mean", "log_ratio_abs_mean"} <= set(metrics)
    same, _ = fn(old, old, MASK)
    assert (same == 1).all()  # no gap, no correction


@pytest.mark.parametrize("fn", _entries(algo.SHAPING))
def test_shaping_contract(fn):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = fn(rewards, torch.tensor([10, 20, 30, 40]), torch.tensor([0, 0, 1, 1]),
             torch.tensor([True, False, True, False]))
    assert out.shape == (N,) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("fn", _entries(algo.DISTILL))
def test_distill_contract(fn):
    V = 7
    if getattr(fn, "takes", "logp") == "logits":
        student = torch.randn(N, T, V, generator=_gen()).requires_grad_(True)
        teacher = torch.randn(N, T, V, generator=_gen())
    else:
        student = (-torch.rand(N, T, generator=_gen()) * 3).requires_grad_(True)
        teacher = -torch.rand(N, T, generator=_gen()) * 3
    out, metrics = fn(student, teacher, MASK)
    assert out.shape == (N, T) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.all(out[MASK == 0] == 0)
    _check_metrics(metrics)
    if out.requires_grad:  # a loss term: the gradient reaches the student only
        out.sum().backward()
        assert student.grad is not None and not teacher.requires_grad


CHECKED = {
    "ADVANTAGES": test_advantage_contract,
    "TOKEN_ADVANTAGES": test_token_advantage_contract,
    "POLICY_LOSSES": test_policy_loss_contract,
    "AGGREGATIONS": test_aggregation_contract,
    "KL_ESTIMATORS": test_kl_contract,
    "IS_CORRECTIONS": test_is_correction_contract,
    "SHAPING": test_shaping_contract,
    "DISTILL": test_distill_contract,
}
