"""`EngineWorker`: the body of one engine worker actor (a full engine inside a Ray worker process).

It builds its engine from an `EngineSpec` ("torch": `TorchEngine` on the HF folder, "vllm": `VLLMEngine`) and runs
one engine call at a time; it is used as a threaded actor (see `RemoteEngine`), so `abort` is served while a
`generate` runs. `generate_stream` yields results as they finish (a Ray streaming generator).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollwise.types import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class EngineSpec:
    """What an engine worker builds (all picklable).

    `engine`: "torch" or "vllm"; `model_dir`, `tokenizer_dir`: local HF folders (on every node);
    `options`: the engine's extra keywords (`rollout.engine_options`); vllm also takes `max_model_len` and
    `sync_dir` (worker k writes its weight folders under `sync_dir/worker-k`).
    """

    engine: str
    model_dir: str
    tokenizer_dir: str
    dtype: torch.dtype = torch.float32
    max_batch_size: int = 64
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None
    sync_dir: str | None = None


def build_engine(spec: EngineSpec, worker: int):
    """The engine `spec` names, for engine worker `worker` (its seed is `spec.seed + worker`)."""
    from rollwise.models import load_model_dir

    seed = spec.seed + worker
    if spec.engine == "torch":
        from rollwise.generate.torch_engine import TorchEngine

        model, tokenizer = load_model_dir(Path(spec.model_dir), dtype=torch.float32)
        if spec.tokenizer_dir != spec.model_dir:
            tokenizer = _tokenizer(spec.tokenizer_dir)
        return TorchEngine(model, tokenizer, dtype=spec.dtype, max_batch_size=spec.max_batch_size, seed=seed,
                           **spec.options)
    if spec.engine == "vllm":
        from rollwise.generate.vllm_engine import VLLMEngine

        sync_dir = Path(spec.sync_dir) / f"worker-{worker}" if spec.sync_dir else None
        extra = {"max_model_len": spec.max_model_len} if spec.max_model_len else {}
        return VLLMEngine(spec.model_dir, _tokenizer(spec.tokenizer_dir), dtype=spec.dtype,
                          max_batch_size=spec.max_batch_size, seed=seed, options=dict(spec.options),
                          sync_dir=sync_dir, **extra)
    raise ValueError(f"rollout.engine = {spec.engine!r} cannot run in a Ray engine worker (torch or vllm); "
                     "server engines (sglang, openai) are reached over HTTP: set cluster.ray = false")


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class EngineWorker:
    """The body of one engine worker actor (`ray.remote` is applied in `RemoteEngine`): one engine, one call at a
    time (`_engine_lock`), `abort` served at any time."""

    def __init__(self, spec: EngineSpec, worker: int):
        cpus = _assigned_cpus()
        if cpus:
            torch.set_num_threads(cpus)
            os.environ.setdefault("OMP_NUM_THREADS", str(cpus))
        self.engine = build_engine(spec, worker)
        self._engine_lock = threading.Lock()
        self._active_lock = threading.Lock()
        self._active: set[int] = set()  # request ids of the running call not finished yet

    def info(self) -> dict[str, Any]:
        import ray

        return {"dtype": self.engine.dtype, "device": str(self.engine.device), "version": self.engine.version,
                "pid": os.getpid(), "node": ray.util.get_node_ip_address(), "threads": torch.get_num_threads()}

    def generate_stream(self, requests: list[GenerationRequest], aborted: list[int]):
        """Yield ("results", [GenerationResult, ...]) as requests finish, then ("done", stats counters of
        this call). `aborted`: ids the driver aborted before the call (returned at once, as a local engine does)."""
        with self._engine_lock:
            finished: queue.SimpleQueue = queue.SimpleQueue()
            before = _counters(self.engine.stats)
            with self._active_lock:
                self._active = {r.request_id for r in requests}
            if aborted:
                self.engine.abort(list(aborted))
            thread = threading.Thread(target=self._run, args=(requests, finished), daemon=True)
            thread.start()
            while True:
                items = [finished.get()]
                while not finished.empty():
                    items.append(finished.get())
                results = [i for i in items if isinstance(i, GenerationResult)]
                if results:
                    yield "results", results
                ends = [i for i in items if not isinstance(i, GenerationResult)]
                if ends:
                    break
            thread.join()
            with self._active_lock:
                self._active = set()
            if isinstance(ends[0], BaseException):
                raise ends[0]
            after = _counters(self.engine.stats)
            yield "done", {k: after[k] - before.get(k, 0) for k in after}

    def _run(self, requests, finished: queue.SimpleQueue) -> None:
        def on_finish(result: GenerationResult) -> None:
            with self._active_lock:
                self._active.discard(result.request_id)
            finished.put(result)

        try:
            self.engine.generate(requests, on_finish=on_finish)
            finished.put("end")
        except BaseException as exc:  # re-raised in the actor's call, so the driver gets the traceback
            finished.put(exc)

    def abort(self, request_ids: list[int]) -> None:
        """Abort those of `request_ids` that the running call has not finished (others are ignored: an abort
        that arrives after its request finished must not linger into a later call)."""
        with self._active_lock:
            live = [i for i in request_ids if i in self._active]
        if live:
            self.engine.abort(live)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._engine_lock:
            self.engine.update_weights(state_dict, version)

    def reload_from(self, path: str, version: int) -> None:
        """Load the weights of a safetensors folder as `version` (the engine's own reload where it has one)."""
        with self._engine_lock:
            if self.engine.caps.reload_from:
                self.engine.reload_from(path, version)
            else:
                self.engine.update_weights(_read_safetensors(Path(path)), version)

    def update_adapter(self, adapter_dir: str, version: int) -> None:
        with self._engine_lock:
            self.engine.update_adapter(adapter_dir, version)

    def set_version(self, version: int) -> None:
        with self._engine_lock:
            self.engine.version = version

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        with self._engine_lock:  # both worker engines (torch, vllm) have caps.probe_logprobs
            return list(self.engine.probe_logprobs(token_ids))

    def rng_state(self):
        """The engine's sampling RNG state; None for an engine that keeps none (vLLM)."""
        return self.engine.rng_state() if self.engine.caps.rng_state else None

    def set_rng_state(self, state) -> None:
        if state is not None and self.engine.caps.rng_state:
            self.engine.set_rng_state(state)

    def close(self) -> None:
        with self._engine_lock:
            self.engine.close()


def _assigned_cpus() -> int:
    try:
        import ray

        return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except Exception:  # not in a Ray worker (the class used directly)
        return 0


def _counters(stats) -> dict[str, int]:
    if dataclasses.is_dataclass(stats):
        return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return {"generated_tokens": getattr(stats, "generated_tokens", 0)}


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} to reload the engine from")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state
