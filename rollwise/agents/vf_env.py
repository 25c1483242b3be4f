"""Environments written for `verifiers` v1 (prime-rl's library: a `Taskset` of tasks with `@vf.reward` rubrics,
a `Harness` program that plays them, an `Env` that composes them) trained in rollwise.

    data.task = "verifiers:<taskset id>"      # the installed module that exports the Taskset (its id)
    data.options = {harness = "null", ...}    # optional: a harness id, runtime ("subprocess"), max_tasks for an
                                              # endless taskset; every other key goes to the taskset's config

- Its tasks become prompts (`VerifiersTasks`, a rollwise `PromptSource`): a fixed held-out slice (the last
  `min(data.eval_size, n/4)` tasks, whatever the seed), the rest shuffled per epoch by `train.seed`.
- Its harness drives each episode, through verifiers' own interception server, whose client
  (`EvalClientConfig`) points at rollwise's loopback endpoint; the episode's key rides as the request's
  `model`, the run's key as the `X-Rollwise-Run-Key` header of that client (verifiers reads a Bearer key only
  from an environment variable, which every child process - a harness program, a reward worker, a launched
  vLLM server - would inherit: the run's key never goes into `os.environ`), and verifiers' `X-Session-ID` (its
  trace id) keeps the conversations of a multi-agent episode apart. rollwise renders and samples every call,
  so the trainer sees exactly the ids its engine sampled (`rollwise.agents.chat`), never verifiers'
  re-rendered messages.
- Its rubric scores it: each trace's reward (the weighted sum of its `@vf.reward`s, with the parts as
  `reward/part/*`) is the reward of that trace's samples; traces an env marks untrainable (a frozen judge)
  are not trained. A failed episode (an error on the episode or a trace, a reward that did not score) fails
  its sample, counted.

Harness programs run in verifiers' `subprocess` runtime by default (the host: no container); the built-in
harnesses install their programs with `uv` and need the network once, a harness that runs its loop in
process (exported by the taskset's module beside its Taskset) does not.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from rollwise.agents.program import Outcome
from rollwise.config import DataConfig
from rollwise.errors import UserError
from rollwise.types import Prompt, RewardResult

FAMILY = "verifiers"
# an environment variable that is never set: verifiers' client sends `Bearer EMPTY` (the run key is a header)
UNSET_KEY_VAR = "ROLLWISE_VERIFIERS_NO_KEY"
EXTRA_OPTIONS = ("harness", "runtime", "max_tasks")


class VerifiersError(UserError, ValueError):
    """A verifiers environment that cannot be loaded; the message names `data.task` or `data.options`."""


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersError(f"data.task = 'verifiers:...' needs the verifiers package ({exc}); "
                             "pip install 'rollwise[verifiers]'") from None
    return vf


def check_task(task: str, key: str = "data.task") -> None:
    """Cheap check at validation (no import of the environment): the package and the taskset module exist."""
    import importlib.util

    name = task.partition(":")[2]
    if not name:
        raise VerifiersError(f"{key} = {task!r} needs a taskset id after the colon, e.g. 'verifiers:my_env'")
    if importlib.util.find_spec("verifiers") is None:
        raise VerifiersError(f"{key} = {task!r} needs the verifiers package: pip install 'rollwise[verifiers]'")
    module = name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is None and importlib.util.find_spec(module) is None:
        raise VerifiersError(f"{key} = {task!r}: no module {module!r} is installed (a verifiers environment is a "
                             "package exporting its Taskset; pip install it, or put it on PYTHONPATH)")


def verifiers_task(cfg: DataConfig, seed: int) -> "VerifiersTasks":
    """The task family entry `verifiers:<taskset id>` (rollwise.data.tasks.TASK_FAMILIES)."""
    vf = _vf()
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    name = cfg.task.partition(":")[2]
    if not name:
        raise VerifiersError("data.task = 'verifiers:' needs a taskset id after the colon, e.g. 'verifiers:gsm8k'")
    options = dict(cfg.options)
    extras = {k: options.pop(k) for k in EXTRA_OPTIONS if k in options}
    agent: dict[str, Any] = {"runtime": {"type": str(extras.get("runtime", "subprocess"))}}
    if "harness" in extras:
        agent["harness"] = {"id": str(extras["harness"])}
    try:
        env = load_environment(resolve_env_config({"taskset": {"id": name, **options}, "agent": agent}))
        taskset = env.taskset
        if not taskset.bounded:
            if "max_tasks" not in extras:
                raise VerifiersError(f"data.task = {cfg.task!r}: the taskset is endless; set data.options.max_tasks")
            taskset = taskset.take(int(extras["max_tasks"]))
        tasks = list(taskset)
    except VerifiersError:
        raise
    except Exception as exc:  # verifiers' own errors: import, config validation, the taskset's load()
        raise VerifiersError(f"data.task = {cfg.task!r} (data.options {sorted(cfg.options)}): "
                             f"{type(exc).__name__}: {exc}") from None
    if len(tasks) < 2:
        raise VerifiersError(f"data.task = {cfg.task!r}: the taskset has {len(tasks)} task(s); training needs more")
    return VerifiersTasks(name, VerifiersProgram(env, tasks, vf), tasks, seed, cfg.eval_size)


def rubric_only(sample) -> float:
    """The reward of a verifiers task outside its episodes: an error (counted), never a score."""
    raise VerifiersError("a verifiers task is scored by its environment's rubric in its episodes; run it with "
                         "`rollwise train` (evaluation there runs the episodes), not single responses")


def task_messages(data: Any) -> list[dict[str, str]]:
    """A verifiers `TaskData`'s system prompt and prompt as chat messages (text)."""
    from verifiers.v1.types import content_text

    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
    return messages or [{"role": "user", "content": ""}]


