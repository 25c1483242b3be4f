"""Starting the trainer backend: the local `Trainer`, or FSDP2 rank 0 with its worker ranks 1..N-1.

- `build_trainer(cfg, model, ...)`: the run's trainer; for `train.backend = "fsdp2"` it meets (or spawns) the
  other ranks on a TCP store first (`rollwise.train.distributed`).
- `worker_main(...)`: the body of ranks 1..N-1, however they were started: spawned here (`spawn_workers`), by
  torchrun (`worker_main_from_env`), or as Ray actors (`rollwise.cluster.trainers`). A worker builds the same
  `FSDPTrainer` and follows rank 0's commands until ("close",).
"""

from __future__ import annotations

import copy
import ctypes
import os
import pickle
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from rollwise.train import distributed as ranks
from rollwise.train.distributed import DEFAULT_TIMEOUT_S, PREFIX, Rendezvous, init_process_group, receive_command
from rollwise.train.fsdp import FSDPTrainer
from rollwise.train.trainer import Trainer


def build_trainer(cfg, model, pad_id: int, ref_model=None, model_path: str | None = None, *,
                  rendezvous: ranks.Rendezvous | None = None, timeout_s: float = ranks.DEFAULT_TIMEOUT_S):
    """The run's trainer: today's `Trainer` for `train.backend = "local"` or `train.world_size = 1`, else an
    `FSDPTrainer` (rank 0) with ranks 1..N-1 started here (spawn), or met at `rendezvous` / torchrun's env.

    `model` stays unsharded (rank 0 shards a copy: the caller's engine may share `model`); `model_path` is an HF
    directory or model name the workers load the architecture from (default `cfg.model.name`); `ref_model` is
    rank 0's frozen reference (workers load their own from `cfg.model.name`).
    """
    train = cfg.train
    if train.backend == "local" or train.world_size == 1:
        return Trainer(model, train, cfg.algo, pad_id, ref_model=ref_model, temperature=cfg.rollout.temperature,
                       max_new_tokens=cfg.rollout.max_new_tokens)
    if getattr(cfg, "lora", None) is not None and cfg.lora.rank > 0:
        raise ValueError("lora.rank > 0 with train.backend = 'fsdp2' is not supported yet; use train.backend = "
                         "'local' for LoRA")
    world = train.world_size
    spawn = False
    if rendezvous is None:
        env = ranks.Rendezvous.from_env()
        if env is not None and env.world_size > 1:
            if int(os.environ.get("RANK", "0")) != 0:
                raise RuntimeError("build_trainer runs on rank 0 only; ranks > 0 call "
                                   "rollwise.train.launch.worker_main_from_env(cfg)")
            rendezvous = env
        else:
            rendezvous, spawn = ranks.Rendezvous("127.0.0.1", ranks.free_port(), world), True
    if rendezvous.world_size != world:
        raise ValueError(f"train.world_size = {world} but the launcher started {rendezvous.world_size} ranks; "
                         "make them equal")
    device_type = next(model.parameters()).device.type
    store = rendezvous.store(0, timeout_s)
    ranks.publish_init(store, {"pad_id": pad_id, "device_type": device_type, "threads": torch.get_num_threads(),
                               "timeout_s": timeout_s, "has_ref": ref_model is not None})
    processes = spawn_workers(world, rendezvous, cfg.model_dump_json(), model_path or cfg.model.name) \
        if spawn else []
    workers = ranks.Workers(store, world, processes)
    try:
        workers.wait_ready(timeout_s)
        ranks.init_process_group(0, world, store, device_type, timeout_s)
        try:
            return FSDPTrainer(copy.deepcopy(model), train, cfg.algo, pad_id, ref_model=ref_model,
                               temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                               rank=0, world_size=world, workers=workers)
        except BaseException as exc:
            report = workers.failure(wait_s=5.0 if ranks.looks_like_comm_error(exc) else 0.0)
            if report is None:
                raise
            raise RuntimeError(report) from exc
    except BaseException:
        workers.stop(grace_s=0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


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
