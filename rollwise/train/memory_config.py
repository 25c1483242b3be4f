"""The memory estimate of a whole run from its config, without loading weights: `rollwise train --dry-run` prints
it, and a run that cannot fit its device stops before any work in one line naming what to change.

The model's shapes come from its config.json alone (the embedded model's cache, a local directory, or a hub
snapshot already cached; built on the meta device, so any architecture transformers knows counts its own
parameters); the formulas are `rollwise.train.memory`'s. The device's memory is CUDA's `total_memory` or the
CPU's MemTotal (a cgroup's memory.max when lower); `ROLLWISE_DEVICE_MEMORY_GIB` overrides it (a GPU shared with
other work, or tests).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from rollwise.config import EMBEDDED_MODEL, Config
from rollwise.train.memory import (BF16_BYTES, FP32_BYTES, Estimate, ModelShape, StepSetup, decide_checkpointing,
                                   gib, kv_cache_bytes, shape_of, training_estimate)

MEMORY_ENV = "ROLLWISE_DEVICE_MEMORY_GIB"
# SmolLM2-135M-Instruct's config.json: the embedded model before its cache is built (a dry run builds nothing)
EMBEDDED_CONFIG = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                       tie_word_embeddings=True, max_position_embeddings=8192)
FUSED_DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # rollwise.generate.fused_decode (CPU engines)


# -- the model and the device ------------------------------------------------------------------------------
def config_dict(name: str) -> dict | None:
    """The model's config.json as a dict, read without network or building anything; None when not at hand."""
    if name == EMBEDDED_MODEL:
        from rollwise.models.resolve import cache_dir

        path = cache_dir() / EMBEDDED_MODEL / "config.json"
        return json.loads(path.read_text()) if path.is_file() else dict(EMBEDDED_CONFIG)
    path = Path(name).expanduser() / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from rollwise.models.hub import MODEL, cached_snapshot, parse_hub_id

    hub_id = parse_hub_id(name)
    folder = cached_snapshot(hub_id.repo_id, hub_id.revision, MODEL) if hub_id is not None else None
    if folder is not None and (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    return None


def model_shape(config: dict) -> ModelShape:
    """`ModelShape` of the model a config.json describes, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    body = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **body)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return shape_of(model)


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, label) of `device`'s memory; `ROLLWISE_DEVICE_MEMORY_GIB` overrides it."""
    override = os.environ.get(MEMORY_ENV)
    if override:
        return int(float(override) * 2**30), f"{MEMORY_ENV}={override}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index or 0)
        return int(props.total_memory), props.name
    return cpu_memory_bytes(), "MemTotal"


def cpu_memory_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """MemTotal, or the cgroup's memory limit when that is lower (a container)."""
    total = math.inf
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total) if total != math.inf else 0


# -- the run's parts -----------------------------------------------------------------------------------------
def step_setup(cfg: Config, device: torch.device, checkpointing: bool) -> StepSetup:
    from rollwise.hardware import bf16_is_native
    from rollwise.train.trainable import parse_layers

    precision = cfg.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and bf16_is_native(device.type))
    lora = (cfg.lora.rank, list(cfg.lora.target_modules)) if cfg.lora.rank > 0 else None
    world = cfg.train.world_size if cfg.train.backend == "fsdp2" else 1
    return StepSetup(tokens=cfg.train.micro_batch_tokens, bf16=bf16, checkpointing=checkpointing,
                     trained_layers=parse_layers(cfg.train.trainable), lora=lora,
                     reference=cfg.algo.kl_coef > 0, world_size=world, chunk_tokens=_chunk_tokens())


def _chunk_tokens() -> int:
    try:
        from rollwise.train.logprobs import CHUNK_TOKENS
    except ImportError:  # pragma: no cover - the LM head module is being replaced
        return StepSetup.chunk_tokens
    return CHUNK_TOKENS


