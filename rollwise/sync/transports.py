"""Weight-sync transports: how the trainer's state dict reaches an engine (`sync.transport`).

- `tensors`: `engine.update_weights(state_dict, version)` where that is a copy in this process: the torch
  engine's parameters, or a vLLM engine whose core runs in this process (`VLLMEngine` with `in_process`: the
  tensors go to the model's own `load_weights` in the engine's dtype, no file; `rollwise.generate.vllm_inprocess`).
- `safetensors`: the full HF state dict written as a folder `sync_dir/v<version>` (tmp dir + rename), then
  `engine.reload_from(folder, version)`; older folders are deleted. The state dict must be whole: a missing
  weight, or part of a fused group (q/k/v, gate/up), is refused, because vLLM fuses those groups on load and
  a partial group loads NaN / stale rows (the folder format: `rollwise.models.weights_folder`).
- `nccl`: vLLM's native GPU weight transfer (`vllm.distributed.weight_transfer`, vLLM 0.32): the trainer
  process is rank 0 of a transfer group and streams every tensor into the engine workers, which load it
  in place (`start_weight_update` / `update_weights` / `finish_weight_update`). Needs CUDA; not tested here.
- `auto`: `tensors` for an engine whose `caps.tensors` is set (the torch engine, vLLM in process, Ray torch
  workers) or that cannot `reload_from`; else `safetensors` on CPU, `nccl` on CUDA (vLLM in a child process).

`push(state_dict, version)` returns metrics: `sync/time_s` (wall seconds of the whole push) and `sync/bytes`
(tensor bytes sent).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch

from rollwise.models.weights_folder import (
    checkpoint_names,
    delete_older_versions,
    state_bytes,
    tied_embeddings,
    write_version_dir,
)

TRANSPORTS = ("auto", "tensors", "safetensors", "nccl")


class Transport:
    """Pushes a state dict (HF names) into one engine as `version`."""

    name = "base"

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (idempotent)."""


class TensorsTransport(Transport):
    """In-process copy: `engine.update_weights(state_dict, version)`."""

    name = "tensors"

    def __init__(self, engine):
        self.engine = engine

    def push(self, state_dict, version):
        start = time.perf_counter()
        self.engine.update_weights(state_dict, version)
        return {"sync/time_s": time.perf_counter() - start, "sync/bytes": float(state_bytes(state_dict))}


class SafetensorsTransport(Transport):
    """A folder per version plus `engine.reload_from(folder, version)`; keeps only the newest folder."""

    name = "safetensors"

    def __init__(self, engine, sync_dir: str | Path):
        self.engine = engine
        self.sync_dir = Path(sync_dir)
        self.model_dir = Path(engine.model_dir)
        self.expected = checkpoint_names(self.model_dir)
        self.tied = tied_embeddings(self.model_dir)

    def push(self, state_dict, version):
        start = time.perf_counter()
        folder, nbytes = write_version_dir(state_dict, version, self.sync_dir, self.model_dir,
                                           expected=self.expected, tied=self.tied,
                                           dtype=self.engine.dtype)
        self.engine.reload_from(folder, version)
        delete_older_versions(self.sync_dir, keep=folder)
        return {"sync/time_s": time.perf_counter() - start, "sync/bytes": float(nbytes)}


def build_transport(name: str, engine, sync_dir: str | Path | None = None) -> Transport:
    """The transport `name` (auto|tensors|safetensors|nccl) for `engine`; `sync_dir` holds safetensors folders."""
    if name not in TRANSPORTS:
        raise ValueError(f"sync.transport = {name!r} is not one of {', '.join(TRANSPORTS)}")
    if name == "auto":
        name = _auto_name(engine)
    if name == "tensors":
        if not engine.caps.tensors:
            raise ValueError(f"sync.transport = 'tensors' copies into an in-process torch engine or a vLLM engine "
                             f"whose core runs in this process (rollout.engine_options.in_process); this "
                             f"{type(engine).__name__} takes 'safetensors' or 'nccl'")
        return TensorsTransport(engine)
    if name == "safetensors":
        if not engine.caps.reload_from:
            raise ValueError(f"sync.transport = 'safetensors' needs an engine with reload_from (vLLM); "
                             f"{type(engine).__name__} takes 'tensors'")
        if sync_dir is None:
            sync_dir = engine.sync_dir
        if sync_dir is None:
            raise ValueError("sync.transport = 'safetensors' needs a sync folder (pass sync_dir)")
        return SafetensorsTransport(engine, sync_dir)
    return NcclTransport(engine)


