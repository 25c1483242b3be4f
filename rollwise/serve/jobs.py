"""The server's one engine thread: a bounded queue of completions, episode jobs and weight updates.

The engine is not thread-safe, so one `Worker` thread owns it. HTTP handlers put work on the queue and wait
for a future (completions, weights) or poll a job (episodes):

- consecutive completion requests are batched into ONE `engine.generate` call (continuous batching across
  HTTP requests); two requests with the same seeded sampling params go to different calls, because the torch
  engine gives each distinct seeded params one generator and sharing it would change both samples;
- an episode job (ProRL Agent style: env + prompts -> trajectories) runs `rollwise.envs.episode.run_episodes`
  between completion batches; it is kept `episode_ttl_s` after it ends, whether or not its client is still
  connected, and a job that fails says why (`error`);
- a weight update loads between batches, so no generate call ever mixes two policies.

At most `max_queued` completions and jobs wait; one more raises `QueueFull` (HTTP 503). Weight updates are
never refused.

Nothing on the queue can stop the worker: a future whose waiter is gone (the HTTP handler was cancelled, the
client disconnected) is skipped or left alone, and an exception while running one item fails that item only.
Only a failure below `Exception` (`BaseException`: the interpreter is being torn down, a C extension raised
`SystemExit`) ends the thread; then `dead` holds its one-line reason, every queued and later request fails with
`WorkerDead`, and `/health` answers 503.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from rollwise.errors import one_line
from rollwise.generate.base import EngineCaps
from rollwise.types import GenerationRequest, GenerationResult, Group, Status


class QueueFull(RuntimeError):
    """The work queue holds `max_queued` items; the client should retry later (HTTP 503)."""


class ServerStopped(RuntimeError):
    """The worker stopped before this work ran."""


class WorkerDead(ServerStopped):
    """The engine thread died (see `Worker.dead`); the server answers 503 until it is restarted."""


def resolve(future: Future, result=None, error: BaseException | None = None) -> bool:
    """Set `future`'s result (or `error`) unless it is already done or cancelled: its waiter may be gone (an
    HTTP handler cancelled, a client that disconnected). Returns whether the value was set."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


@dataclass(eq=False)
class Completion:
    """One HTTP completion request: its engine requests (ids assigned by the worker) and the future the handler
    awaits, resolved to `(results in request order, policy version)`."""

    requests: list[GenerationRequest]
    future: Future = field(default_factory=Future)
    started: bool = False  # the worker assigned its request ids and runs it (set under the worker's lock)


@dataclass(eq=False)
class WeightUpdate:
    """New policy weights (parameter name -> tensor) to load as `version` between batches."""

    state: dict
    version: int
    future: Future = field(default_factory=Future)


@dataclass(eq=False)
class EpisodeJob:
    """A batch of episodes: `groups` (one per prompt) run in `env`; `status` queued|running|done|failed|cancelled.

    `episodes` holds the JSON records (`episode_record`) once done. Times are `time.time()` seconds."""

    env_name: str
    env: Any
    codec: Any
    groups: list[Group]
    params: Any
    max_episode_tokens: int
    id: str = field(default_factory=lambda: f"ep-{uuid.uuid4().hex}")
    status: str = "queued"
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    policy_version: int | None = None
    episodes: list[dict] | None = None
    cancel_requested: bool = False
    inflight: set[int] = field(default_factory=set)  # engine request ids of the running turn (for cancel)

    def summary(self) -> dict:
        """The job's JSON state (with `episodes` when done)."""
        now = time.time()
        queued_s = (self.started_at or self.finished_at or now) - self.created_at
        run_s = ((self.finished_at or now) - self.started_at) if self.started_at else 0.0
        out = {"id": self.id, "object": "episode_job", "env": self.env_name, "status": self.status,
               "created_at": self.created_at, "queued_s": round(queued_s, 6), "run_s": round(run_s, 6),
               "episodes_total": sum(len(g.samples) for g in self.groups), "policy_version": self.policy_version}
        if self.error is not None:
            out["error"] = self.error
        if self.status == "done":
            out["episodes"] = self.episodes
        return out


class JobCancelled(Exception):
    """Raised into `run_episodes` at the next turn of a cancelled job (aborted samples would be retried)."""


