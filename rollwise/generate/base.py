"""The engine protocol: what the loop needs from anything that generates responses, and what it may offer.

Every engine declares its optional abilities in `caps` (an `EngineCaps`); callers test `engine.caps.X` and
never probe with `hasattr`. An optional method exists exactly when its capability is declared
(`tests/test_engine_caps.py` checks every engine class of rollwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rollwise.types import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do beyond the required members of `Engine` (all False: the bare contract).

    probe_logprobs: `probe_logprobs(token_ids)`, exact fp32 log-softmax log-probs of given tokens (the Sync
        stage's check, the engine teacher's scores, hard-sample substitution).
    continue_aborted: a request whose `response_ids` holds an aborted response's tokens continues it
        (partial rollouts); aborted results keep their tokens.
    adapters: serves LoRA adapters itself: `update_adapter(folder, version)` (the Sync stage then sends the
        adapter, not merged weights).
    reload_from: `reload_from(folder, version)` reloads every weight from a safetensors folder (the safetensors
        and auto transports); such an engine also has `model_dir` (its HF folder) and `sync_dir` (where weight
        folders go by default; None: the caller gives one).
    rng_state: its sampling RNG state can be saved and restored (`rng_state()`, `set_rng_state(state)`), so a
        resumed run samples the same tokens.
    local_model: `.model` is a torch module of the policy in this process (its config bounds serve requests;
        uploaded weights are checked against its parameters).
    tensors: `update_weights` is its cheap path (an in-process copy, or Ray's object store): the `tensors`
        transport, and what `auto` picks.
    sleep_mode: `release_memory()` lets go of the engine's accelerator memory while the trainer trains (vLLM's
        sleep mode, when the engine shares the trainer's GPU) and `resume_memory(tags)` takes it back; both are
        no-ops on an engine started without it. The Sync stage calls them (`WeightSync.release_memory`).
    request_feed: `generate(requests, on_finish, feed=...)` also runs the requests a `rollwise.generate.feed.Feed`
        hands it while the call runs, in free slots of the running batch (continuous batching across the turns
        of multi-turn episodes); results of fed requests reach `on_finish` only. Engines without it run
        episodes in rounds, one `generate` call per turn.
    """

    probe_logprobs: bool = False
    continue_aborted: bool = False
    adapters: bool = False
    reload_from: bool = False
    rng_state: bool = False
    local_model: bool = False
    tensors: bool = False
    sleep_mode: bool = False
    request_feed: bool = False


# the methods each capability brings (the others are behaviours or attributes)
CAP_METHODS: dict[str, tuple[str, ...]] = {
    "probe_logprobs": ("probe_logprobs",),
    "adapters": ("update_adapter",),
    "reload_from": ("reload_from",),
    "rng_state": ("rng_state", "set_rng_state"),
    "sleep_mode": ("release_memory", "resume_memory"),
}


class Engine(Protocol):
    """A rollout engine (in-process PyTorch sampler, vLLM, SGLang, an HTTP server, Ray workers...).

    `version` is the policy version of the weights it currently samples with (None: unknown after a failed
    sync; `generate` then refuses). `dtype` is its compute dtype (None: unknown, e.g. a server's 'auto'),
    `device` where its weights live (a CPU placeholder for a server in another process), `stats` its
    counters (`EngineStats`: `generated_tokens`, ... and `reset()`).
    """

    version: int | None
    caps: EngineCaps
    dtype: torch.dtype | None
    device: torch.device
    stats: Any

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        """Run the requests to completion (or abort); results in request order. `on_finish(result)`, when
        given, is called as each request finishes and may call `abort` on the others. Only when
        caps.request_feed: a keyword `feed` (rollwise.generate.feed) adds requests while the call runs."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights (HF names, the whole model) and adopt `version`."""
        ...

    def abort(self, request_ids: list[int]) -> None:
        """Stop these requests at the next token; they return with status `aborted`."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, servers, actors, folders); idempotent."""
        ...

    # -- optional: only when the capability in `caps` is declared ---------------------------------------
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Only when caps.probe_logprobs: log-probs at temperature 1 of token_ids[1:] given the tokens before
        each (length len - 1), from the current weights, fp32 log-softmax."""
        ...

    def update_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Only when caps.adapters: sample later calls with the PEFT adapter saved in `adapter_dir`, as
        `version`."""
        ...

    def reload_from(self, path: str | Path, version: int) -> None:
        """Only when caps.reload_from: reload every weight from the safetensors folder `path`, adopt `version`."""
        ...

    def rng_state(self) -> Any:
        """Only when caps.rng_state: the sampling RNG state, whole (one generator's state, or a list of one per
        worker); `set_rng_state` takes it back as it came."""
        ...

    def set_rng_state(self, state: Any) -> None:
        """Only when caps.rng_state: restore a state `rng_state()` returned."""
        ...

    def release_memory(self) -> None:
        """Only when caps.sleep_mode: free the engine's accelerator memory until it is needed again."""
        ...

    def resume_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Only when caps.sleep_mode: take back what `release_memory` freed ('weights', 'kv_cache')."""
        ...
