"""Multi-turn environments: the contract (`base`), tool-call syntaxes (`parsers`), `ToolEnv`, the episode
runner (`episode`) and the registry of environments by name.

`ENVS` holds factories `fn(cfg: EnvConfig) -> Env`; `env.name` in a config is a registered name or a plugin
`'pkg.module:factory'`. A task may name its own environment (`PromptSource.default_env`).
"""

from __future__ import annotations

from typing import Callable

from rollwise.config import EnvConfig
from rollwise.envs.base import Env, EnvError, StepResult, Tool
from rollwise.envs.tool_env import ToolEnv, calculator_tool
from rollwise.registry import Registry

EnvFactory = Callable[[EnvConfig], Env]
ENVS: Registry[EnvFactory] = Registry("environment")


# Environments in their own modules, imported on first use.
ENVS.register_lazy("lookup", "rollwise.envs.lookup:lookup_env")
ENVS.register_lazy("pyexec", "rollwise.envs.pyexec:pyexec_env")


@ENVS.register("calc")
def calc_env(cfg: EnvConfig) -> ToolEnv:
    """A calculator tool `<calc>EXPR</calc>` (the `calc` task)."""
    return ToolEnv([calculator_tool()], cfg.parser, cfg.max_turns, name="calc", **cfg.options)


def env_name(cfg: EnvConfig, task_default: str | None) -> str | None:
    """The environment a run uses: `env.name`, else the task's own, else None (single-turn)."""
    return cfg.name or task_default


def build_env(cfg: EnvConfig, task_default: str | None = None) -> Env | None:
    """The run's environment, or None for single-turn runs. EnvError names the key on a bad name or options."""
    name = env_name(cfg, task_default)
    if name is None:
        return None
    try:
        factory = ENVS.get(name)
    except (KeyError, ValueError, ImportError, AttributeError) as exc:
        raise EnvError(f"env.name: {exc.args[0] if exc.args else exc}") from None
    try:
        env = factory(cfg)
    except TypeError as exc:
        raise EnvError(f"env.options of {name!r}: {exc}") from None
    missing = [attr for attr in ("reset", "step", "max_turns", "stop") if not hasattr(env, attr)]
    if missing:
        raise EnvError(f"environment {name!r} lacks {', '.join(missing)} (see rollwise/envs/base.py)")
    return env

__all__ = ["ENVS", "Env", "EnvError", "StepResult", "Tool", "ToolEnv", "build_env", "env_name"]
