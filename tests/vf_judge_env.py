"""A two-agent `verifiers` v1 environment (taskset id "vf_judge_env"): the policy (`agent`) plays a task of
tests/vf_toy_env.py, then a frozen judge (`judge`, untrainable, as verifiers' agentic judge) plays it too, through
the same endpoint and episode key, so the judge's replies are the episode's last calls. Each harness run also
starts a child process and records which rollwise keys its environment holds (`CHILD_ENV`). Imported only when
verifiers is installed."""

from __future__ import annotations

import subprocess
import sys

import verifiers.v1 as vf
from vf_toy_env import CALLS, SumTaskset, ToolHarness

CHILD_ENV: list[dict[str, str]] = []  # per harness run: a child's environment variables holding a rollwise key
PROBE = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if v.startswith('rw-')}))"


class ProbingHarness(ToolHarness):
    """The toy harness, after starting a child process as a harness program would."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        import json

        seen = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
        CHILD_ENV.append(json.loads(seen.stdout))
        return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)


class JudgedConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    judge: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class JudgedEnv(vf.Env[JudgedConfig]):
    async def setup(self, agents):
        agents.judge.trainable = False

    async def run(self, task, agents):
        await agents.agent.run(task)
        await agents.judge.run(task)


__all__ = ["CALLS", "SumTaskset", "ProbingHarness", "JudgedEnv"]
