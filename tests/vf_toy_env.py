"""A `verifiers` v1 environment defined in a test module (taskset id "vf_toy_env"): a taskset of small sums, a
rubric, and a harness that plays each task in-process with the openai client through verifiers' interception
endpoint (two calls with a tool turn between them), as verifiers allows a harness to ("the interception is the
contract, not the process"). Imported only when verifiers is installed."""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI

CALLS: dict[str, list[dict]] = {}  # the episode key (the request's model) -> what each call returned


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def varied(self, task, trace) -> float:
        """A reward that differs between random replies (so a group has variance): the last reply's characters."""
        text = trace.branches[-1].messages[-1].content if trace.branches else ""
        return (sum(map(ord, str(text or ""))) % 5) / 4


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(16):
            yield SumTask(SumData(prompt=f"What is {i} + {i + 1}?", answer=str(2 * i + 1)), self.config.task)


class ToolHarnessConfig(vf.HarnessConfig):
    pass


class ToolHarness(vf.Harness[ToolHarnessConfig]):
    """Ask, run a tool on the reply, send its result, take the final reply."""

    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [{"role": "user", "content": data.prompt}]
        try:
            for turn in range(2):
                response = await client.chat.completions.create(model=ctx.model, messages=messages)
                choice = response.choices[0]
                CALLS.setdefault(ctx.model, []).append({"content": choice.message.content})
                messages.append(choice.message.model_dump(exclude_none=True))
                if turn == 0:
                    messages.append({"role": "user", "content": f"tool result: {len(choice.message.content or '')}"})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["SumTaskset", "ToolHarness"]
