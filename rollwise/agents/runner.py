"""Running agent episodes: programs in their own threads (or one event loop for `async def` programs), their
chat calls batched into the run's engine on the calling thread, every call recorded and stitched into samples.

`AgentRunner.run(engine, groups, params, ids)` is the episode seam `rollwise.rollout.Episodes` has, so the
Generate stage (`AgentRollouts`) and evaluation (`rollwise.evaluate`, `episodes=`) both run agent episodes
with it. One `run`:

1. starts one episode per unfinished sample (at most `agent.concurrency` at once), each with its own key;
2. loops on the calling thread: calls arrive from the HTTP thread (`submit`); once every running episode
   waits on the model, or the first waiting call has waited `agent.batch_wait_s`, the waiting calls are
   rendered (bridged where their history extends an earlier call: `rollwise.agents.chat`) and run as one
   `engine.generate`; each is answered as soon as it finishes (`on_finish`), so its program runs its tool
   while the others decode. A call that arrives during a generate call waits for the next one (the torch
   engine's batch is fixed once it starts);
3. ends an episode when its program returns or raises, or at `agent.timeout_s` (counted failed; an `async`
   program is cancelled, a thread cannot be and is left to finish, counted in `agent/hung_programs`);
4. stitches each episode's calls into its sample(s) (`rollwise.agents.calls`) with the program's outcome in
   `Sample.info["agent"]`, which `AgentReward` reads when the Score stage runs.

Calls run with the run's sampling settings (the episode's `params`): a program's temperature, top_p, top_k or
seed are ignored, since the trainer computes log-probs at `rollout.temperature`; `max_tokens` and `stop` are
honoured (capped at `rollout.max_new_tokens`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import queue
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from rollwise.agents.calls import (Call, Episode, Pending, Prepared, clear_sample, copy_for_segment, fill_sample,
                                   stitch)
from rollwise.agents.chat import BadRequest, ChatCodec, completion_body, normalise, parse_tool_calls
from rollwise.agents.program import INFO_KEY, AgentTask, Outcome, is_async, outcome_of
from rollwise.agents.rollouts import AgentRollouts, job_counts
from rollwise.errors import UserError, one_line
from rollwise.generate.groups import FINAL, GenerateStats, is_complete
from rollwise.types import GenerationRequest, GenerationResult, Group, Sample, SamplingParams, Status


class AgentStall(UserError, RuntimeError):
    """Agent programs keep running long past `agent.timeout_s`: their threads cannot be stopped."""


class AgentRunner:
    """Runs the episodes of `program` (see the module docstring). `settings` is the `[agent]` section;
    `system_prompt` (`data.system_prompt`) heads each task's messages; `max_new_tokens` caps one call."""

    def __init__(self, program, tokenizer, settings, system_prompt: str | None, max_new_tokens: int,
                 model_name: str = "rollwise") -> None:
        self.program = program
        self.codec = ChatCodec(tokenizer)
        self.settings = settings
        self.system_prompt = system_prompt
        self.max_new_tokens = max_new_tokens
        self.model_name = model_name
        self.run_key = "rw-agent-" + secrets.token_urlsafe(18)
        self.is_async = is_async(program)
        self._live: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._queued: list[Pending] = []
        self._generated_at = 0.0  # when the last engine call ended
        self._server = None
        self._http = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hung: list[threading.Thread] = []
        self._warned: set[str] = set()
        self._replies = itertools.count()
        self.url = ""

    def rollouts(self, engine) -> AgentRollouts:
        """The Generate stage of a run whose episodes these are (`rollwise.build`)."""
        return AgentRollouts(engine, self)

    # -- the HTTP thread ------------------------------------------------------------------------------------
    def known(self, token: str) -> bool:
        """Whether `token` may call at all (a running episode's key, or the run's key): the endpoint asks this
        before it reads a request's body."""
        if token and secrets.compare_digest(token.encode(), self.run_key.encode()):
            return True
        with self._lock:
            return token in self._live

    def submit(self, token: str, model: str, session: str, body: Any) -> Future:
        """Queue a call for the episode `token` (or `model`, with the run's key) names; a Future of
        (HTTP status, JSON)."""
        from rollwise.agents.server import UNKNOWN_KEY

        future: Future = Future()
        with self._lock:
            episode = self._live.get(token)
            if episode is None and token and secrets.compare_digest(token.encode(), self.run_key.encode()):
                episode = self._live.get(model)
        if episode is None:
            future.set_result((401, {"message": UNKNOWN_KEY}))
        elif episode.done:
            future.set_result((410, {"message": f"this episode is over ({episode.ended_by})"}))
        else:
            self._inbox.put(("call", Pending(episode, session, body, future, time.monotonic())))
        return future

    # -- services -------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """The loopback endpoint, the event loop (async programs) and the program's own `start`, once."""
        if self._server is not None:
            return
        import httpx

        from rollwise.agents.server import LoopbackServer, create_app

        self._server = LoopbackServer(create_app(self.submit, self.model_name, self.known,
                                                 self.settings.max_body_mb))
        self.url = self._server.url
        limits = httpx.Limits(max_connections=2 * self.settings.concurrency, max_keepalive_connections=None)
        if self.is_async:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="rollwise-agent-loop", daemon=True).start()
            self._http = self._on_loop(_async_client(limits, self.settings.timeout_s))
        else:
            self._http = httpx.Client(limits=limits, timeout=self.settings.timeout_s)
        start = getattr(self.program, "start", None)  # e.g. a verifiers environment brings up its servers
        if start is not None:
            started = start(self.url, self.run_key)
            if inspect.iscoroutine(started):
                self._on_loop(started)

    def _on_loop(self, coroutine, timeout_s: float | None = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def close(self) -> None:
        stop = getattr(self.program, "close", None)
        if stop is not None and self._server is not None:
            try:
                stopped = stop()
                if inspect.iscoroutine(stopped):
                    self._on_loop(stopped)
            except Exception as exc:  # noqa: BLE001 - closing must go on
                print(f"rollwise agents: closing the program failed: {type(exc).__name__}: {exc}", flush=True)
        if self._http is not None:
            closed = self._http.aclose() if self.is_async else self._http.close()
            if inspect.iscoroutine(closed):
                self._on_loop(closed)
            self._http = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    # -- one job --------------------------------------------------------------------------------------------
    def run(self, engine, groups: list[Group], params: SamplingParams, ids, stop=None,
            totals: Counter | None = None, split: bool = False) -> GenerateStats:
        """Run an episode for every unfinished sample of `groups` (in place). An episode whose calls stitch
        into several segments fills its sample with the last one (the final answer's: evaluation), or with
        `split` (training) adds one sample per further segment to its group. `totals` adds this job's counters
        (`AgentRollouts` reports them as `agent/*`)."""
        if stop is not None:
            raise ValueError("agent episodes run whole: control.partial_rollouts is not supported with agents")
        self._check_hung()
        self._start()
        episodes = [self._episode(g, s, i, params) for g in groups for i, s in enumerate(list(g.samples))
                    if s.status not in FINAL]
        waiting, running, prepared = list(reversed(episodes)), {}, {}
        try:
            if engine.caps.request_feed:  # one engine call; calls join it as they come (continuous batching)
                engine.generate([], on_finish=lambda result: self._finished(prepared, result),
                                feed=_CallFeed(self, engine, waiting, running, prepared, ids))
            else:  # rounds: the calls waiting when an engine call ends make the next one
                while waiting or running:
                    self._launch_some(waiting, running)
                    batch = self._gather(running, bool(waiting))
                    if batch:
                        self._generate(engine, batch, ids, prepared)
        finally:
            for episode in episodes:
                if not episode.done:
                    self._end(episode, "error", "the run stopped before the episode ended")
            with self._lock:
                for episode in episodes:
                    self._live.pop(episode.key, None)
            self._drain()
        for episode in episodes:
            self._finish(episode, split)
        if totals is not None:
            totals.update(job_counts(episodes))
        return GenerateStats(requests=len(prepared), aborted=0, groups_completed=sum(is_complete(g) for g in groups))

    def _episode(self, group: Group, sample: Sample, index: int, params: SamplingParams) -> Episode:
        from rollwise.data.prompts import with_system

        key = "rw-ep-" + secrets.token_urlsafe(12)
        prompt = sample.prompt
        task = AgentTask(prompt, [dict(m) for m in with_system(prompt.messages, self.system_prompt)], prompt.answer,
                         dict(prompt.info), "", key, self.model_name, min(params.max_new_tokens, self.max_new_tokens),
                         dict(self.settings.options), index)
        return Episode(key, group, sample, params, task)

    def _launch(self, episode: Episode) -> None:
        episode.task.base_url = self.url
        episode.started = time.monotonic()
        episode.deadline = episode.started + self.settings.timeout_s
        with self._lock:
            self._live[episode.key] = episode
        if self.is_async:
            episode.handle = asyncio.run_coroutine_threadsafe(self._run_async(episode), self._loop)
        else:
            episode.handle = threading.Thread(target=self._run_sync, args=(episode,), daemon=True,
                                              name=f"rollwise-agent-{episode.key[-6:]}")
            episode.handle.start()

    def _run_sync(self, episode: Episode) -> None:
        import openai

        # one shared connection pool: a client of its own costs each episode ~60 ms of TLS setup under the GIL
        client = openai.OpenAI(base_url=self.url, api_key=episode.key, max_retries=0,
                               timeout=self.settings.timeout_s, http_client=self._http)
        try:
            self._inbox.put(("done", episode, self.program(episode.task, client), None))
        except BaseException as exc:  # noqa: BLE001 - every failure of the program is the episode's
            self._inbox.put(("done", episode, None, exc))

    async def _run_async(self, episode: Episode) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=self.url, api_key=episode.key, max_retries=0,
                                    timeout=self.settings.timeout_s, http_client=self._http)
        try:
            self._inbox.put(("done", episode, await self.program(episode.task, client), None))
        except BaseException as exc:  # noqa: BLE001 - cancellation (its timeout) included
            self._inbox.put(("done", episode, None, exc))

    # -- the driving loop -----------------------------------------------------------------------------------
    def _launch_some(self, waiting: list[Episode], running: dict[str, Episode]) -> None:
        while waiting and len(running) < self.settings.concurrency:
            episode = waiting.pop()
            self._launch(episode)
            running[episode.key] = episode

    def _gather(self, running: dict[str, Episode], more_waiting: bool, block: bool = True) -> list[Pending]:
        """The calls to run now. With `block`, wait until every running episode waits on the model, or the first
        queued call has waited `batch_wait_s` (returning early, maybe with [], when an episode ends so that more
        can start); without, whatever has arrived."""
        while True:
            now = time.monotonic()
            queued = self._queued
            if not block:
                self._take_inbox(running, 0.0)
                out, self._queued = self._queued, []
                return out
            # the programs answered at the end of the last engine call get batch_wait_s to send their next call
            since = max(queued[0].arrived, self._generated_at) if queued else now
            if queued and ({p.episode.key for p in queued} >= set(running)
                           or now - since >= self.settings.batch_wait_s):
                self._queued = []
                return queued
            if not running:
                self._queued = []
                return queued
            wake = min([e.deadline for e in running.values()] + [now + 0.5] +
                       ([since + self.settings.batch_wait_s] if queued else []))
            if self._take_inbox(running, max(0.0, wake - now)) and more_waiting:
                return []  # start the next episodes; the queued calls wait for them a little

    def _take_inbox(self, running: dict[str, Episode], timeout_s: float) -> bool:
        """Handle what arrived (waiting up to `timeout_s` for a first item) and the deadlines; True when an
        episode ended."""
        items = []
        try:
            items.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while True:  # and everything else that arrived meanwhile (calls queued during a generate call)
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        ended = any([self._handle(item, running) for item in items])
        for episode in [e for e in running.values() if time.monotonic() > e.deadline]:
            self._end(episode, "timeout", f"the agent program ran past agent.timeout_s = {self.settings.timeout_s:g} s")
            running.pop(episode.key)
            ended = True
        return ended

    def _handle(self, item: tuple, running: dict[str, Episode]) -> bool:
        """Take one inbox item; True when it ended an episode."""
        if item[0] == "call":
            pending = item[1]
            if pending.episode.done:
                _answer(pending, 410, {"message": f"this episode is over ({pending.episode.ended_by})"})
            else:
                self._queued.append(pending)
            return False
        _, episode, value, exc = item
        if episode.done:
            return False
        running.pop(episode.key, None)
        if exc is None:
            episode.outcome = outcome_of(value)
            self._end(episode, "error" if episode.outcome.error else "returned", episode.outcome.error)
        elif episode.ended_by == "call_limit":  # the program gave up after its call was refused: no answer
            episode.outcome = Outcome(answer="")
            self._end(episode, "call_limit", None)
        else:
            self._end(episode, "error", f"the agent program raised {type(exc).__name__}: {one_line(str(exc))}")
        return True

    def _end(self, episode: Episode, how: str, error: str | None) -> None:
        episode.done, episode.error = True, error
        episode.ended_by = how if episode.ended_by != "call_limit" or how == "timeout" else "call_limit"
        episode.seconds = time.monotonic() - episode.started if episode.started else 0.0
        for pending in [p for p in self._queued if p.episode is episode]:
            _answer(pending, 410, {"message": f"this episode is over ({episode.ended_by})"})
        self._queued = [p for p in self._queued if p.episode is not episode]
        if how == "timeout":
            if isinstance(episode.handle, threading.Thread):
                self._hung.append(episode.handle)
            elif episode.handle is not None:
                episode.handle.cancel()

    def _drain(self) -> None:
        """Answer the calls still in the inbox once a job is over (their programs must not wait forever)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "call":
                _answer(item[1], 410, {"message": f"this episode is over ({item[1].episode.ended_by})"})

    def hung(self) -> int:
        """Program threads still running after their episode timed out."""
        self._hung = [t for t in self._hung if t.is_alive()]
        return len(self._hung)

    def _check_hung(self) -> None:
        self.hung()
        if len(self._hung) > 4 * self.settings.concurrency:
            raise AgentStall(f"{len(self._hung)} agent programs still run after agent.timeout_s = "
                             f"{self.settings.timeout_s:g} s; their threads cannot be stopped: make the program end "
                             "(it may retry a refused call forever), or write it as an async def (cancelled on time)")

    # -- engine calls ---------------------------------------------------------------------------------------
    def _requests(self, batch: list[Pending], engine, ids, prepared: dict[int, Prepared]) -> list[GenerationRequest]:
        """Render `batch` into engine requests (recorded in `prepared` by request id); a bad call is answered."""
        out = []
        for pending in batch:
            try:
                item = self._prepare(pending, engine)
            except BadRequest as exc:
                _answer(pending, exc.status, {"message": str(exc)})
                continue
            rid = next(ids)
            prepared[rid] = item
            out.append(GenerationRequest(rid, item.prompt_ids, self._params(item)))
        return out

    def _finished(self, prepared: dict[int, Prepared], result: GenerationResult) -> None:
        """`on_finish`: record the call and answer its program."""
        item = prepared[result.request_id]
        try:
            self._reply(item, result)
        except Exception as exc:  # noqa: BLE001 - a bug here fails this call only
            _answer(item.pending, 500, {"message": f"rollwise agents: {type(exc).__name__}: {exc}"})

    def _generate(self, engine, batch: list[Pending], ids, prepared: dict[int, Prepared]) -> None:
        """Render `batch` and run it as one engine call, answering each call as it finishes."""
        requests = self._requests(batch, engine, ids, prepared)
        if not requests:
            return
        try:
            engine.generate(requests, on_finish=lambda result: self._finished(prepared, result))
        finally:  # an engine that raised: its calls are answered, then the error goes on
            self._generated_at = time.monotonic()
            for request in requests:
                _answer(prepared[request.request_id].pending, 500, {"message": "the engine failed during this call"})

    def _params(self, item: Prepared) -> SamplingParams:
        params = item.pending.episode.params
        cap = min(params.max_new_tokens, self.max_new_tokens)
        return replace(params, max_new_tokens=min(item.request.max_tokens or cap, cap),
                       stop=tuple(dict.fromkeys((*params.stop, *item.request.stop))))

    def _prepare(self, pending: Pending, engine) -> Prepared:
        episode = pending.episode
        if episode.asked >= self.settings.max_calls:
            episode.ended_by = "call_limit"
            raise BadRequest(f"this episode made agent.max_calls = {self.settings.max_calls} calls; it is over", 429)
        request = normalise(pending.body)
        for key in request.ignored:
            self._warn(key, f"rollwise agents: the program's {key} is ignored: episodes sample with the run's "
                            "settings (rollout.temperature, top_p, top_k), which the trainer's log-probs assume")
        bridged = self.codec.bridge(episode.calls, pending.session, request)
        prompt_ids, parent, role = bridged if bridged is not None else (self.codec.prompt_ids(request), None, "")
        limit = _context(engine)
        budget = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens)
        if limit and len(prompt_ids) + budget > limit:
            raise BadRequest(f"the conversation has {len(prompt_ids)} tokens; with max_tokens {budget} that is over "
                             f"the model's context of {limit} tokens")
        episode.asked += 1
        return Prepared(pending, request, prompt_ids, parent, role)

    def _reply(self, item: Prepared, result: GenerationResult) -> None:
        """Record the finished call on its episode and answer the program (OpenAI's chat.completion, plus
        `prompt_token_ids`, per-choice `token_ids` / `token_logprobs`, and `policy_version`)."""
        episode, request = item.pending.episode, item.request
        if episode.done:
            _answer(item.pending, 410, {"message": f"this episode is over ({episode.ended_by})"})
            return
        content, calls = parse_tool_calls(result.text) if request.tools else (result.text, [])
        n = next(self._replies)
        for i, call in enumerate(calls):
            call["id"] = f"call_{n}_{i}"
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        drift = None
        if item.parent is not None:
            drift = self.codec.canonical_ids(request.messages, request.tools) != item.prompt_ids
        episode.calls.append(Call(
            item.pending.session, request.messages, request.tools_key, reply, result.text, item.prompt_ids,
            list(result.response_ids), list(result.logprobs), list(result.full_logprobs), list(result.version_spans),
            result.status, item.parent, item.tail_role, drift, time.monotonic() - item.pending.arrived))
        _answer(item.pending, 200, completion_body(reply, result, item.prompt_ids, self.model_name))

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(message, flush=True)

    # -- episodes -> samples --------------------------------------------------------------------------------
    def _finish(self, episode: Episode, split: bool) -> None:
        """Fill the episode's sample (with `split`, one more per further segment, appended to its group)."""
        outcome = episode.outcome or Outcome()
        calls = [c for c in episode.calls if c.session not in outcome.untrained]
        segments = stitch(calls)
        answer = outcome.answer
        if answer is None:  # the policy's own last reply: never that of an untrained session (a frozen judge)
            answer = calls[-1].reply["content"] if calls else ""
        error = episode.error
        if error is None and not segments:
            error = "the agent program made no model call (nothing to train)"
        rewritten = len(segments) - len({c.session for c in calls})
        if error is None and rewritten and self.settings.on_mismatch == "drop":
            error = (f"the agent program rewrote its message history ({rewritten} call(s) do not extend the "
                     "previous call's tokens); left out (agent.on_mismatch = 'drop')")
        info = {"key": episode.key, "calls": len(episode.calls), "ended_by": episode.ended_by, "error": error,
                "seconds": round(episode.seconds, 3), "segments": len(segments), "split_calls": rewritten}
        sample = episode.sample
        sample.response_text = answer
        if error is not None or not segments:
            fill_sample(sample, segments[0]) if segments else clear_sample(sample)
            sample.status = Status.COMPLETED  # scored (and marked failed there) with its group
            sample.info[INFO_KEY] = {**info, "reward": None}
            return
        for k, segment in enumerate(segments if split else segments[-1:]):
            target = sample if k == 0 else copy_for_segment(sample)
            if k:
                episode.group.samples.append(target)
            fill_sample(target, segment)
            target.response_text = answer
            reward = outcome.session_rewards.get(segment[0].session, outcome.reward)
            target.info[INFO_KEY] = {**info, "reward": reward, "segment": k}