def engine_parts(cfg: Config, shape: ModelShape, device: torch.device) -> tuple[dict[str, int], int, bool, dict]:
    """({'engine weights': bytes, 'kv cache': bytes}, generation transient, concurrent, notes by part) of the
    rollout engine on the trainer's device; nothing for an engine elsewhere (a note says so)."""
    rollout = cfg.rollout
    if rollout.source != "local" or cfg.cluster.ray or rollout.engine in ("sglang", "openai") or (
            rollout.engine == "vllm" and rollout.server not in (None, "launch")):
        return {}, 0, False, {"engine": "engine elsewhere: not counted"}
    if rollout.engine == "vllm":
        if device.type != "cuda":
            return {}, 0, False, {"engine": "vLLM on the CPU: not counted"}
        share = float(rollout.engine_options.get("gpu_memory_utilization", 0.35 if rollout.server is None else 0.9))
        total, _ = device_memory(device)
        return {"engine weights": int(share * total)}, 0, False, {
            "engine weights": f"vLLM: gpu_memory_utilization {share} of the device"}
    async_engine = cfg.control.mode == "async"
    engine_device = torch.device(cfg.control.generation_device) if async_engine else device
    if engine_device.type != device.type:
        return {}, 0, False, {"engine": f"engine on {engine_device.type}: not counted"}
    from rollwise.generate.factory import engine_dtype

    b = BF16_BYTES if engine_dtype(cfg.model.dtype, engine_device) == torch.bfloat16 else FP32_BYTES
    fused = device.type == "cpu" and shape.model_type in FUSED_DECODER_TYPES
    weights = b * (shape.params + (shape.linear_params if fused else 0))
    requests = rollout.prompts_per_step * rollout.samples_per_prompt
    if cfg.control.partial_rollouts:
        requests = math.ceil(cfg.control.over_provision * rollout.prompts_per_step) * rollout.samples_per_prompt
    slots = min(rollout.max_batch_size, requests)
    episode = cfg.env.max_episode_tokens if cfg.env.name is not None or cfg.agent.program is not None else 0
    response = max(rollout.max_new_tokens, cfg.eval.max_new_tokens or 0, episode)
    cache = kv_cache_bytes(shape, slots, cfg.data.max_prompt_tokens + response + 1, b)
    prefill = kv_cache_bytes(shape, rollout.prompts_per_step, cfg.data.max_prompt_tokens + 1, b)
    dtype = "bf16" if b == BF16_BYTES else "fp32"
    notes = {"engine weights": f"torch engine, {dtype}" + (" (+ fused decoder's packed copy)" if fused else ""),
             "kv cache": f"generation: {slots} slots x {cfg.data.max_prompt_tokens + response + 1} tokens, {dtype}"}
    return {"engine weights": weights, "kv cache": cache}, cache + prefill, async_engine, notes


def estimate_config(cfg: Config, shape: ModelShape, device: torch.device, checkpointing: bool) -> Estimate:
    """The whole run's `Estimate` with checkpointing on or off."""
    est = training_estimate(shape, step_setup(cfg, device, checkpointing))
    parts, est.generation, est.concurrent, notes = engine_parts(cfg, shape, device)
    est.parts.update(parts)
    est.notes.update(notes)
    return est


def resolve_checkpointing(cfg: Config, shape: ModelShape, device: torch.device, available: int
                          ) -> tuple[Estimate, str]:
    """(the estimate of the setting a run would use, why): "auto" decided from the estimate without it."""
    without = estimate_config(cfg, shape, device, False)
    on, why = decide_checkpointing(cfg.train.gradient_checkpointing, shape.params, without.total, available)
    return (estimate_config(cfg, shape, device, True) if on else without), why


# -- what to print, and what to refuse ----------------------------------------------------------------------
ROWS = [("weights", "policy, fp32"), ("optimizer", "AdamW, 2 fp32 states per trained parameter"),
        ("reference", "frozen KL reference"), ("engine weights", ""), ("gradients", "fp32, per trained parameter"),
        ("activations", ""), ("lm-head chunk", ""), ("autocast copies", "bf16 weight copies for the forward")]


def table(est: Estimate, shape: ModelShape, cfg: Config, device_bytes: int, device_label: str, why: str
          ) -> list[str]:
    """The dry run's table (lines without a comment sign)."""
    kept = f"{shape.layers} layers x {cfg.train.micro_batch_tokens} tokens"
    notes = {"activations": f"{kept}, checkpointing {'on' if est.checkpointing else 'off'} ({why})",
             "lm-head chunk": f"[{_chunk_tokens()}, {shape.vocab}] fp32 buffers", **est.notes}
    lines = [f"memory estimate ({shape.params / 1e6:.1f}M parameters; GiB):"]
    lines += [_row(name, est.parts[name], notes.get(name) or text) for name, text in ROWS if est.parts.get(name)]
    lines.append(_row("step peak", est.step_peak, "gradients, activations and buffers at their peak (not a sum)"))
    if est.parts.get("kv cache"):
        lines.append(_row("kv cache", est.parts["kv cache"], notes["kv cache"]))
    if "engine" in notes:
        lines.append(f"  {notes['engine']}")
    transient = "+" if est.concurrent else "max"
    lines.append(_row("total", est.total, f"held {gib(est.held_bytes)} + {transient}(step peak, generation "
                      f"{gib(est.generation)}) of {gib(device_bytes)} on {device_label} "
                      f"({100 * est.total / max(1, device_bytes):.0f}%)"))
    return lines


