"""Weight-sync transports: how the trainer's state dict reaches an engine (`sync.transport`).

- `tensors`: in-process copy into the engine's own parameters (the torch engine's `update_weights`).
- `safetensors`: the full HF state dict written as a folder `sync_dir/v<version>` (tmp dir + rename), then
  `engine.reload_from(folder, version)`; older folders are deleted. The state dict must be whole: a missing
  weight, or part of a fused group (q/k/v, gate/up), is refused, because vLLM fuses those groups on load and
  a partial group loads NaN / stale rows.
- `nccl`: vLLM's native GPU weight transfer (`vllm.distributed.weight_transfer`, vLLM 0.32): the trainer
  process is rank 0 of a transfer group and streams every tensor into the engine workers, which load it
  in place (`start_weight_update` / `update_weights` / `finish_weight_update`). Needs CUDA; not tested here.
- `auto`: `tensors` for the torch engine, `safetensors` for vLLM on CPU, `nccl` for vLLM on CUDA.

`push(state_dict, version)` returns metrics: `sync/time_s` (wall seconds of the whole push) and `sync/bytes`
(tensor bytes sent).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch

from rollwise.models.atomic import fsync_dir

TRANSPORTS = ("auto", "tensors", "safetensors", "nccl")
WEIGHTS_FILE = "model.safetensors"
# files of the model folder copied next to the weights, so the folder is a loadable HF model on its own
SIDE_FILES = ("config.json", "generation_config.json")
# checkpoint names vLLM loads as one fused tensor: every member must come together
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_VERSION_DIR = re.compile(r"^v(\d+)$")


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
        self.tied = _tied(self.model_dir)

    def push(self, state_dict, version):
        start = time.perf_counter()
        folder, nbytes = write_version_dir(state_dict, version, self.sync_dir, self.model_dir,
                                           expected=self.expected, tied=self.tied,
                                           dtype=getattr(self.engine, "dtype", None))
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
        if not getattr(engine, "accepts_tensors", hasattr(engine, "model")):
            raise ValueError(f"sync.transport = 'tensors' copies into an in-process torch engine; "
                             f"{type(engine).__name__} takes 'safetensors' or 'nccl'")
        return TensorsTransport(engine)
    if name == "safetensors":
        if not hasattr(engine, "reload_from"):
            raise ValueError(f"sync.transport = 'safetensors' needs an engine with reload_from (vLLM); "
                             f"{type(engine).__name__} takes 'tensors'")
        if sync_dir is None:
            sync_dir = getattr(engine, "sync_dir", None)
        if sync_dir is None:
            raise ValueError("sync.transport = 'safetensors' needs a sync folder (pass sync_dir)")
        return SafetensorsTransport(engine, sync_dir)
    return NcclTransport(engine)


def _auto_name(engine) -> str:
    if getattr(engine, "accepts_tensors", False) or not hasattr(engine, "reload_from"):
        return "tensors"
    device = getattr(engine, "device", torch.device("cpu"))
    return "nccl" if torch.device(device).type == "cuda" else "safetensors"


# -- the safetensors folder ----------------------------------------------------------------------------
def state_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Tensor names stored in the model folder's `*.safetensors` files (headers only, nothing loaded)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file; save the model with save_pretrained "
                                f"(safe_serialization) first")
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            names.update(fh.keys())
    return names


def _tied(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def check_whole(state_dict: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Refuse a state dict that is not the whole checkpoint `expected` (names as `save_pretrained` writes).

    Raises ValueError naming the missing tensors, and first any fused group (q/k/v, gate/up) sent in part.
    """
    given = set(state_dict)
    partial = []
    for name in sorted(given):
        for group in FUSED_GROUPS:
            for member in group:
                if f".{member}." not in name:
                    continue
                siblings = [name.replace(f".{member}.", f".{other}.") for other in group]
                lacking = [s for s in siblings if s not in given and s in expected]
                if lacking:
                    partial.append(f"{name} without {', '.join(lacking)}")
    if partial:
        raise ValueError(f"weight sync refused: part of a fused group ({'; '.join(partial[:4])}"
                         f"{'...' if len(partial) > 4 else ''}); vLLM loads q/k/v and gate/up as one tensor, "
                         f"send whole groups (the full state dict)")
    missing = sorted(expected - given)
    if missing:
        raise ValueError(f"weight sync refused: {len(missing)} tensor(s) missing from the state dict "
                         f"({', '.join(missing[:6])}{'...' if len(missing) > 6 else ''}); send the full state "
                         f"dict (model.state_dict() names)")
    unknown = sorted(given - expected)
    if unknown:
        raise ValueError(f"weight sync refused: {len(unknown)} tensor(s) not in the engine's checkpoint "
                         f"({', '.join(unknown[:6])}); state dict names must be the HF names save_pretrained writes")


