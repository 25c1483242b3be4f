"""`train.compile`: each decoder layer through torch.compile; the step's loss and gradients do not change."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.train.compile_layers import CompileError, compile_layers
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

VOCAB = 97


def _samples(seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(3, VOCAB) for _ in range(7)]
        for _ in range(3):
            resp = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [-3.0] * len(resp), [1] * len(resp),
                              Status.COMPLETED, g, advantage=rng.choice([-1.0, 1.0])))
    return out


@pytest.mark.slow
def test_a_compiled_trainer_takes_the_same_step():
    """fp32, prompt-shared rows (the default layout): the step's metrics and updated weights match eager."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tiny_llama(VOCAB, seed=5)
        trainer = Trainer(model, TrainConfig(compile=compiled, precision="fp32"), AlgoConfig(), pad_id=0)
        assert trainer.compiled_layers == (len(model.model.layers) if compiled else 0)
        start = time.perf_counter()
        metrics = trainer.step(_samples())
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()},
                        time.perf_counter() - start))
    (eager, eager_weights, _), (comp, comp_weights, _) = results
    assert comp["train/loss"] == pytest.approx(eager["train/loss"], abs=1e-5)
    assert comp["train/grad_norm"] == pytest.approx(eager["train/grad_norm"], rel=1e-4)
    for name, weight in eager_weights.items():
        assert_close(comp_weights[name], weight, atol=1e-5, rtol=1e-4, msg=name)


def test_compile_needs_a_list_of_decoder_layers():
    with pytest.raises(CompileError, match="train.compile = false"):
        compile_layers(torch.nn.Linear(2, 2))
