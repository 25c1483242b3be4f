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

import ctypes
import datetime
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
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


def spawn_workers(world_size: int, rendezvous: Rendezvous, cfg_json: str, model_path: str) -> list:
    """Start ranks 1..world_size-1 as spawned processes running `worker_main` (they die with this process)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        proc = ctx.Process(target=_spawned_worker, name=f"rollwise-rank-{rank}", daemon=True,
                           args=(rank, world_size, rendezvous.addr, rendezvous.port, cfg_json, model_path))
        proc.start()
        procs.append(proc)
    return procs


def _spawned_worker(rank: int, world_size: int, addr: str, port: int, cfg_json: str, model_path: str) -> None:
    """Entry point of a rank rank 0 spawned: dies with its parent (PR_SET_PDEATHSIG), then `worker_main`."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    worker_main(rank, world_size, addr, port, cfg_json, model_path)


def worker_main(rank: int, world_size: int, master_addr: str, master_port: int, cfg_json: str,
                model_path: str) -> None:
    """Run trainer rank `rank` (> 0) until rank 0 sends ("close",). Self-contained: Ray actors call it as is.

    `cfg_json` is the run's `Config.model_dump_json()`; `model_path` an HF directory (or model name) with the
    policy's architecture (its weights are replaced by rank 0's). On any error the traceback goes to the store
    (`error/<rank>`, which rank 0 reports) and the process exits with status 1.
    """
    store = None
    try:
        rendezvous = Rendezvous(master_addr, int(master_port), world_size,
                                agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
        store = rendezvous.store(rank, DEFAULT_TIMEOUT_S)
        _serve(rank, world_size, store, cfg_json, model_path)
    except BaseException:
        text = traceback.format_exc()
        if store is not None:
            try:
                store.set(f"{PREFIX}error/{rank}", text)
            except Exception:
                pass
        sys.stderr.write(f"rollwise trainer rank {rank}:\n{text}")
        sys.stderr.flush()
        os._exit(1)  # never hang in teardown with a broken process group


def worker_main_from_env(cfg) -> None:
    """torchrun: ranks > 0 of the CLI call this instead of training (RANK, WORLD_SIZE, MASTER_* from the env)."""
    rendezvous = Rendezvous.from_env()
    if rendezvous is None:
        raise RuntimeError("worker_main_from_env: RANK, WORLD_SIZE and MASTER_ADDR are not set (start with torchrun)")
    worker_main(int(os.environ["RANK"]), rendezvous.world_size, rendezvous.addr, rendezvous.port,
                cfg.model_dump_json(), cfg.model.name)


def _serve(rank: int, world_size: int, store, cfg_json: str, model_path: str) -> None:
    from rollwise.config import Config
    from rollwise.models import load_model
    from rollwise.train.fsdp import FSDPTrainer

    info = pickle.loads(store.get(f"{PREFIX}init"))  # waits for rank 0 (store timeout)
    torch.set_num_threads(info["threads"])
    cfg = Config.model_validate_json(cfg_json)
    if cfg.train.world_size != world_size:
        raise ValueError(f"train.world_size = {cfg.train.world_size} but {world_size} ranks were started")
    device = _worker_device(info["device_type"], rank)
    model, _ = load_model(model_path, dtype=torch.float32)
    ref_model = None
    if info["has_ref"]:  # the frozen reference is always the starting model (as in session.open_run)
        ref_model, _ = load_model(cfg.model.name, dtype=torch.float32)
        ref_model.eval().requires_grad_(False)
        ref_model.to(device)
    model.to(device)
    store.set(f"{PREFIX}ready/{rank}", "1")
    init_process_group(rank, world_size, store, info["device_type"], info["timeout_s"])
    trainer = FSDPTrainer(model, cfg.train, cfg.algo, info["pad_id"], ref_model=ref_model,
                          temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                          rank=rank, world_size=world_size)
    try:
        while True:
            command = receive_command()
            if command[0] == "close":
                break
            trainer.run_command(command)
    finally:
        trainer.closed = True
    dist.destroy_process_group()


def _worker_device(device_type: str, rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


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