class _CallFeed:
    """The feed of one job's engine call (`rollwise.generate.feed.Feed`, engines with `caps.request_feed`): the
    engine asks it for requests before every decode step, on this thread. It starts episodes, takes the calls
    that arrived and renders them; while the engine is idle it waits as `_gather` does. Done once every episode
    ended."""

    def __init__(self, runner: AgentRunner, engine, waiting: list, running: dict, prepared: dict, ids) -> None:
        self.runner, self.engine, self.waiting, self.running, self.prepared, self.ids = (
            runner, engine, waiting, running, prepared, ids)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def take(self, idle: bool) -> list[GenerationRequest]:
        runner = self.runner
        runner._launch_some(self.waiting, self.running)
        batch = runner._gather(self.running, bool(self.waiting), block=idle)
        return runner._requests(batch, self.engine, self.ids, self.prepared)


async def _async_client(limits, timeout_s: float):
    """An httpx.AsyncClient made on the event loop that uses it."""
    import httpx

    return httpx.AsyncClient(limits=limits, timeout=timeout_s)


def _answer(pending: Pending, status: int, payload: dict) -> None:
    if not pending.future.done():
        pending.future.set_result((status, payload))


def _context(engine) -> int | None:
    """The engine model's context length (None when unknown)."""
    if not engine.caps.local_model:
        return None
    return getattr(engine.model.config, "max_position_embeddings", None)
