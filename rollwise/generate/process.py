"""A `TorchEngine` in its own OS process, for asynchronous training (generation overlaps the trainer's step).

The child is started with the 'spawn' method, so it has its own interpreter, its own torch threads and its own
copy of the weights; nothing about the parent's model is read from disk:

- the model is rebuilt from `model.config` (and `generation_config`, which decides the EOS ids) with
  `AutoModelForCausalLM.from_config`, the tokenizer is pickled;
- the weights travel through ONE flat shared-memory buffer `[total_params]` in the engine dtype, allocated once
  and handed to the child at spawn. `push_weights` copies the trainer's parameters into it under a
  multiprocessing lock and bumps a shared version counter; the child copies the buffer into its engine
  between tickets when the counter moved. Weights never go through a queue.

Work is sent as tickets (a list of `GenerationRequest`) on a request queue and handled FIFO; each finished
ticket comes back as a `TicketResult` on a result queue. A ticket may wait for a minimum weight version.
Multi-turn episodes run in the child too (`episodes=`: a recipe the child builds its environment from, e.g.
`rollwise.rollout.EpisodeRecipe`): an `EpisodeJob` ticket carries groups and comes back with their episodes,
so environment steps and their tools run beside the child's engine, not in the trainer's process.

Shutdown: the parent owns it (`close`, the context manager, an atexit hook). The child ignores SIGINT (a Ctrl-C
in a terminal reaches the whole process group), exits by itself when the parent dies (a watchdog thread), and
reports any exception as ("error", traceback) before exiting non-zero.

Scripts that create a `GenerationProcess` must guard their entry point with `if __name__ == "__main__":`
(spawn re-imports the main module).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import itertools
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as tmp

from rollwise.errors import UserError
from rollwise.types import GenerationRequest, GenerationResult

_POLL_S = 0.05  # queue polls (liveness, stop event)
_VERSION_POLL_S = 0.005  # wait for a minimum weight version
_WATCHDOG_S = 1.0  # how often the child checks that its parent is alive

Layout = list[tuple[str, int, tuple[int, ...]]]  # (name, offset in the flat buffer, shape)


class GenerationProcessError(RuntimeError):
    """The generation child failed or died; the message carries its traceback or exit code."""


class GenerationSetupError(UserError, GenerationProcessError):
    """The child could not build what the run asked of it (e.g. its environment): one line saying what."""


@dataclass
class TicketResult:
    """One finished ticket: results in request order, the weight version used, engine stats, the child's own
    generation seconds and torch threads (what the rollout MFU is measured over and against)."""

    ticket: int
    results: list[GenerationResult]
    version: int
    stats: dict[str, Any]
    generate_s: float
    threads: int = 0
    groups: list | None = None  # an EpisodeJob's groups, their samples run as episodes
    job_stats: Any = None  # an EpisodeJob's GenerateStats


@dataclass
class EpisodeJob:
    """A ticket of episodes: every unfinished sample of `groups` (rollwise.types.Group) runs as an episode with
    `params`, by the runner the child built from its `episodes` recipe."""

    groups: list
    params: Any


@dataclass
class _ChildSpec:
    """Everything (picklable) the child needs to rebuild the engine."""

    config: Any
    generation_config: Any
    tokenizer: Any
    buffers: dict[str, torch.Tensor]
    layout: Layout
    dtype: torch.dtype
    max_batch_size: int
    seed: int
    threads: int
    device: str
    episodes: Any = None  # a recipe with `build(tokenizer)` -> an object with `run(engine, groups, params, ids)`


# -- the shared weight buffer ----------------------------------------------------------------------------
def weight_layout(model) -> tuple[Layout, dict[str, str]]:
    """Offsets of the model's (deduplicated) parameters in one flat buffer, and aliases of tied parameters
    (e.g. 'lm_head.weight' -> 'model.embed_tokens.weight')."""
    layout, offset, canonical = [], 0, {}
    for name, param in model.named_parameters():
        layout.append((name, offset, tuple(param.shape)))
        canonical[id(param)] = name
        offset += param.numel()
    aliases = {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != name}
    return layout, aliases


def weight_views(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Named views into the flat buffer [total] (no copies)."""
    return {name: flat[offset : offset + _numel(shape)].view(shape) for name, offset, shape in layout}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _copy_plan(views: dict[str, torch.Tensor], aliases: dict[str, str], state: dict[str, torch.Tensor]):
    """Validate `state` against the buffer before touching it: [(view, tensor)], one entry per buffer slot."""
    plan: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    unknown = [n for n in state if n not in views and n not in aliases]
    if unknown:
        raise KeyError(f"push_weights: unknown parameter names {unknown[:5]}"
                       f"{' ...' if len(unknown) > 5 else ''} (expected names like {next(iter(views))!r})")
    for name, tensor in state.items():
        target = aliases.get(name, name)
        if target in plan and name != target:
            continue  # a tied alias of a slot already being written
        if tuple(tensor.shape) != tuple(views[target].shape):
            raise ValueError(f"push_weights: {name!r} has shape {tuple(tensor.shape)}, "
                             f"the engine expects {tuple(views[target].shape)}")
        plan[target] = (views[target], tensor)
    return list(plan.values())


