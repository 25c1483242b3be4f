"""Episodes from agent programs: any Python agent that talks to an OpenAI-compatible chat endpoint, and
environments written for `verifiers` v1, trained token-exactly in the usual loop (docs/agentic.md).

    [agent]
    program = "my_agents:solve"     # fn(task, client) per episode; or data.task = "verifiers:<taskset id>"

rollwise serves the run's own engine to the programs on loopback (`server`), runs them (`runner`), renders
their calls so that each prompt extends the previous call's tokens (`chat`), stitches the calls of an episode
into one sample with loss masks, or several when a program rewrote its history (`calls`), and takes the reward
from the program (`program`) or the environment's rubric (`vf_env`). `AgentRollouts` (`rollouts`) is the
Generate stage built from it; `rollwise.build` finds this source through its `EPISODE_SOURCES` registry.

This package module stays light (config only): it is imported for every run to ask whether agents are used.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rollwise.config import Config

VERIFIERS_PREFIX = "verifiers:"


def uses_agents(cfg: Config) -> bool:
    """Whether the run's episodes come from an agent program (`agent.program`, or a verifiers task)."""
    return cfg.agent.program is not None or cfg.data.task.startswith(VERIFIERS_PREFIX)


def agent_errors(cfg: Config) -> list[str]:
    """Keys that cannot go with agent episodes (rollwise.validate)."""
    if not uses_agents(cfg):
        return []
    what = f"agent.program = {cfg.agent.program!r}" if cfg.agent.program else f"data.task = {cfg.data.task!r}"
    errors = []
    if cfg.env.name is not None:
        errors.append(f"{what} runs the episodes itself (its own tools); remove env.name = {cfg.env.name!r}")
    if cfg.control.mode == "async":
        errors.append(f"{what}: agent episodes run on the run's engine in this process; use control.mode = 'sync'")
    if cfg.control.partial_rollouts:
        errors.append(f"{what}: a program cannot be paused and resumed; turn control.partial_rollouts off")
    if cfg.rollout.source != "local" or cfg.cluster.ray:
        errors.append(f"{what}: agent episodes need the engine in this process; use rollout.source = 'local' and "
                      "cluster.ray = false")
    return errors


def missing_extras(cfg: Config) -> str | None:
    """The pip line for what agent episodes need and is not installed (rollwise.names), or None."""
    if not uses_agents(cfg):
        return None
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return f"agent episodes need {', '.join(missing)}: pip install 'rollwise[agent]'"
    if cfg.data.task.startswith(VERIFIERS_PREFIX) and importlib.util.find_spec("verifiers") is None:
        return f"data.task = {cfg.data.task!r} needs the verifiers package: pip install 'rollwise[verifiers]'"
    return None


def agent_source(cfg: Config, prompt_source: Any) -> "AgentSource | None":
    """The entry of `rollwise.build.EPISODE_SOURCES`: agent episodes when `agent.program` is set or the prompt
    source brings its own program (`default_agent`, a verifiers taskset), else None."""
    program = getattr(prompt_source, "default_agent", None)
    if cfg.agent.program is not None:
        from rollwise.agents.program import load_program

        program = load_program(cfg.agent.program)
    return None if program is None else AgentSource(cfg, program)


class AgentSource:
    """What `rollwise.build` asks of an episode source: the run's reward function wrapped (`reward`) and the
    episodes (`episodes`: the runner, which is `run.episodes` for evaluation and builds the Generate stage)."""

    def __init__(self, cfg: Config, program: Any) -> None:
        self.cfg, self.program = cfg, program

    def reward(self, fn):
        from rollwise.agents.program import AgentReward

        return AgentReward(fn)

    def episodes(self, tokenizer):
        from rollwise.agents.runner import AgentRunner

        cfg = self.cfg
        return AgentRunner(self.program, tokenizer, cfg.agent, cfg.data.system_prompt, cfg.rollout.max_new_tokens,
                           model_name=cfg.run.name or "rollwise")
