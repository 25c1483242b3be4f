"""Trainer ranks 1..N-1 as Ray actors, each running `rollwise.train.launch.worker_main`.

Rank 0 is the driver process (it runs the loop and is `torch.distributed`'s master at `master_addr:master_port`);
the actors join its process group and follow its commands until it sends ("close",). A rank whose call raises
or whose process dies is reported by `check()` / `join()` as one `WorkerError` naming the rank and the remote
traceback's last line.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollwise.cluster.errors import WorkerError, last_line, worker_error

_START_TIMEOUT_S = 600.0  # a rank actor's start (a Ray worker process importing torch)


class TrainerRank:
    """The body of one trainer-rank actor (a plain actor: `worker_main` runs in its main thread)."""

    def run(self, rank: int, world_size: int, master_addr: str, master_port: int, cfg_json: str,
            model_path: str):
        from rollwise.train.launch import worker_main

        return worker_main(rank, world_size, master_addr, master_port, cfg_json, model_path)

    def pid(self) -> int:
        return os.getpid()


class RankProcess:
    """One rank actor seen as a `multiprocessing.Process` (`exitcode`, `pid`, `join`, `is_alive`, `kill`), so
    `rollwise.train.distributed.Workers(store, world_size, processes)` on rank 0 can tell a rank that died
    without writing a traceback (exit code 1 for any end other than a normal return)."""

    def __init__(self, actor, ref, pid: int):
        self.actor, self.ref, self.pid = actor, ref, pid

    @property
    def exitcode(self) -> int | None:
        import ray

        done, _ = ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            ray.get(self.ref)
            return 0
        except ray.exceptions.RayError:
            return 1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass


class TrainerRanks:
    """The running ranks 1..N-1: their actors and the futures of their `worker_main` calls."""

    def __init__(self, actors: list, refs: list, ranks: list[int], pids: list[int], logs_dir: Path | None = None):
        self.actors, self.refs, self.ranks, self.pids = actors, refs, ranks, pids
        self.logs_dir = logs_dir  # a local cluster's logs: the rank actors' stderr files
        self.store = None  # rank 0's TCPStore, once it exists: where a failing rank writes its traceback

    def processes(self) -> list[RankProcess]:
        """The ranks as process-like objects, rank 1 first (for `distributed.Workers`)."""
        return [RankProcess(a, r, pid) for a, r, pid in zip(self.actors, self.refs, self.pids)]

    def check(self) -> None:
        """Raise `WorkerError` if a rank has failed or died (returns at once; a rank still running is fine)."""
        import ray

        done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        for ref in done:
            self._get(ref, timeout_s=0)

    def join(self, timeout_s: float | None = None) -> list:
        """Wait until every rank's `worker_main` returned; their return values in rank order."""
        import ray

        if timeout_s is not None:
            _, pending = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=timeout_s)
            if pending:
                late = [self.ranks[self.refs.index(r)] for r in pending]
                raise WorkerError(f"trainer rank {late[0]}", f"trainer ranks {late} did not finish in "
                                  f"{timeout_s:.0f} s (see the Ray logs in the run folder's ray-logs)")
        return [self._get(ref) for ref in self.refs]

    def close(self) -> None:
        """Kill the rank actors (the cluster also kills them on its close)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass

    def _get(self, ref, timeout_s: float | None = None):
        import ray

        rank = self.ranks[self.refs.index(ref)]
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayError as err:
            label = f"trainer rank {rank}"
            # worker_main writes its traceback to the store and to stderr, then ends its process
            text = self._store_traceback(rank) or self._logged_traceback(rank)
            if text is not None:
                raise WorkerError(label, f"{label} failed: {last_line(text)}", text) from err
            raise worker_error(label, err) from err

    def _logged_traceback(self, rank: int) -> str | None:
        """The traceback worker_main printed ("rollwise trainer rank R:" ...) in the actor's stderr log."""
        if self.logs_dir is None:
            return None
        marker = f"rollwise trainer rank {rank}:"
        for path in self.logs_dir.glob(f"worker-*-{self.pids[self.ranks.index(rank)]}.err"):
            text = path.read_text(errors="replace")
            if marker in text:
                return text[text.rindex(marker) + len(marker):]
        return None

    def _store_traceback(self, rank: int) -> str | None:
        if self.store is None:
            return None
        from rollwise.train.distributed import PREFIX

        try:
            key = f"{PREFIX}error/{rank}"
            return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
        except Exception:  # the store is gone with rank 0's process group
            return None


def start_trainer_ranks(cluster, world_size: int, master_addr: str, master_port: int, cfg_json: str,
                        model_path: str, start_timeout_s: float = _START_TIMEOUT_S) -> TrainerRanks:
    """Start ranks 1..world_size-1, each in its bundle of `cluster`, calling `worker_main(rank, world_size,
    master_addr, master_port, cfg_json, model_path)`; returns once their actors are up (rank 0, the caller,
    then meets them at master_addr:master_port)."""
    import ray

    if world_size - 1 > cluster.trainer_ranks:
        raise ValueError(f"train.world_size = {world_size} needs {world_size - 1} trainer-rank bundles; the "
                         f"cluster was placed for {cluster.trainer_ranks} (pass the same world size to Cluster)")
    actor_cls = ray.remote(TrainerRank)
    actors, ranks = [], list(range(1, world_size))
    for rank in ranks:
        actor = actor_cls.options(scheduling_strategy=cluster.rank_strategy(rank), max_restarts=0,
                                  **cluster.actor_options()).remote()
        cluster.track(f"trainer rank {rank}", actor)
        actors.append(actor)
    pids = []
    for rank, actor in zip(ranks, actors):  # the actors are up (pid) before their long call starts
        try:
            pids.append(ray.get(actor.pid.remote(), timeout=start_timeout_s))
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerError(f"trainer rank {rank}", f"trainer rank {rank} did not start in "
                              f"{start_timeout_s:.0f} s: its bundle is still held (an earlier rank actor not "
                              "closed?) or its node is gone") from err
        except ray.exceptions.RayError as err:
            raise worker_error(f"trainer rank {rank}", err) from err
    refs = [a.run.remote(rank, world_size, master_addr, master_port, cfg_json, str(model_path))
            for rank, a in zip(ranks, actors)]
    return TrainerRanks(actors, refs, ranks, pids, logs_dir=cluster.logs_dir)