def _auto_name(engine) -> str:
    if engine.caps.tensors or not engine.caps.reload_from:
        return "tensors"
    return "nccl" if torch.device(engine.device).type == "cuda" else "safetensors"


# -- vLLM's native GPU transfer --------------------------------------------------------------------------
class NcclTransport(Transport):
    """vLLM 0.32's native weight transfer (`vllm.distributed.weight_transfer`), trainer side.

    The engine must be a `VLLMEngine` on CUDA started with a `weight_transfer_config` (by default when its
    engine core runs in a child process; one in this process takes `tensors`). Backend: `nccl` (a PyNccl group:
    the trainer is rank 0, the engine's workers ranks 1..N) when the engine's GPUs are not the trainer's; `ipc`
    (CUDA IPC handles, no copy through NCCL) when they share one GPU, since NCCL refuses two ranks on one device. Override with engine option
    `weight_transfer_backend`. After the transfer the tied head needs no re-pack (GPU kernels read the
    Parameter), the prefix cache is reset and the version adopted. Written from the vLLM source; not run
    here (no CUDA on this machine).
    """

    name = "nccl"

    def __init__(self, engine):
        if not torch.cuda.is_available():
            raise RuntimeError("sync.transport = 'nccl' needs CUDA (vLLM's native GPU weight transfer); on "
                               "CPU use 'safetensors' (or 'auto')")
        from rollwise.generate.vllm_engine import VLLMEngine

        if not isinstance(engine, VLLMEngine) or engine.weight_transfer_backend is None:
            raise ValueError(f"sync.transport = 'nccl' needs a VLLMEngine on CUDA started with a "
                             f"weight_transfer_config (its engine core in a child process; one in this process "
                             f"takes 'tensors'); got {type(engine).__name__}")
        self.engine = engine
        self.backend = engine.weight_transfer_backend
        self.source = _state_source()
        self._trainer = None

    def _connect(self):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            workers = self.engine.llm.llm_engine.vllm_config.parallel_config.world_size
            info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=_free_port(),
                                       world_size=1 + workers, rank=0)
        return WeightTransferTrainerFactory.trainer_init(info, client=_LLMClient(self.engine.llm),
                                                         source=self.source)

    def push(self, state_dict, version):
        start = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device())
        self.source.state = {n: t.detach().to(device) for n, t in state_dict.items()}
        self.engine.version, self.engine._failed_version = None, version  # unknown until the transfer completes
        if self._trainer is None:
            self._trainer = self._connect()
        self._trainer.send_weights()
        self.source.state = {}
        if not self.engine.llm.reset_prefix_cache():
            raise RuntimeError(f"weight sync to version {version}: vLLM refused to reset its prefix cache")
        self.engine.version, self.engine._failed_version = version, None
        return {"sync/time_s": time.perf_counter() - start, "sync/bytes": float(state_bytes(state_dict))}

    def close(self):
        if self._trainer is not None:
            self._trainer.shutdown()
            self._trainer = None


def _state_source():
    """A `vllm...WeightSource` over a replaceable state dict (`.state`), re-iterable, fresh each round."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateSource(WeightSource):
        def __init__(self):
            self.state: dict[str, torch.Tensor] = {}

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

        def __iter__(self):
            return iter(list(self.state.items()))

    return StateSource()


class _LLMClient:
    """`VLLMWeightSyncClient` over an in-process `vllm.LLM` (whose RL methods take request dicts)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self):
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
