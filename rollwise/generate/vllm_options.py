"""vLLM's options: the `vllm.LLM` keyword arguments rollwise builds (`llm_kwargs`), and vLLM's speculative
decoding and quantization as `rollout.engine_options`, checked before a run starts.

    rollout.engine = "vllm"
    rollout.engine_options = { speculative_config = { method = "ngram", num_speculative_tokens = 3,
                                                      prompt_lookup_max = 4 }, quantization = "fp8" }

Both go to `vllm.LLM(**options)` unchanged (in-process engine) or to the launched server as
`--speculative-config '<json>'` / `--quantization fp8` (`rollwise.generate.vllm_server.server_command`).
vLLM's rejection sampler keeps the target's distribution for the draft methods; quantized rollouts differ from
the trainer's weights by design, which the run's mismatch metrics (`mismatch/*`) and importance corrections
(`algo.is_correction`) measure and correct, as for the torch engine's `weight_quant` (Jet-RL, QUADS).

The keys are checked against the installed vLLM's own `SpeculativeConfig` fields and quantization methods;
without vLLM installed, against the fallback lists below (vLLM 0.32's), so `--dry-run` still catches typos.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

EXTENSION = "rollwise.generate.vllm_ext.RollwiseWorkerExtension"
DEFAULT_KV_CACHE_BYTES = 256 * 2**20  # the KV cache of an engine on the CPU, unless the options give one
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# vLLM 0.32: what `--dry-run` checks against when vLLM is not importable here (a config for another machine)
FALLBACK_SPECULATIVE_KEYS = (
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
    "tensor_parallel_size", "quantization", "max_model_len", "revision", "code_revision", "prompt_lookup_max",
    "prompt_lookup_min", "disable_padded_drafter_batch", "parallel_drafting", "draft_sample_method",
    "rejection_sample_method", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "attention_backend", "kv_cache_dtype",
)
FALLBACK_QUANTIZATION = ("awq", "fp8", "fbgemm_fp8", "modelopt", "modelopt_fp4", "gptq", "gptq_marlin", "awq_marlin",
                         "compressed-tensors", "experts_int8", "torchao", "mxfp4", "bitsandbytes", "fp_quant")
KEYS = ("speculative_config", "quantization")


def speculative_keys() -> tuple[tuple[str, ...], str]:
    """(valid `speculative_config` keys, where they come from): the installed vLLM's `SpeculativeConfig` init
    fields, else `FALLBACK_SPECULATIVE_KEYS`."""
    try:
        from vllm.config import SpeculativeConfig
    except Exception:  # vLLM absent (or unimportable here): the fallback list
        return FALLBACK_SPECULATIVE_KEYS, "vLLM 0.32 (not installed here)"
    return tuple(f.name for f in dataclasses.fields(SpeculativeConfig) if f.init), "the installed vLLM"


def quantization_methods() -> tuple[tuple[str, ...], str]:
    """(valid `quantization` names, where they come from): the installed vLLM's, else `FALLBACK_QUANTIZATION`."""
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:
        return FALLBACK_QUANTIZATION, "vLLM 0.32 (not installed here)"
    return tuple(QUANTIZATION_METHODS), "the installed vLLM"


def vllm_option_errors(engine: str, options: dict, server: bool = False) -> list[str]:
    """One line per bad `speculative_config` / `quantization` in `rollout.engine_options` of engine `engine`; for
    a `vllm.LLM` of rollwise's (not a `server`, launched or given by URL) also one per key that is neither
    rollwise's own nor a `vllm.LLM` / `EngineArgs` argument (vLLM would refuse it only after loading the model;
    `unknown_llm_keys`)."""
    present = [k for k in KEYS if k in options]
    errors = [] if engine != "vllm" or server else unknown_llm_keys(options)
    if not present:
        return errors
    if engine != "vllm":
        hint = {"torch": "the torch engine takes draft_model / draft_tokens and weight_quant"}.get(engine, "")
        return [f"rollout.engine_options.{k} is vLLM's; rollout.engine = {engine!r} does not take it"
                + (f" ({hint})" if hint else "") for k in present]
    spec = options.get("speculative_config")
    if spec is not None:
        errors += _speculative_errors(spec)
    quant = options.get("quantization")
    if quant is not None:
        names, source = quantization_methods()
        if quant not in names:
            errors.append(f"rollout.engine_options.quantization = {quant!r} is not a quantization method of {source}; "
                          f"use one of {', '.join(names)}")
    return errors