class _CancellableEngine:
    """The worker's engine as one episode job sees it: records the request ids in flight, so `cancel` can
    abort the turn that runs; the next turn of a cancelled job raises JobCancelled instead of starting.
    A view for `run_episodes` (generate, abort, version): no optional ability but continuing aborted requests."""

    caps = EngineCaps()

    def __init__(self, engine, job: EpisodeJob):
        self.engine = engine
        self.job = job
        self.version = engine.version
        self.caps = EngineCaps(continue_aborted=engine.caps.continue_aborted)

    def generate(self, requests, on_finish=None):
        if self.job.cancel_requested:
            raise JobCancelled(self.job.id)
        ids = [r.request_id for r in requests]
        self.job.inflight = set(ids)
        if self.job.cancel_requested:  # cancelled between the check and publishing the ids
            self.engine.abort(ids)
        try:
            return self.engine.generate(requests, on_finish=on_finish)
        finally:
            self.job.inflight = set()

    def abort(self, request_ids):
        self.engine.abort(request_ids)


class Worker:
    """Owns `engine`; runs queued work in a daemon thread (see the module docstring).

    Args:
        engine: any rollwise engine (`generate`, `update_weights`, `abort`, `version`).
        tokenizer: the engine's tokenizer (text of results).
        max_queued: completions + episode jobs waiting at most (`serve.max_queued_requests`).
        episode_ttl_s: finished episode jobs are kept this long (`serve.episode_ttl_s`).
        max_batch_requests: engine requests in one generate call at most.
    """

    def __init__(self, engine, tokenizer, max_queued: int = 256, episode_ttl_s: float = 3600.0,
                 max_batch_requests: int = 1024):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queued = max_queued
        self.episode_ttl_s = episode_ttl_s
        self.max_batch_requests = max_batch_requests
        self.jobs: dict[str, EpisodeJob] = {}
        self.running: EpisodeJob | None = None
        self.counters = {"completions": 0, "episode_jobs": 0, "generate_calls": 0, "weight_updates": 0,
                         "abandoned": 0, "failed_items": 0}
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._ids = count()
        self._closing = False
        self._inflight_ids: list[int] = []
        self.dead: str | None = None  # why the engine thread died (one line); None while it runs
        self._running_items: list = []  # what the engine thread runs now (failed too if the thread dies)
        self._thread = threading.Thread(target=self._main, name="rollwise-serve-engine", daemon=True)
        self._thread.start()

    # -- what handlers call (any thread) --------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.engine.version

    def failure(self) -> str | None:
        """Why the engine thread is not running (one line), or None while it runs (and after `close`)."""
        if self.dead is not None:
            return self.dead
        if not self._thread.is_alive() and not self._closing:
            return "the engine thread ended"
        return None

    def queued(self) -> int:
        with self._cond:
            return sum(not isinstance(item, WeightUpdate) for item in self._queue)

    def submit_completion(self, requests: list[GenerationRequest]) -> Completion:
        """Queue one HTTP request's engine requests (their ids are replaced); QueueFull when the queue is full.
        The handler awaits `.future` and calls `abandon` with it when its client goes away."""
        work = Completion(list(requests))
        self._put(work, counted=True)
        return work

    def abandon(self, work: Completion) -> None:
        """The client of `work` went away: a queued completion is dropped, a running one's engine requests are
        aborted (they end with the tokens so far, and the batch's other requests go on)."""
        with self._cond:
            if work.future.done():
                return
            self.counters["abandoned"] += 1
            if not work.started:
                self._queue = deque(item for item in self._queue if item is not work)
                work.future.cancel()
                return
            ids = [r.request_id for r in work.requests]
        self.engine.abort(ids)

    def submit_job(self, job: EpisodeJob) -> EpisodeJob:
        self._put(job, counted=True)
        with self._cond:
            self.jobs[job.id] = job
        return job

    def push_weights(self, state: dict, version: int) -> Future:
        work = WeightUpdate(state, version)
        self._put(work, counted=False)
        return work.future

    def job(self, job_id: str) -> EpisodeJob | None:
        with self._cond:
            self._expire()
            return self.jobs.get(job_id)

    def list_jobs(self) -> list[EpisodeJob]:
        with self._cond:
            self._expire()
            return sorted(self.jobs.values(), key=lambda j: j.created_at)

    def cancel(self, job_id: str) -> EpisodeJob | None:
        """Cancel a queued job at once, or a running one at its next token; a finished job is left as it is."""
        with self._cond:
            job = self.jobs.get(job_id)
            if job is None or job.status not in ("queued", "running"):
                return job
            job.cancel_requested = True
            if job.status == "queued":
                self._queue.remove(job)
                self._finish(job, "cancelled")
                return job
            inflight = list(job.inflight)
        if inflight:
            self.engine.abort(inflight)
        return job

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: queued work fails with ServerStopped, the running batch is aborted, the thread joined."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            pending, self._queue = list(self._queue), deque()
            self._cond.notify_all()
            inflight = list(self._inflight_ids)
            if self.running is not None:
                self.running.cancel_requested = True
                inflight += list(self.running.inflight)
        for item in pending:
            self._fail(item, ServerStopped("the server stopped before this request ran"))
        if inflight:
            self.engine.abort(inflight)
        self._thread.join(timeout_s)

    # -- the engine thread ------------------------------------------------------------------------------------
    def _put(self, work, counted: bool) -> None:
        with self._cond:
            if self.dead is not None:
                raise WorkerDead(f"the engine thread died ({self.dead}); restart `rollwise serve`")
            if self._closing:
                raise ServerStopped("the server is stopping")
            if counted and sum(not isinstance(i, WeightUpdate) for i in self._queue) >= self.max_queued:
                raise QueueFull(f"the server's queue holds serve.max_queued_requests = {self.max_queued} requests; "
                                "retry later or raise the limit")
            self._queue.append(work)
            self._cond.notify()

    def _main(self) -> None:
        """The thread: the loop, and if it dies, why (`dead`), with every waiting item failed."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded: /health and every request say why
            reason = f"{type(exc).__name__}: {one_line(str(exc))}"
            with self._cond:
                self.dead = reason
                pending, self._queue = list(self._queue), deque()
                running = self._running_items
            for item in running + pending:
                self._fail(item, WorkerDead(f"the engine thread died ({reason}); restart `rollwise serve`"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait(timeout=1.0)
                    self._expire()
                if self._closing:
                    return
                batch = self._next_batch()
                self._running_items = batch
            if not batch:
                continue
            try:
                self._run(batch)
            except Exception as exc:  # a bug or an engine failure outside the engine call: these items only
                self.counters["failed_items"] += len(batch)
                for item in batch:
                    self._fail(item, exc)
            with self._cond:
                self._running_items = []

    def _next_batch(self) -> list:
        """The next item(s) to run, taken off the queue (lock held); items whose waiter is gone are skipped."""
        head = self._queue.popleft()
        if isinstance(head, EpisodeJob):
            head.status, head.started_at, self.running = "running", time.time(), head
            return [head]
        batch = [head] + (self._take_batch(head) if isinstance(head, Completion) else [])
        # RUNNING futures cannot be cancelled any more; a cancelled one (its handler is gone) is dropped
        batch = [item for item in batch if item.future.set_running_or_notify_cancel()]
        for work in batch:
            if isinstance(work, Completion):  # ids now, so `abandon` can abort it from here on
                for req in work.requests:
                    req.request_id = next(self._ids)
                work.started = True
        return batch

    def _run(self, batch: list) -> None:
        head = batch[0]
        if isinstance(head, Completion):
            self._run_completions(batch)
        elif isinstance(head, WeightUpdate):
            self._run_weights(head)
        else:
            self._run_job(head)

    def _take_batch(self, head: Completion) -> list[Completion]:
        """The completions queued right after `head` that can share its generate call (lock held)."""
        seeded = {r.params for r in head.requests if r.params.seed is not None}
        size = len(head.requests)
        taken = []
        while self._queue and isinstance(self._queue[0], Completion):
            nxt = self._queue[0]
            params = {r.params for r in nxt.requests if r.params.seed is not None}
            if params & seeded or size + len(nxt.requests) > self.max_batch_requests:
                break
            taken.append(self._queue.popleft())
            seeded |= params
            size += len(nxt.requests)
        return taken

    def _run_completions(self, batch: list[Completion]) -> None:
        requests = [req for work in batch for req in work.requests]
        with self._cond:
            self._inflight_ids = [r.request_id for r in requests]
        try:
            results = {r.request_id: r for r in self.engine.generate(requests)}
        except Exception as exc:  # the engine failed: every request of the batch says why
            for work in batch:
                self._fail(work, exc)
            return
        finally:
            with self._cond:
                self._inflight_ids = []
        self.counters["generate_calls"] += 1
        self.counters["completions"] += len(batch)
        version = self.engine.version
        for work in batch:
            missing = [r.request_id for r in work.requests if r.request_id not in results]
            if missing:
                self._fail(work, RuntimeError(f"the engine returned no result for {len(missing)} of this "
                                              f"request's {len(work.requests)} sequences"))
                continue
            resolve(work.future, ([results[r.request_id] for r in work.requests], version))

    def _run_weights(self, work: WeightUpdate) -> None:
        try:
            self.engine.update_weights(work.state, work.version)
        except Exception as exc:
            resolve(work.future, error=exc)
            return
        self.counters["weight_updates"] += 1
        resolve(work.future, self.engine.version)

    def _run_job(self, job: EpisodeJob) -> None:
        from rollwise.envs.episode import run_episodes

        job.policy_version = self.engine.version
        try:
            run_episodes(_CancellableEngine(self.engine, job), job.groups, job.params, self._ids, job.env,
                         job.codec, max_episode_tokens=job.max_episode_tokens)
            records = None if job.cancel_requested else [episode_record(s, job) for g in job.groups
                                                         for s in g.samples]
        except JobCancelled:
            records = None
        except Exception as exc:  # an engine or environment failure: the job says why
            with self._cond:
                job.error = f"{type(exc).__name__}: {one_line(str(exc))}"
                self._finish(job, "failed")
            return
        with self._cond:
            job.episodes = records
            self.counters["episode_jobs"] += 1
            self._finish(job, "cancelled" if job.cancel_requested else "done")

    def _finish(self, job: EpisodeJob, status: str) -> None:
        """Lock held."""
        job.status, job.finished_at = status, time.time()
        job.inflight = set()
        if self.running is job:
            self.running = None

    def _expire(self) -> None:
        """Forget jobs that ended over `episode_ttl_s` ago (lock held)."""
        limit = time.time() - self.episode_ttl_s
        for key in [k for k, j in self.jobs.items() if j.finished_at is not None and j.finished_at < limit]:
            del self.jobs[key]

    def _fail(self, item, exc: BaseException) -> None:
        if isinstance(item, EpisodeJob):
            with self._cond:
                if item.status in ("queued", "running"):
                    item.error = f"{type(exc).__name__}: {one_line(str(exc))}"
                    self._finish(item, "failed")
        else:
            resolve(item.future, error=exc)


def episode_record(sample, job: EpisodeJob) -> dict:
    """One finished episode as JSON: tokens (prompt and response), loss mask, behaviour and untruncated log-probs,
    version spans, turns, tool calls, transcript, the env's reward parts, how it ended, and timing.

    A non-finite reward part is written as `"nan"`, `"inf"` or `"-inf"` (as in metrics.jsonl): JSON has no NaN,
    and the job must still be served (`merge_episode` turns them back into floats)."""
    from rollwise.envs.episode import transcript
    from rollwise.metrics.sinks import clean_value

    ep = sample.episode
    return {
        "group": sample.group_id,
        "uid": sample.prompt.uid,
        "status": sample.status.value,
        "prompt_ids": list(sample.prompt_ids),
        "response_ids": list(sample.response_ids),
        "loss_mask": list(sample.loss_mask),
        "logprobs": list(sample.behaviour_logprobs),
        "full_logprobs": list(sample.full_logprobs),
        "version_spans": [list(span) for span in sample.version_spans],
        "turns": [list(t) for t in sample.turns],
        "tool_calls": [{"name": c.name, "args": c.args, "turn": c.turn, "result": c.result, "error": c.error,
                        "wall_s": c.wall_s, "sandbox_s": c.sandbox_s} for c in sample.tool_calls],
        "transcript": transcript(sample),
        "final": ep.final_text if ep is not None else sample.response_text,
        "reward_parts": {k: clean_value(v) for k, v in ep.parts.items()} if ep is not None else {},
        "ended_by": ep.ended_by if ep is not None else "",
        "assistant_turns": ep.assistant_turns if ep is not None else 0,
        "parse_failures": ep.parse_failures if ep is not None else 0,
        "retokenize_mismatch": ep.retokenize_mismatch if ep is not None else None,
        "error": ep.error if ep is not None else None,
        "timing": {"queued_s": (job.started_at or job.created_at) - job.created_at,
                   "run_s": time.time() - (job.started_at or time.time()),
                   "tool_s": ep.tool_s if ep is not None else 0.0,
                   "sandbox_s": ep.sandbox_s if ep is not None else 0.0,
                   "env_s": ep.env_s if ep is not None else 0.0},
    }


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish_reason of an engine result: stop (EOS or a stop string), length, or abort."""
    return {Status.COMPLETED: "stop", Status.TRUNCATED: "length"}.get(result.status, "abort")
