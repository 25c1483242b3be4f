"""Engine workers as Ray actors, and `RemoteEngine`: the engine contract over them, seen from the driver.

Each `EngineWorker` actor builds a full engine inside itself ("torch": `TorchEngine` on the HF folder,
"vllm": `VLLMEngine`) and runs one `generate` call at a time. It is a threaded actor (`max_concurrency` 4), so
`abort` is served while a `generate` runs: partial rollouts abort the rest of a batch from `on_finish`.

`RemoteEngine.generate` splits the requests over the workers, keeping the requests of one prompt on one worker
(their shared prefill stays shared), largest groups first onto the least-loaded worker. Every worker streams its
results back as they finish (a Ray streaming generator per worker; `ray.wait` over them), so `on_finish` runs
here, in the driver, as each result arrives, and results come back in request order. Worker k samples from
seed `seed + k` (the workers must not draw the same stream); greedy decoding is the same as one local engine.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from rollwise.cluster.errors import WorkerError, worker_error
from rollwise.cluster.worker import EngineSpec, EngineWorker
from rollwise.generate.base import EngineCaps
from rollwise.generate.torch_engine import EngineStats
from rollwise.types import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)

_MAX_CONCURRENCY = 4  # generate + abort + a probe or stats call, with one to spare
_START_TIMEOUT_S = 900.0  # an engine worker's start (model load; vLLM's start can take minutes on a GPU node)
# Workers given the same weights compute the same probe: a larger gap means one missed (part of) a sync.
_WORKER_PROBE_TOL = {torch.float32: 1e-4}
_WORKER_PROBE_TOL_LOW_PRECISION = 5e-2


def split_requests(requests: list[GenerationRequest], workers: int) -> list[list[GenerationRequest]]:
    """Requests per worker: the requests of one prompt (equal `prompt_ids`) stay together; groups go, largest
    first, to the worker with the fewest requests so far (ties: lowest index). Order within a worker is the
    call's order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, req in enumerate(requests):
        groups.setdefault(tuple(req.prompt_ids), []).append(index)
    load = [0] * workers
    owner = [0] * len(requests)
    for indices in sorted(groups.values(), key=len, reverse=True):
        k = min(range(workers), key=lambda w: (load[w], w))
        load[k] += len(indices)
        for i in indices:
            owner[i] = k
    shares: list[list[GenerationRequest]] = [[] for _ in range(workers)]
    for index, req in enumerate(requests):
        shares[owner[index]].append(req)
    return shares


def remote_caps(kind: str) -> EngineCaps:
    """What `RemoteEngine` offers over workers of engine `kind`: torch workers take tensors through the object
    store (one ray.put); vLLM workers reload folders and serve LoRA adapters. Every worker probes (the check
    compares them), continues aborted requests, reloads a folder and keeps its RNG state (None for vLLM's)."""
    return EngineCaps(probe_logprobs=True, continue_aborted=True, reload_from=True, rng_state=True,
                      adapters=kind == "vllm", tensors=kind == "torch")