# -- parent side -----------------------------------------------------------------------------------------
class GenerationProcess:
    """A TorchEngine in a spawned child process (torch.multiprocessing, 'spawn' context).

    Args:
        model: the policy (its config, generation config, parameters and buffers are sent; it is not modified).
        tokenizer: a picklable (HF) tokenizer.
        dtype, max_batch_size, seed: passed to the child's `TorchEngine`.
        threads: torch intra-op threads of the child (0 = physical cores).
        device: where the child's engine runs (the shared buffer stays in CPU shared memory).
        start_timeout_s: how long to wait for the child to report ready.
        version: the policy version of `model`'s current weights (e.g. the step a run resumes from).
        episodes: a picklable recipe (`build(tokenizer)` -> a runner with `run(engine, groups, params, ids)`)
            that the child builds before it reports ready (so a failure to build stops the start), for
            `submit_episodes`.
    """

    def __init__(self, model, tokenizer, *, dtype: torch.dtype = torch.float32, max_batch_size: int = 64,
                 seed: int = 0, threads: int = 1, device: str = "cpu", start_timeout_s: float = 300.0,
                 version: int = 0, episodes: Any = None):
        ctx = tmp.get_context("spawn")
        layout, self._aliases = weight_layout(model)
        total = sum(_numel(shape) for _, _, shape in layout)
        self._flat = torch.empty(total, dtype=dtype).share_memory_()  # [total], one shared storage
        self._views = weight_views(self._flat, layout)
        self._lock = ctx.Lock()
        self._shared_version = ctx.Value("q", version, lock=False)  # guarded by self._lock
        self._stop = ctx.Event()
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        self.version = version
        self.episodes = episodes
        self.pid = -1
        self._pending = 0
        self._closed = False
        with torch.no_grad():
            for view, tensor in _copy_plan(self._views, self._aliases, dict(model.named_parameters())):
                view.copy_(tensor.detach())
        config = copy.deepcopy(model.config)  # the trainer may have switched the policy to its own attention
        config._attn_implementation = "sdpa"  # the engine's prefill and fallback decode use plain masks
        spec = _ChildSpec(config, getattr(model, "generation_config", None), tokenizer,
                          {n: b.detach().cpu() for n, b in model.named_buffers()}, layout, dtype,
                          max_batch_size, seed, threads, str(device), episodes)
        self._process = ctx.Process(target=_child_main, name="rollwise-generate", daemon=True,
                                    args=(spec, self._flat, self._lock, self._shared_version, self._stop,
                                          self._requests, self._results))
        # GC and exit both shut the child down; the explicit atexit hook runs before multiprocessing's own
        # (registered earlier, atexit is LIFO), which would otherwise join the queues' feeder threads first.
        self._finalizer = weakref.finalize(self, _shutdown, self._process, self._stop, self._requests,
                                           self._results, 10.0)
        atexit.register(self._finalizer)
        try:
            self._process.start()
            self.pid = self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pending(self) -> int:
        """Tickets submitted and not yet received."""
        return self._pending

    def push_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy parameters (names -> tensors, any device/dtype, like `model.named_parameters()`; a subset is
        fine) into the shared buffer and publish `version`. Tickets started afterwards use them."""
        self._check_open()
        if version <= self.version:
            raise ValueError(f"push_weights: version {version} must be greater than the current {self.version}")
        plan = _copy_plan(self._views, self._aliases, dict(state))
        while not self._lock.acquire(timeout=_POLL_S):  # a dead child could hold the lock forever
            self._raise_if_dead()
        try:
            with torch.no_grad():
                for view, tensor in plan:
                    view.copy_(tensor.detach())
            self._shared_version.value = version
        finally:
            self._lock.release()
        self.version = version

    def submit(self, ticket: int, requests: list[GenerationRequest], min_version: int = 0) -> None:
        """Queue a ticket; the child starts it (FIFO) once the pushed version is >= `min_version`."""
        self._check_open()
        self._raise_if_dead()
        self._requests.put((ticket, list(requests), int(min_version)))
        self._pending += 1

    def submit_episodes(self, ticket: int, groups: list, params, min_version: int = 0) -> None:
        """Queue a ticket of episodes (see `EpisodeJob`); the process must have been started with `episodes`."""
        if self.episodes is None:
            raise ValueError("submit_episodes: this generation process was started without episodes=")
        self._check_open()
        self._raise_if_dead()
        self._requests.put((ticket, EpisodeJob(groups, params), int(min_version)))
        self._pending += 1

    def receive(self, timeout: float | None = None) -> TicketResult:
        """Block for the next finished ticket (FIFO). Raises TimeoutError after `timeout` seconds, and
        GenerationProcessError (with the child's traceback) when the child failed or died."""
        self._check_open()
        if self._pending == 0:
            raise RuntimeError("receive: no ticket pending (it would block forever)")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                message = self._results.get(timeout=left)
            except queue.Empty:
                self._raise_if_dead()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no ticket finished within {timeout} s") from None
                continue
            if message[0] != "result":
                self._fail(message)
            self._pending -= 1
            return TicketResult(*message[1:])

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child and release the queues (idempotent). Afterwards the child process is gone."""
        self._closed = True
        detached = self._finalizer.detach()
        atexit.unregister(self._finalizer)
        if detached is not None:
            _, func, args, _ = detached
            func(*args[:-1], timeout)

    def __enter__(self) -> GenerationProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise GenerationProcessError("the generation process is closed")

    def _wait_ready(self, timeout: float) -> int:
        """Wait for ("ready", pid) from the child; returns its pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._raise_if_dead()
                continue
            if message[0] == "ready":
                return message[1]
            self._fail(message)
        raise GenerationProcessError(f"the generation process did not start within {timeout} s")

    def _raise_if_dead(self) -> None:
        """Raise GenerationProcessError if the child exited (with its error message when it sent one)."""
        if self._process.exitcode is None:
            return
        try:  # an error message may still be in the pipe
            message = self._results.get(timeout=1.0)
        except (queue.Empty, OSError, EOFError, ValueError):
            message = None
        if message is not None and message[0] in ("error", "user_error"):
            self._fail(message)
        code = self._process.exitcode
        self.close()
        how = f" ({signal.Signals(-code).name})" if code < 0 else ""
        raise GenerationProcessError(f"the generation process (pid {self._process.pid}) died with exit code "
                                     f"{code}{how}")

    def _fail(self, message: tuple) -> None:
        """The child sent ("error", traceback): reap it and raise."""
        self.close()
        kind, text = message[0], message[1] if len(message) > 1 else ""
        if kind == "user_error":
            raise GenerationSetupError(f"in the generation process: {text}")
        if kind != "error":
            text = f"unexpected message {message!r}"
        raise GenerationProcessError(f"the generation process failed:\n{text}")


def _shutdown(process, stop, requests, results, timeout: float) -> None:
    """Stop the child (event + sentinel, then terminate, then kill), reap it, release the queues."""
    stop.set()
    try:
        requests.put(None)
    except (ValueError, OSError):
        pass
    if process.pid is not None:  # started
        deadline = time.monotonic() + timeout
        while process.is_alive() and time.monotonic() < deadline:
            _drain(results, _POLL_S)  # the child's feeder thread must flush before it can exit
        for stop_it in (process.terminate, process.kill):
            if process.is_alive():
                stop_it()
                process.join(5.0)
    _drain(requests, _POLL_S)  # nobody reads them any more; a full pipe would block our feeder thread
    for q in (requests, results):
        q.close()
        q.join_thread()


def _drain(q, wait: float) -> None:
    """Read and drop what is in a queue until it stays empty for `wait` seconds."""
    try:
        while True:
            q.get(timeout=wait)
    except (queue.Empty, OSError, EOFError, ValueError):
        pass


# -- child side ------------------------------------------------------------------------------------------
def _child_main(spec: _ChildSpec, flat, lock, version, stop, requests, results) -> None:
    """Entry point of the spawned child: build the engine, report ready, serve tickets until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the parent owns shutdown
    try:
        _exit_when_parent_dies()
        engine, views = _build_engine(spec, flat, lock, version)
        runner = spec.episodes.build(spec.tokenizer) if spec.episodes is not None else None
        if spec.device == "cpu":  # cache the matmul peak of these threads and dtype (the rollout MFU's), idle
            from rollwise.perf import matmul_peak_gflops

            matmul_peak_gflops(spec.dtype)
        results.put(("ready", os.getpid()))
        _serve(engine, runner, views, lock, version, stop, requests, results)
    except UserError as exc:  # e.g. the environment cannot be built here: one line, what to change
        results.put(("user_error", str(exc)))
        raise SystemExit(1)
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise SystemExit(1)  # multiprocessing flushes the result queue, then exits with code 1


def _build_engine(spec: _ChildSpec, flat, lock, version):
    """Rebuild the model from its config, load the shared weights, wrap it in a TorchEngine."""
    from rollwise.generate.torch_engine import TorchEngine
    from rollwise.hardware import configure_threads

    configure_threads(spec.threads)
    model = _empty_model(spec)
    views = weight_views(flat, spec.layout)
    params = dict(model.named_parameters())
    if set(params) != set(views):
        raise RuntimeError(f"the rebuilt model's parameters differ from the parent's: missing "
                           f"{sorted(set(views) - set(params))[:5]}, extra {sorted(set(params) - set(views))[:5]}")
    with torch.no_grad():
        for name, tensor in spec.buffers.items():
            model.get_buffer(name).copy_(tensor)
        with lock:
            for name, param in params.items():
                param.copy_(views[name])
            loaded = version.value
    engine = TorchEngine(model.to(spec.device), spec.tokenizer, spec.dtype, spec.max_batch_size, spec.seed)
    engine.version = loaded
    return engine, views


def _empty_model(spec: _ChildSpec):
    """The architecture of `spec.config` in the engine dtype, weights left uninitialised where possible
    (they are overwritten from the shared buffer)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: pay for the random init
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(spec.config, dtype=spec.dtype)
    model.tie_weights()  # skipped together with the init
    if spec.generation_config is not None:
        model.generation_config = spec.generation_config
    return model


def _serve(engine, runner, views, lock, version, stop, requests, results) -> None:
    """Handle tickets FIFO until the sentinel, the stop event or the parent's death; episode tickets with
    `runner` (its request ids count on across tickets)."""
    ids = itertools.count()
    while not stop.is_set() and _parent_alive():
        try:
            item = requests.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if item is None:
            return
        ticket, reqs, min_version = item
        if not _wait_for_version(version, min_version, stop):
            return
        with lock:
            if version.value > engine.version:
                engine.update_weights(views, version.value)
        engine.stats.reset()
        start = time.perf_counter()
        if isinstance(reqs, EpisodeJob):
            job_stats = runner.run(engine, reqs.groups, reqs.params, ids)
            out, groups = [], reqs.groups
        else:
            out, groups, job_stats = engine.generate(reqs), None, None
        seconds = time.perf_counter() - start
        results.put(("result", ticket, out, engine.version, dataclasses.asdict(engine.stats), seconds,
                     torch.get_num_threads(), groups, job_stats))


def _wait_for_version(version, min_version: int, stop) -> bool:
    """Poll until the shared version reaches `min_version`; False if asked to stop (or orphaned) first."""
    while version.value < min_version:
        if stop.is_set() or not _parent_alive():
            return False
        time.sleep(_VERSION_POLL_S)
    return True


def _parent_alive() -> bool:
    """The parent still runs: we were not re-parented and its sentinel pipe is not closed."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is None or (os.getppid() == parent.pid and parent.is_alive())


def _exit_when_parent_dies() -> None:
    """Start a daemon thread that ends this process (even mid-generation) once the parent is gone."""
    import multiprocessing

    def watch() -> None:
        parent = multiprocessing.parent_process()
        while _parent_alive():
            if parent is not None:
                parent.join(_WATCHDOG_S)  # returns early when the parent's sentinel closes
            else:
                time.sleep(_WATCHDOG_S)
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