# engine options rollwise's VLLMEngine takes itself (not passed to vllm.LLM as they are)
OWN_KEYS = ("in_process", "weight_transfer_backend")
# engine_options only the torch engine takes (`rollwise.generate.factory` keeps the torch engine for them)
TORCH_ONLY_OPTIONS = ("weight_quant", "draft_model", "draft_tokens", "gqa_attention")
# why a torch-engine option has no place on vLLM; the others (weight_quant, draft_model, draft_tokens) have their
# own lines in rollwise.validate
TORCH_HINTS = {"gqa_attention": "vLLM attends with its own kernels (its attention_config chooses them)"}


def unknown_llm_keys(options: dict) -> list[str]:
    """One line per `rollout.engine_options` key an in-process `vllm.LLM` would refuse: not in `OWN_KEYS`, not an
    argument of the installed vLLM's `LLM` or an init field of its `EngineArgs`. Nothing when vLLM is not
    importable here (the keys cannot be known)."""
    try:
        import inspect

        import vllm
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # vLLM absent or broken here: the engine's start says what it refuses
        return []
    known = set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    known |= {f.name for f in dataclasses.fields(EngineArgs) if f.init} | set(OWN_KEYS)
    errors = []
    for key in options:
        if key in TORCH_HINTS:
            errors.append(f"rollout.engine_options.{key} is the torch engine's: {TORCH_HINTS[key]}; remove it, or "
                          "set rollout.engine = 'torch'")
        elif key not in known and key not in TORCH_ONLY_OPTIONS:
            errors.append(f"rollout.engine_options.{key} is not an option of the installed vLLM (vllm.LLM or "
                          f"EngineArgs) nor of rollwise's vLLM engine ({', '.join(OWN_KEYS)}); check its spelling")
    return errors


def _speculative_errors(spec) -> list[str]:
    if not isinstance(spec, dict):
        return [f"rollout.engine_options.speculative_config = {spec!r}: use a table, e.g. "
                "{ method = 'ngram', num_speculative_tokens = 3, prompt_lookup_max = 4 }"]
    keys, source = speculative_keys()
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        return [f"rollout.engine_options.speculative_config has unknown keys {', '.join(unknown)} (valid in {source}: "
                f"{', '.join(keys)})"]
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return [f"rollout.engine_options.speculative_config.num_speculative_tokens = {k!r}: use an integer >= 1"]
    if spec.get("model") is None and spec.get("method") is None:
        return ["rollout.engine_options.speculative_config needs 'model' (a draft model) or 'method' "
                "(e.g. 'ngram', 'eagle', 'mtp')"]
    return []


def llm_kwargs(model_dir: Path, dtype: torch.dtype, max_batch_size: int, seed: int, max_model_len: int,
               options: dict, cuda: bool, in_process: bool) -> tuple[dict, str | None]:
    """(`vllm.LLM` keyword arguments, the weight-transfer backend configured or None); `options` apply last.

    KV cache: on the CPU `kv_cache_memory_bytes` defaults to 256 MiB (vLLM would otherwise take
    `gpu_memory_utilization` of the machine's RAM); on CUDA it is left to the options, since it overrides
    `gpu_memory_utilization`, the GPU share `rollwise.generate.factory.engine_options` gives a colocated engine.
    Weight transfer (CUDA): vLLM's IPC / NCCL transfer is configured for an engine core in a child process, or
    when `weight_transfer_backend` is given; an engine core in this process takes the tensors directly.
    """
    options = dict(options)
    kwargs = dict(model=str(model_dir), tokenizer=str(model_dir), dtype=DTYPE_NAMES[dtype], seed=seed,
                  max_num_seqs=max_batch_size, max_model_len=max_model_len, enforce_eager=False,
                  logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION)
    if not cuda:
        kwargs["kv_cache_memory_bytes"] = DEFAULT_KV_CACHE_BYTES
    backend = options.pop("weight_transfer_backend", None)
    transfer = None
    if cuda and "weight_transfer_config" not in options and (backend is not None or not in_process):
        from vllm.config import WeightTransferConfig

        transfer = backend or "ipc"
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=transfer)
    if options.get("max_lora_rank") is not None:
        options.setdefault("enable_lora", True)
    kwargs.update(options)
    return kwargs, transfer