class RemoteEngine:
    """The engine contract over `len(bundles)` engine worker actors in a `Cluster`.

    Args:
        cluster: the run's `Cluster`; its engine bundles host the workers.
        spec: what each worker builds.
        bundles: which engine bundles to use (default: all of them, one worker each).
        own_cluster: close the cluster with this engine (`RemoteEngine.start` does).

    `caps` is `remote_caps(spec.engine)`; the class's own lists every ability some worker kind gives.
    """

    caps = EngineCaps(probe_logprobs=True, continue_aborted=True, adapters=True, reload_from=True, rng_state=True,
                      tensors=True)

    def __init__(self, cluster, spec: EngineSpec, bundles: list[int] | None = None, own_cluster: bool = False,
                 start_timeout_s: float = _START_TIMEOUT_S):
        import ray

        self.cluster = cluster
        self.spec = spec
        self.own_cluster = own_cluster
        self.stats = EngineStats()  # summed over the workers' calls; `reset()` here as on a local engine
        self.closed = False
        self._lock = threading.Lock()
        self._owner: dict[int, int] = {}  # request id -> worker, while its result has not arrived
        self._early_aborts: set[int] = set()  # aborted before the call that runs them
        actor_cls = ray.remote(max_concurrency=_MAX_CONCURRENCY)(EngineWorker)
        bundles = list(range(cluster.engine_workers)) if bundles is None else list(bundles)
        self.labels = [f"engine worker {k}" for k in range(len(bundles))]
        self.actors = []
        for k, bundle in enumerate(bundles):
            actor = actor_cls.options(scheduling_strategy=cluster.engine_strategy(bundle),
                                      max_restarts=0, **cluster.actor_options()).remote(spec, k)
            cluster.track(self.labels[k], actor)
            self.actors.append(actor)
        infos = self._all(lambda a: a.info.remote(), timeout_s=start_timeout_s)
        self.infos = infos
        self.dtype = infos[0]["dtype"]
        self.device = torch.device(infos[0]["device"])
        self._version = infos[0]["version"]
        self.caps = remote_caps(spec.engine)
        self.model_dir = Path(spec.model_dir)  # reload_from: config files next to synced weights
        self.sync_dir = None  # the Sync stage gives the folder

    @classmethod
    def start(cls, cfg, model_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
              log_dir: str | Path | None = None) -> "RemoteEngine":
        """A cluster for `cfg` (`[cluster]`, `train.world_size`) and `cfg.cluster.engine_workers` workers of
        `cfg.rollout.engine` on the HF folder `model_dir` (its tokenizer too; `tokenizer` is not shipped: the
        workers load their own). The engine owns the cluster: `close()` shuts both down; the trainer ranks use
        `engine.cluster`. Ray's logs are linked from `log_dir/ray-logs` (default: the run folder)."""
        from rollwise.cluster.placement import Cluster

        model_dir = Path(model_dir)
        if log_dir is None:  # the run folder: model_dir is RUN/sync/initial (generate.factory)
            log_dir = model_dir.parents[1] if model_dir.parent.name == "sync" else model_dir.parent
        cluster = Cluster(cfg.cluster, cfg.train.world_size, log_dir=log_dir)
        try:
            spec = engine_spec(cfg, model_dir, dtype, sync_dir=model_dir.parent / "workers")
            return cls(cluster, spec, own_cluster=True)
        except BaseException:
            cluster.close()
            raise

    # -- the engine contract ------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self._version

    @version.setter
    def version(self, value: int) -> None:  # a resumed run tags the engines with the checkpoint's version
        self._all(lambda a: a.set_version.remote(value))
        self._version = value

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        """Run the requests on the workers; results in request order, `on_finish(result)` here as each arrives
        (it may call `abort`)."""
        import ray

        if not requests:
            return []
        self._check_open()
        shares = split_requests(requests, len(self.actors))
        streams: dict[Any, int] = {}
        with self._lock:
            for k, share in enumerate(shares):
                for req in share:
                    self._owner[req.request_id] = k
            early = [[r.request_id for r in share if r.request_id in self._early_aborts] for share in shares]
            self._early_aborts.difference_update(r.request_id for r in requests)
        results: dict[int, GenerationResult] = {}
        try:
            for k, share in enumerate(shares):
                if share:
                    gen = self.actors[k].generate_stream.options(num_returns="streaming").remote(share, early[k])
                    streams[gen] = k
            while streams:
                ready, _ = ray.wait(list(streams), num_returns=1)
                for gen in ready:
                    self._receive(gen, streams, results, on_finish)
        except BaseException:
            self._abort_running()  # the other workers stop at their next token
            raise
        finally:
            with self._lock:
                for req in requests:
                    self._owner.pop(req.request_id, None)
        return [results[r.request_id] for r in requests]

    def _receive(self, gen, streams: dict, results: dict, on_finish) -> None:
        import ray

        k = streams[gen]
        try:
            kind, payload = ray.get(next(gen))
        except StopIteration:
            del streams[gen]
            return
        except ray.exceptions.RayError as err:
            raise worker_error(self.labels[k], err) from err
        if kind == "done":
            for key, value in payload.items():
                if hasattr(self.stats, key):
                    setattr(self.stats, key, getattr(self.stats, key) + value)
            return
        for result in payload:
            with self._lock:
                self._owner.pop(result.request_id, None)
            results[result.request_id] = result
            if on_finish is not None:
                on_finish(result)

    def abort(self, request_ids: list[int]) -> None:
        """Forward to the workers running these requests; ids not running yet are aborted when they start."""
        per_worker: dict[int, list[int]] = {}
        with self._lock:
            for rid in request_ids:
                k = self._owner.get(rid)
                if k is None:
                    self._early_aborts.add(rid)
                else:
                    per_worker.setdefault(k, []).append(rid)
        for k, ids in per_worker.items():
            self.actors[k].abort.remote(ids)  # served while the worker's generate runs (threaded actor)

    def _abort_running(self) -> None:
        with self._lock:
            per_worker: dict[int, list[int]] = {}
            for rid, k in self._owner.items():
                per_worker.setdefault(k, []).append(rid)
        for k, ids in per_worker.items():
            try:
                self.actors[k].abort.remote(ids)
            except Exception:  # a dead worker: nothing to stop
                pass

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Put the weights in Ray's object store once; every worker loads them as `version`."""
        import ray

        self._check_open()
        state = {name: t.detach().to("cpu") for name, t in state_dict.items()}
        ref = ray.put(state)
        self._version = None  # unknown until every worker has them
        self._all(lambda a: a.update_weights.remote(ref, version))
        self._version = version

    def reload_from(self, path: str | Path, version: int) -> None:
        """Every worker reloads the safetensors folder `path` (a filesystem every node sees) as `version`."""
        self._check_open()
        self._version = None
        self._all(lambda a: a.reload_from.remote(str(path), version))
        self._version = version

    def update_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Every worker samples later calls with the PEFT adapter in `adapter_dir` (vLLM workers only)."""
        if not self.caps.adapters:
            raise ValueError(f"{self.spec.engine} engine workers do not serve LoRA adapters; sync merged weights")
        self._check_open()
        self._version = None
        self._all(lambda a: a.update_adapter.remote(str(adapter_dir), version))
        self._version = version

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Worker 0's probe log-probs (see the engine contract); every worker is probed and a worker that
        disagrees with worker 0 (it missed part of a sync) is an error."""
        probes = self._all(lambda a: a.probe_logprobs.remote(list(token_ids)))
        tol = _WORKER_PROBE_TOL.get(self.dtype, _WORKER_PROBE_TOL_LOW_PRECISION)
        for k, probe in enumerate(probes[1:], start=1):
            gap = max((abs(a - b) for a, b in zip(probe, probes[0], strict=True)), default=0.0)
            if not gap <= tol:
                raise RuntimeError(f"{self.labels[k]} and {self.labels[0]} disagree on the probe log-probs by "
                                   f"{gap:.3g} (> {tol:g}) at version {self._version}: one of them did not load "
                                   "the last weight sync")
        return probes[0]

    def rng_state(self) -> list:
        """The list of the workers' sampling-generator states, in worker order (None for a worker whose engine
        keeps none: vLLM); `set_rng_state` restores them."""
        return self._all(lambda a: a.rng_state.remote())

    def set_rng_state(self, states: list) -> None:
        if len(states) != len(self.actors):
            raise ValueError(f"{len(states)} engine generator states for {len(self.actors)} engine workers: "
                             "resume with the same cluster.engine_workers")
        self._all_indexed(lambda k, a: a.set_rng_state.remote(states[k]))

    def close(self) -> None:
        """Close the engines, kill the actors (and the cluster when this engine owns it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        import ray

        try:
            if ray.is_initialized():
                refs = [a.close.remote() for a in self.actors]
                ray.wait(refs, num_returns=len(refs), timeout=30.0)
                for actor in self.actors:
                    ray.kill(actor, no_restart=True)
        except Exception as exc:  # dead workers: nothing to close
            logger.warning("closing the engine workers: %s", exc)
        finally:
            if self.own_cluster:
                self.cluster.close()

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RemoteEngine is closed (its engine workers were shut down)")

    def _all(self, call, timeout_s: float | None = None) -> list:
        return self._all_indexed(lambda k, a: call(a), timeout_s)

    def _all_indexed(self, call, timeout_s: float | None = None) -> list:
        """`call(k, actor)` on every worker at once; their values in worker order, or the first failure as a
        `WorkerError` naming the worker."""
        import ray

        refs = [call(k, a) for k, a in enumerate(self.actors)]
        values = []
        for k, ref in enumerate(refs):
            try:
                values.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError as err:
                raise WorkerError(self.labels[k], f"{self.labels[k]} did not answer in {timeout_s:.0f} s "
                                  "(see the Ray logs in the run folder's ray-logs)") from err
            except ray.exceptions.RayError as err:
                raise worker_error(self.labels[k], err) from err
        return values


def engine_spec(cfg, model_dir: str | Path, dtype: torch.dtype, sync_dir: str | Path | None = None) -> EngineSpec:
    """The `EngineSpec` of a run's config (`rollout.engine`, `rollout.engine_options`, `rollout.max_batch_size`,
    `train.seed`) on the HF folder `model_dir`."""
    from rollwise.generate.factory import engine_options, max_model_len

    vllm = cfg.rollout.engine == "vllm"
    return EngineSpec(engine=cfg.rollout.engine, model_dir=str(model_dir), tokenizer_dir=str(model_dir),
                      dtype=dtype, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed,
                      options=engine_options(cfg), max_model_len=max_model_len(cfg) if vllm else None,
                      sync_dir=str(sync_dir) if vllm and sync_dir is not None else None)
