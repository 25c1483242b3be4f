"""Trainer ranks for `train.backend = "fsdp2"`: start them, meet them, command them, report their failures.

The driver (the process running `rollwise.loop`) is rank 0. Ranks 1..N-1 are workers that build the same
`FSDPTrainer` and then follow the commands rank 0 broadcasts (`dist.broadcast_object_list`):
("step", samples, version), ("skip_step",), ("state_dict",), ("probe", ids), ("save", dir),
("load", dir, extra), ("close",). Workers are started by one of:

- rank 0 itself (`spawn_workers`, the default): torch.multiprocessing spawn, MASTER_ADDR 127.0.0.1, a free port;
- torchrun: every process gets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0 runs the CLI and the
  others call `worker_main_from_env(cfg)`;
- Ray: an actor per rank calls `worker_main(rank, world_size, master_addr, master_port, cfg_json, model_path)`.

Meeting happens on a TCPStore before the process group exists: rank 0 publishes the run's facts (`init`),
each worker loads its model and answers `ready/<rank>`; a worker that fails writes its traceback to
`error/<rank>` and exits, so rank 0 never waits on a rank that is gone and can name it and its error.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

PREFIX = "rollwise/"
DEFAULT_TIMEOUT_S = 900.0  # a collective that waits longer than this fails (a hung rank): never forever
READY_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class Rendezvous:
    """Where the ranks meet: the TCPStore at addr:port; `agent_store` = torchrun hosts it (all are clients)."""

    addr: str
    port: int
    world_size: int
    agent_store: bool = False

    @classmethod
    def from_env(cls) -> "Rendezvous | None":
        """torchrun's (or any launcher's) RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or None when unset."""
        if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
            return None
        if os.environ.get("MASTER_PORT") == "0":  # torchrun passes `--master-port 0` on unchanged
            raise RuntimeError("MASTER_PORT is 0: start torchrun with a real --master-port (or --standalone)")
        return cls(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")),
                   int(os.environ["WORLD_SIZE"]),
                   agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    def store(self, rank: int, timeout_s: float) -> dist.TCPStore:
        master = rank == 0 and not self.agent_store
        return dist.TCPStore(self.addr, self.port, self.world_size if master else None, is_master=master,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


@dataclass
class Workers:
    """Rank 0's view of ranks 1..N-1: the store they report to and, when rank 0 started them, their processes."""

    store: dist.TCPStore
    world_size: int
    processes: list = field(default_factory=list)  # multiprocessing.Process per rank 1..N-1 (spawn only)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """One line naming the first rank that failed, with its traceback's last line; None if all look alive.

        Waits up to `wait_s` for a failing rank to finish reporting (its traceback, its exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, self.world_size):
                report = self._rank_failure(rank)
                if report is not None:
                    return report
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def traceback_of(self, rank: int) -> str | None:
        key = f"{PREFIX}error/{rank}"
        try:
            if self.store.check([key]):
                return self.store.get(key).decode(errors="replace")
        except Exception:  # the store itself is gone
            return None
        return None

    def _rank_failure(self, rank: int) -> str | None:
        text = self.traceback_of(rank)
        if text is not None:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            return f"trainer rank {rank} failed: {lines[-1].strip() if lines else 'no traceback'}"
        if rank <= len(self.processes):
            proc = self.processes[rank - 1]
            code = proc.exitcode
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return (f"trainer rank {rank} (pid {proc.pid}) died with {how} and left no traceback "
                        "(killed from outside, e.g. out of memory)")
        return None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker has answered `ready/<rank>`; RuntimeError as soon as one fails."""
        keys = [f"{PREFIX}ready/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            report = self.failure()
            if report is not None:
                raise RuntimeError(report)
            if time.monotonic() > deadline:
                raise RuntimeError(f"trainer ranks: not all of ranks 1..{self.world_size - 1} joined within "
                                   f"{timeout_s:.0f} s; check that they were started with the same config")
            time.sleep(READY_POLL_S)

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait up to `grace_s` for the worker processes to exit, then kill the ones left (spawn only)."""
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


def publish_init(store, info: dict[str, Any]) -> None:
    """Rank 0: the facts every worker needs before it builds its trainer (pad id, device, threads, timeout)."""
    store.set(f"{PREFIX}init", pickle.dumps(info))


def init_process_group(rank: int, world_size: int, store, device_type: str, timeout_s: float) -> None:
    """The default process group over `store` (gloo on CPU, NCCL on CUDA), collectives bounded by `timeout_s`."""
    dist.init_process_group(backend_for(device_type), store=dist.PrefixStore(f"{PREFIX}pg", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def send_command(command: tuple) -> None:
    """Rank 0: broadcast one command to every worker."""
    dist.broadcast_object_list([command], src=0)


def receive_command() -> tuple:
    """Workers: the next command rank 0 broadcasts."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def looks_like_comm_error(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer died or timed out."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))
