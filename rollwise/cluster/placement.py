"""`Cluster`: a Ray cluster (started here or joined) and the placement groups rollwise's actors run in.

Bundles: one per engine worker and one per trainer rank above 0, each `cluster.resources` (e.g. `{CPU = 1}`
here, `{CPU = 8, GPU = 1}` on a GPU node). Trainer rank 0 is not an actor: it is the driver process itself,
the one that runs `rollwise.loop` (and takes its resources outside Ray).

- `colocate = true`: one placement group, strategy PACK (engines and ranks packed onto as few nodes as fit);
- `colocate = false`: two groups, strategy SPREAD, one for the engine workers and one for the trainer ranks.

Without `cluster.address`, a local cluster is started bound to 127.0.0.1, with as many logical CPUs as the
bundles ask (GPUs as detected), no dashboard, and its logs under its session folder (linked from
`log_dir/ray-logs`), not on the console. `close()` (also the context manager's exit, an exception, Ctrl-C, or
SIGTERM turned into SystemExit) kills rollwise's actors, removes the groups and calls `ray.shutdown()`; when
the cluster was started here, it then waits for every Ray process it started and kills any survivor.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import signal
import threading
import weakref
from pathlib import Path
from typing import Any

import psutil

from rollwise.config import ClusterConfig

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 120.0  # placement groups: how long to wait for the cluster to grant the bundles
_EXIT_WAIT_S = 10.0  # after ray.shutdown: how long Ray's processes get to exit before they are killed
_RAY_NAMES = ("raylet", "gcs_server", "ray::")
_GROUP_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")  # e.g. CPU_group_0_<placement group id>


class Cluster:
    """Ray for one run: the connection, the placement groups, and every actor started in them.

    Args:
        cfg: the `[cluster]` section (address, engine_workers, colocate, resources).
        train_world_size: trainer ranks in all (rank 0 is this process: `train_world_size - 1` rank bundles).
        log_dir: where `ray-logs` (a link to the local cluster's logs) goes; None = nowhere.
        ready_timeout_s: how long to wait for the placement groups.
    """

    def __init__(self, cfg: ClusterConfig, train_world_size: int = 1, log_dir: str | Path | None = None,
                 ready_timeout_s: float = _READY_TIMEOUT_S):
        self.cfg = cfg
        self.bundle = _bundle(cfg.resources)
        self.engine_workers = cfg.engine_workers
        self.trainer_ranks = train_world_size - 1  # ranks 1..N-1 (rank 0 is the driver)
        self.started_here = False  # a local cluster started by this object (its processes are ours to reap)
        self._owns_connection = False  # ray.init was called here (else: a connection someone else made)
        self.closed = False
        self.logs_dir: Path | None = None  # the local cluster's log folder (one .out/.err pair per worker)
        self._groups: list[Any] = []
        self._engine_group: tuple[Any, int] | None = None  # (placement group, index of engine bundle 0)
        self._rank_group: tuple[Any, int] | None = None  # (placement group, index of rank 1's bundle)
        self._actors: list[tuple[str, Any]] = []
        self._ray_processes: list[psutil.Process] = []
        self._sigterm_before = None
        try:
            self._connect(Path(log_dir) if log_dir is not None else None)
            self._place(ready_timeout_s)
        except BaseException:
            self.close()
            raise
        atexit.register(_close_ref, weakref.ref(self))

    # -- public -------------------------------------------------------------------------------------
    def engine_strategy(self, worker: int):
        """Ray scheduling strategy that puts engine worker `worker` (0-based) in its bundle."""
        if not 0 <= worker < self.engine_workers:
            raise ValueError(f"engine worker {worker} has no bundle: cluster.engine_workers = {self.engine_workers}")
        return _in_bundle(*self._engine_group, worker)

    def rank_strategy(self, rank: int):
        """Ray scheduling strategy that puts trainer rank `rank` (1..world_size-1) in its bundle."""
        if not 1 <= rank <= self.trainer_ranks:
            raise ValueError(f"trainer rank {rank} has no bundle: ranks 1..{self.trainer_ranks} run as actors "
                             "(rank 0 is the driver)")
        return _in_bundle(*self._rank_group, rank - 1)

    def actor_options(self) -> dict[str, Any]:
        """`.options(...)` resources of one actor: exactly one bundle's."""
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU", "memory")}
        options: dict[str, Any] = {"num_cpus": self.bundle.get("CPU", 0.0), "num_gpus": self.bundle.get("GPU", 0.0)}
        if extra:
            options["resources"] = extra
        if "memory" in self.bundle:
            options["memory"] = self.bundle["memory"]
        return options

    def track(self, label: str, actor) -> None:
        """Kill `actor` (named `label` in errors) on close."""
        self._actors.append((label, actor))

    def driver_address(self) -> str:
        """An address of this process that the other nodes reach (127.0.0.1 on a local cluster)."""
        import ray

        return "127.0.0.1" if self.started_here else ray.util.get_node_ip_address()

    def close(self) -> None:
        """Kill the actors, remove the placement groups, shut Ray down; reap a local cluster. Idempotent."""
        if self.closed:
            return
        self.closed = True
        previous = _ignore_sigint()  # a second Ctrl-C must not interrupt the cleanup half-way
        try:
            self._shutdown()
        finally:
            _restore_sigint(previous)
            self._restore_sigterm()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- start --------------------------------------------------------------------------------------
    def _connect(self, log_dir: Path | None) -> None:
        import ray

        if ray.is_initialized():  # someone else's connection (a notebook, a test): used, never shut down
            self._owns_connection = False
            return
        self._owns_connection = True
        quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
        if self.cfg.address:
            ray.init(address=self.cfg.address, **quiet)
        else:
            _bind_to_loopback()
            asked = self._asked()
            custom = {k: v for k, v in asked.items() if k not in ("CPU", "GPU", "memory")}
            context = ray.init(num_cpus=max(1, math.ceil(asked.get("CPU", 0.0))), resources=custom or None,
                               include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
            self.started_here = True
            self._ray_processes = _ray_descendants()
            self.logs_dir = Path(context.address_info["session_dir"]) / "logs"
            if log_dir is not None:
                _link_logs(log_dir, self.logs_dir)
        self._install_sigterm()

    def _asked(self) -> dict[str, float]:
        bundles = self.engine_workers + self.trainer_ranks
        return {k: v * bundles for k, v in self.bundle.items()}

    def _place(self, timeout_s: float) -> None:
        from ray.util.placement_group import placement_group

        self._check_feasible()
        engine_bundles = [dict(self.bundle) for _ in range(self.engine_workers)]
        rank_bundles = [dict(self.bundle) for _ in range(self.trainer_ranks)]
        if self.cfg.colocate:
            group = placement_group(engine_bundles + rank_bundles, strategy="PACK")
            self._groups = [group]
            self._engine_group, self._rank_group = (group, 0), (group, self.engine_workers)
        else:
            engines = placement_group(engine_bundles, strategy="SPREAD")
            self._groups = [engines]
            self._engine_group = (engines, 0)
            if rank_bundles:
                ranks = placement_group(rank_bundles, strategy="SPREAD")
                self._groups.append(ranks)
                self._rank_group = (ranks, 0)
        for group in self._groups:
            if not group.wait(timeout_seconds=timeout_s):
                raise RuntimeError(f"Ray did not grant the placement group in {timeout_s:.0f} s: "
                                   f"{self._resources_line()}")

    def _check_feasible(self) -> None:
        import ray

        total = ray.cluster_resources()
        short = [k for k, v in self._asked().items() if total.get(k, 0.0) + 1e-9 < v]
        if short:
            raise RuntimeError(f"the Ray cluster cannot place rollwise's actors: {self._resources_line()}")

    def _resources_line(self) -> str:
        import ray

        total = {k: v for k, v in ray.cluster_resources().items() if not _internal(k)}
        available = ray.available_resources()  # omits a resource with nothing free
        free = {k: available.get(k, 0.0) for k in total}
        return (f"{self.engine_workers} engine worker(s) + {self.trainer_ranks} trainer rank(s) x {self.bundle} "
                f"= {self._asked()} asked; the cluster has {_plain(total)} ({_plain(free)} free); lower "
                "cluster.engine_workers, train.world_size or cluster.resources, or add nodes")

    # -- stop ---------------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            self._reap()
            return
        for label, actor in reversed(self._actors):
            _quietly(ray.kill, actor, no_restart=True, what=f"kill {label}")
        self._actors.clear()
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            _quietly(remove_placement_group, group, what="remove a placement group")
        self._groups.clear()
        if self.started_here:
            self._ray_processes += _ray_descendants()  # worker processes started since ray.init
        if self._owns_connection:
            _quietly(ray.shutdown, what="ray.shutdown")
        self._reap()

    def _reap(self) -> None:
        """Wait for the local cluster's processes to exit; kill the ones still there after `_EXIT_WAIT_S`."""
        procs = list({p.pid: p for p in self._ray_processes}.values())
        self._ray_processes = []
        _, alive = psutil.wait_procs(procs, timeout=_EXIT_WAIT_S)
        for proc in alive:
            logger.warning("Ray process %d (%s) still running after ray.shutdown: killing it", proc.pid, _name(proc))
            _quietly(proc.kill, what=f"kill {proc.pid}")
        psutil.wait_procs(alive, timeout=_EXIT_WAIT_S)

    def _install_sigterm(self) -> None:
        """SIGTERM -> SystemExit in the main thread, so `with Cluster(...)` and `finally` blocks clean up."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm_before = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._sigterm_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None


def _bundle(resources: dict[str, float]) -> dict[str, float]:
    if not resources or any(not (v > 0) for v in resources.values()):
        raise ValueError(f"cluster.resources = {resources}: each bundle needs at least one resource, all "
                         "amounts > 0 (e.g. {CPU = 1} or {CPU = 8, GPU = 1})")
    return {str(k): float(v) for k, v in resources.items()}


def _internal(resource: str) -> bool:
    """Ray's bookkeeping resources: per node, per accelerator type, and per placement group bundle."""
    return resource.startswith(("node:", "accelerator_type")) or _GROUP_RESOURCE.search(resource) is not None


def _in_bundle(group, first: int, offset: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=first + offset,
                                            placement_group_capture_child_tasks=True)


def _bind_to_loopback() -> None:
    """Make a local Ray node listen on 127.0.0.1 only: Ray resolves 127.0.0.1 to the host's routable address
    unless its 'no cluster' switch is off (read from the environment by the raylet and the workers, and from
    `ray_constants` in this process)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _ray_descendants() -> list[psutil.Process]:
    """This process's descendants that belong to Ray (its node processes, their helpers and workers)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            name, cmd = proc.name(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if name.startswith(_RAY_NAMES) or f"{os.sep}ray{os.sep}" in cmd or "ray::" in cmd:
            found.append(proc)
            found += [p for p in _children(proc)]
    return found


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "gone"


def _link_logs(log_dir: Path, ray_logs: Path) -> None:
    """`log_dir/ray-logs` -> the local cluster's log folder (raylet, gcs, one file pair per worker)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        link = log_dir / "ray-logs"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ray_logs, target_is_directory=True)
    except OSError as exc:
        logger.warning("cannot link the Ray logs into %s: %s", log_dir, exc)


def _plain(resources: dict[str, float]) -> dict[str, float]:
    return {k: (int(v) if float(v).is_integer() else round(v, 3)) for k, v in sorted(resources.items())
            if k != "object_store_memory" and k != "memory"}


def _quietly(fn, *args, what: str, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # cleanup goes on: one failed step must not leave the rest running
        logger.warning("cluster shutdown: %s failed: %s", what, exc)


def _ignore_sigint():
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    return None


def _restore_sigint(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _close_ref(ref) -> None:
    cluster = ref()
    if cluster is not None and not cluster.closed:
        cluster.close()


__all__ = ["Cluster"]