def write_version_dir(state_dict: dict[str, torch.Tensor], version: int, sync_dir: str | Path,
                      model_dir: str | Path, expected: set[str] | None = None, tied: bool | None = None,
                      dtype: torch.dtype | None = None) -> tuple[Path, int]:
    """Write the state dict as `sync_dir/v<version>/model.safetensors` (+ config files), atomically.

    A tied model's `lm_head.weight` (present in `state_dict()`, absent from `named_parameters()`) is dropped:
    the embedding is written once, as `save_pretrained` does. Floating tensors are cast to `dtype` (the
    engine's) when given. Returns (folder, tensor bytes written).
    """
    from safetensors.torch import save_file

    model_dir, sync_dir = Path(model_dir), Path(sync_dir)
    expected = checkpoint_names(model_dir) if expected is None else expected
    tied = _tied(model_dir) if tied is None else tied
    state = dict(state_dict)
    if tied and "lm_head.weight" in state and "lm_head.weight" not in expected:
        del state["lm_head.weight"]
    check_whole(state, expected)
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous().clone()  # own storage: safetensors refuses shared tensors
    sync_dir.mkdir(parents=True, exist_ok=True)
    final = sync_dir / f"v{int(version)}"
    tmp = sync_dir / f".tmp-v{int(version)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for side in SIDE_FILES:
            if (model_dir / side).exists():
                shutil.copyfile(model_dir / side, tmp / side)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(sync_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, state_bytes(tensors)


def delete_older_versions(sync_dir: str | Path, keep: Path) -> None:
    """Remove every `v<N>` folder of `sync_dir` but `keep` (and stale tmp folders of this process)."""
    for path in Path(sync_dir).iterdir():
        if path == keep or not path.is_dir():
            continue
        if _VERSION_DIR.match(path.name) or path.name.startswith(".tmp-v") and f"-{os.getpid()}-" in path.name:
            shutil.rmtree(path, ignore_errors=True)


# -- vLLM's native GPU transfer --------------------------------------------------------------------------
class NcclTransport(Transport):
    """vLLM 0.32's native weight transfer (`vllm.distributed.weight_transfer`), trainer side.

    The engine must be an in-process `VLLMEngine` on CUDA started with a `weight_transfer_config` (it is by
    default on CUDA). Backend: `nccl` (a PyNccl group: the trainer is rank 0, the engine's workers ranks
    1..N) when the engine's GPUs are not the trainer's; `ipc` (CUDA IPC handles, no copy through NCCL) when
    they share one GPU, since NCCL refuses two ranks on one device. Override with engine option
    `weight_transfer_backend`. After the transfer the tied head needs no re-pack (GPU kernels read the
    Parameter), the prefix cache is reset and the version adopted. Written from the vLLM source; not run
    here (no CUDA on this machine).
    """

    name = "nccl"

    def __init__(self, engine):
        if not torch.cuda.is_available():
            raise RuntimeError("sync.transport = 'nccl' needs CUDA (vLLM's native GPU weight transfer); on "
                               "CPU use 'safetensors' (or 'auto')")
        if not hasattr(engine, "llm") or getattr(engine, "weight_transfer_backend", None) is None:
            raise ValueError(f"sync.transport = 'nccl' needs an in-process VLLMEngine on CUDA started with a "
                             f"weight_transfer_config; got {type(engine).__name__}")
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