class VerifiersTasks:
    """A verifiers taskset as a rollwise `PromptSource`; `default_agent` runs its episodes."""

    # the environment's rubric scores every episode (rollwise.agents.program.AgentReward); this one only answers
    # a run that scores these prompts without their episodes (rollwise eval), with a counted error, not a score
    default_reward = "rollwise.agents.vf_env:rubric_only"

    def __init__(self, name: str, program: "VerifiersProgram", tasks: list, seed: int, eval_size: int) -> None:
        self.name = f"{FAMILY}:{name}"
        self.default_agent = program
        self.num_eval = min(eval_size, len(tasks) // 4)
        self.prompts = [self._prompt(i, t) for i, t in enumerate(tasks)]
        self.train = list(range(len(tasks) - self.num_eval))
        self.seed = seed
        self._epochs: dict[int, list[int]] = {}

    def _prompt(self, i: int, task: Any) -> Prompt:
        answer = getattr(task.data, "answer", None)
        return Prompt(f"{self.name}-{task.key[:12]}", task_messages(task.data), None if answer is None else str(answer),
                      source=f"{self.name}[{i}]", info={"vf_index": i})

    def train_prompt(self, position: int) -> Prompt:
        """Every training task once per epoch, in an order drawn from (seed, epoch)."""
        epoch, offset = divmod(position, len(self.train))
        if epoch not in self._epochs:
            order = list(self.train)
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._epochs = {epoch: order}
        return self.prompts[self._epochs[epoch][offset]]

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > self.num_eval:
            raise ValueError(f"task {self.name!r}: asked for {n} eval prompts but {self.num_eval} are held out "
                             "(data.eval_size, at most a quarter of the taskset)")
        return self.prompts[len(self.train):len(self.train) + n]

    def split_summary(self) -> str:
        return f"{self.name}: {len(self.prompts)} tasks -> {len(self.train)} train, {self.num_eval} held-out"


class VerifiersProgram:
    """The agent program of a verifiers environment: one `Env.run_episode` per rollwise episode, inside
    `env.serving()` (entered by `start` on the runner's event loop and held until `close`)."""

    def __init__(self, env: Any, tasks: list, vf: Any) -> None:
        self.env, self.tasks, self.vf = env, tasks, vf
        self.client = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task | None = None

    async def start(self, base_url: str, run_key: str) -> None:
        from rollwise.agents.server import RUN_KEY_HEADER

        # the key goes to the client object only: never os.environ, which every child process inherits
        self.client = self.vf.EvalClientConfig(base_url=base_url, api_key_var=UNSET_KEY_VAR,
                                               headers={RUN_KEY_HEADER: run_key})
        self._stop, ready = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with self.env.serving():
                ready.set()
                await self._stop.wait()

        self._holder = asyncio.get_running_loop().create_task(hold())
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait({waiter, self._holder}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiter.cancel()
            await self._holder  # raises why serving did not start

    async def close(self) -> None:
        if self._holder is not None:
            self._stop.set()
            await self._holder
            self._holder = None

    async def __call__(self, task, client) -> Outcome:
        vf_task = self.tasks[task.info["vf_index"]]
        ctx = self.vf.ModelContext(model=task.api_key, client=self.client)
        return episode_outcome(await self.env.run_episode(vf_task, ctx))


def episode_outcome(episode: Any) -> Outcome:
    """A finished verifiers `Episode` -> per-trace rewards (trace id = session), untrainable traces, or why it
    failed."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or errors:
        why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode did not complete"
        return Outcome(error=f"verifiers episode failed: {why}"[:2000])
    rewards: dict[str, RewardResult] = {}
    untrained: set[str] = set()
    for trace in episode.traces:
        if trace.agent is not None and not trace.agent.trainable:
            untrained.add(trace.id)
            continue
        missing = sorted(k for k, r in trace.rewards.items() if r is None)
        if missing:
            return Outcome(error=f"verifiers trace {trace.id}: rewards {missing} were not scored")
        parts = {k: float(r.score) for k, r in trace.rewards.items()}
        rewards[trace.id] = RewardResult(float(trace.reward), parts=parts)
    if not rewards:
        return Outcome(error="verifiers episode: no trainable trace")
    return Outcome(reward=next(iter(rewards.values())), session_rewards=rewards, untrained=untrained)