def _row(name: str, value: int, text: str) -> str:
    return f"  {name:<16}{gib(value):>8}  {text}"


def fixes(cfg: Config, shape: ModelShape, device: torch.device, device_bytes: int) -> list[str]:
    """Changes that would make the run fit, each with its estimate."""
    out = []
    if cfg.train.gradient_checkpointing is not True:
        fit = estimate_config(cfg, shape, device, True)
        if fit.total <= device_bytes:
            out.append(f"set train.gradient_checkpointing = true ({gib(fit.total)} GiB)")
    on = cfg.train.gradient_checkpointing is not False
    tokens = cfg.train.micro_batch_tokens // 2
    while tokens >= 256:
        smaller = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_tokens": tokens})})
        fit = estimate_config(smaller, shape, device, on)
        if fit.total <= device_bytes:
            out.append(f"lower train.micro_batch_tokens to {tokens} ({gib(fit.total)} GiB)")
            break
        tokens //= 2
    if cfg.lora.rank == 0 and cfg.train.backend == "local":
        lora = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 16})})
        fit = estimate_config(lora, shape, device, True)
        if fit.total <= device_bytes:
            out.append(f"use LoRA, lora.rank = 16 ({gib(fit.total)} GiB with checkpointing)")
    return out


def refusal(est: Estimate, cfg: Config, shape: ModelShape, device: torch.device, device_bytes: int,
            device_label: str) -> str | None:
    """One line when the run cannot fit the device, naming what to change; None when it fits."""
    if est.total <= device_bytes:
        return None
    big = ", ".join(f"{name} {gib(value)}" for name, value in est.parts.items() if value >= est.total / 10)
    todo = fixes(cfg, shape, device, device_bytes)
    what = "; ".join(todo) if todo else "use a device with more memory or a smaller model"
    return (f"the run needs about {gib(est.total)} GiB but the {device.type} device has {gib(device_bytes)} GiB "
            f"({device_label}; the largest parts: {big} GiB): {what}")


def config_shape(name: str) -> tuple[ModelShape | None, str]:
    """(the model's `ModelShape`, "") or (None, why the estimate is skipped)."""
    try:
        config = config_dict(name)
        return (None, f"{name}'s config.json is not cached yet") if config is None else (model_shape(config), "")
    except (OSError, ValueError, KeyError) as exc:  # an unreadable or unknown config.json: loading it will say
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_estimate(cfg: Config, shape: ModelShape) -> tuple[Estimate, torch.device, int, str, str]:
    """(estimate, device, device bytes, device label, why checkpointing is on or off) of a run."""
    from rollwise.hardware import resolve_device

    device = resolve_device(cfg.train.device)
    device_bytes, label = device_memory(device)
    est, why = resolve_checkpointing(cfg, shape, device, device_bytes)
    return est, device, device_bytes, label, why


def memory_report(cfg: Config) -> tuple[list[str], str | None]:
    """(the dry run's lines, one refusal line or None) for `cfg`; one line saying why when it cannot be
    estimated (the model's config.json not at hand)."""
    shape, skipped = config_shape(cfg.model.name)
    if shape is None:
        return [f"memory estimate: skipped ({skipped})"], None
    est, device, device_bytes, label, why = run_estimate(cfg, shape)
    return table(est, shape, cfg, device_bytes, label, why), refusal(est, cfg, shape, device, device_bytes, label)


def estimate_dict(cfg: Config) -> dict | None:
    """The estimate of `cfg` as a dict of GiB figures (benchmarks/gpu_check.py prints it beside
    `torch.cuda.max_memory_allocated`); None when the model's config.json is not at hand."""
    shape, _ = config_shape(cfg.model.name)
    if shape is None:
        return None
    est, _, device_bytes, label, why = run_estimate(cfg, shape)
    return {**est.as_dict(), "device_gib": device_bytes / 2**30, "device": label, "why": why}
