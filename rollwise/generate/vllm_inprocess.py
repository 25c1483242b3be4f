"""The vLLM engine core in this process: starting it here, and loading the trainer's tensors straight into it.

vLLM V1 runs its engine core (scheduler and model worker) in a child process unless the engine is built with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`. Built that way (`start()` below), `vllm.LLM.collective_rpc` calls the worker
object of this process directly and hands it its arguments by reference, nothing pickled. The weight sync uses
that: `load_tensors` gives the trainer's tensors (HF names; cast to the engine's dtype as vLLM copies each into
its own storage) to the worker's `model_runner.reload_weights(weights_iterator=...)` (vLLM 0.32,
`model_loader/reload/inplace.py`), which runs them through the model's own `load_weights` inside vLLM's
layer-wise in-place reload: each layer's `process_weights_after_loading` runs again (on the CPU it re-packs
the oneDNN copies of the linear weights) and the result is copied into the original storage, so CUDA graphs keep
pointing at it. No folder, no file.

The trade-off of an engine core in this process (what a run gains and what it gives up):
- gained: the sync costs a copy, not a write + read of the whole model; no process start, no pipe between the
  caller and the scheduler; on the CPU generation computes with this process's torch threads, which rollwise's
  thread governor adapts to the load (`rollwise.hardware.adapt_threads`), where a child keeps the OpenMP threads
  it started with, bound to cores (a fixed 2 threads here beside a busy competitor spin: `benchmarks/vllm_sync.py`);
- given up: the engine core steps on the calling thread, so nothing of it overlaps with the caller's work, and
  a crash in it (a CUDA error, an out-of-memory kill) ends the trainer too;
- its worker creates a torch.distributed default process group of one rank in this process, so a trainer that
  needs its own default group here (FSDP2 over several ranks) cannot share the process
  (`rollwise.generate.factory.engine_options` turns `in_process` off for `train.backend = "fsdp2"`); the group
  is destroyed when the last engine started here closes, when the start created it;
- unseeded requests sample from this process's global torch generator (vLLM's sampler draws from the default
  generator); seeded requests keep their own generators, so seeded runs are unaffected;
- vLLM's start freezes the objects alive at that moment out of the garbage collector (`gc.freeze`, undone at
  shutdown).
`start()` undoes the rest of what vLLM's start does to the process: it seeds the global RNGs (torch, CUDA,
numpy, random: their states are restored), replaces `torch.set_num_threads` by a no-op on the CPU (restored,
with the thread count), and caches `vllm.envs` (the cache is dropped again, so a later engine reads the
environment). vLLM's parallel state is global, so one engine at a time runs here: `can_start()` is False while
one does, and a second engine starts in a process of its own.
"""

from __future__ import annotations

import logging
import os
import random
import weakref
from contextlib import contextmanager

import torch

MULTIPROCESSING_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"
_live: "weakref.WeakSet" = weakref.WeakSet()  # engines whose core runs in this process, not closed yet
_owns_dist_group = False  # whether an in-process start created torch.distributed's default group


def can_start() -> bool:
    """Whether an engine core may start in this process now (none runs here yet)."""
    return not any(not engine._closed for engine in _live)


@contextmanager
def start():
    """Build `vllm.LLM` inside this block to run its engine core in this process; afterwards the process's
    RNG states, torch's thread setter and count, and vLLM's environment lookups are as they were."""
    import vllm.envs as envs

    global _owns_dist_group
    saved_var = os.environ.get(MULTIPROCESSING_VAR)
    cached = hasattr(envs.__getattr__, "cache_clear")  # vllm.envs caches its lookups once an engine core started
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = _rng_states()
    dist_before = torch.distributed.is_available() and torch.distributed.is_initialized()
    envs.disable_envs_cache()  # a cached "1" would send the engine core to a process of its own
    os.environ[MULTIPROCESSING_VAR] = "0"
    try:
        yield
    finally:
        if saved_var is None:
            os.environ.pop(MULTIPROCESSING_VAR, None)
        else:
            os.environ[MULTIPROCESSING_VAR] = saved_var
        envs.disable_envs_cache()
        if cached:
            envs.enable_envs_cache()
        torch.set_num_threads = set_threads
        set_threads(threads)
        _set_rng_states(rng)
        if not dist_before and torch.distributed.is_available() and torch.distributed.is_initialized():
            _owns_dist_group = True


def runs_here(llm) -> bool:
    """Whether this `vllm.LLM`'s engine core runs in this process (vLLM's in-process client)."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def register(engine) -> None:
    """Count `engine` (its `_closed` flag) among the engines running here until it closes."""
    _live.add(engine)


def closed(engine) -> None:
    """After `engine` shut its core down: when no engine runs here any more, drop vLLM's process groups (and
    torch.distributed's default group when a start created it), so a later engine or trainer starts clean."""
    global _owns_dist_group
    _live.discard(engine)
    if not can_start():
        return
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    if _owns_dist_group:
        destroy_distributed_environment()
        _owns_dist_group = False


def load_tensors(llm, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, version: int) -> None:
    """Load `state_dict` (HF names, the whole checkpoint, already checked) into the engine running here, through
    the worker extension's `rollwise_load_tensors`. The tensors go in as the trainer holds them: vLLM's weight
    loaders copy each into the engine's own storage (`copy_`), casting to the engine's `dtype` on the way, so
    the trainer's tensors are never aliased and no cast copy of the model is made first (a float32 trainer and a
    bfloat16 engine: one read of 4 bytes and one write of 2 per weight, where casting first also wrote and read
    a fresh bfloat16 copy). vLLM's warning for each floating-point weight whose dtype differs from its
    parameter's is dropped during the load: here the cast is the intent."""
    weights = ((name, tensor.detach()) for name, tensor in state_dict.items())
    with torch.no_grad(), _quiet_float_casts(dtype):
        llm.collective_rpc("rollwise_load_tensors", args=(weights, int(version)))


class _FloatCastFilter(logging.Filter):
    """Drops vLLM's "Attempted to load weight ... with dtype A into parameter with dtype B" lines where both
    dtypes are floating point and B is the engine's dtype (every other mismatch still reaches the log)."""

    PREFIX = "Attempted to load weight %s with dtype"

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith(self.PREFIX) or len(args) != 3:
            return True
        source, target = args[1], args[2]
        floating = isinstance(source, torch.dtype) and source.is_floating_point
        return not (floating and target == self.dtype)


@contextmanager
def _quiet_float_casts(dtype: torch.dtype):
    log = logging.getLogger("vllm.model_executor.models.utils")
    quiet = _FloatCastFilter(dtype)
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _rng_states() -> dict:
    import numpy as np

    states = {"torch": torch.random.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    import numpy as np

    torch.random.set_rng_state(states["torch"])
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
