"""Agent programs for tests/test_agents.py: plain Python agents that call rollwise's loopback endpoint with the
`openai` client, as a user's agent would (named by dotted path, `agent.program = "toy_agents:tool_agent"`).

Every program records what its calls returned in `CALLS[task.api_key]` (prompt token ids, completion ids and
log-probs, the messages it sent), so a test can compare them with what the trainer received.
"""

from __future__ import annotations

import asyncio
import threading

CALLS: dict[str, list[dict]] = {}
_LOCK = threading.Lock()
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                            "parameters": {"type": "object", "properties": {
                                                "a": {"type": "number"}, "b": {"type": "number"}}}}}]


def _record(task, messages, response) -> None:
    choice = response.choices[0]
    with _LOCK:
        CALLS.setdefault(task.api_key, []).append({
            "messages": [dict(m) for m in messages], "prompt_ids": list(response.prompt_token_ids),
            "ids": list(choice.token_ids), "logprobs": list(choice.token_logprobs),
            "version": response.policy_version, "content": choice.message.content})


def text_reward(text: str) -> float:
    """A reward that differs between random responses (so GRPO groups have variance)."""
    return (sum(map(ord, text or "")) % 7) / 6


def tool_agent(task, client):
    """Three calls: ask, run a tool on the reply and send its result (a tool turn), then ask for the answer."""
    messages = list(task.messages)
    first = client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
    _record(task, messages, first)
    reply = first.choices[0].message.model_dump(exclude_none=True)
    messages += [reply, {"role": "tool", "tool_call_id": "call_0", "content": str(len(reply.get("content") or ""))}]
    second = client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
    _record(task, messages, second)
    messages += [second.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Now give the final answer."}]
    third = client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
    _record(task, messages, third)
    return text_reward(third.choices[0].message.content)


def answer_agent(task, client):
    """One call; returns the final answer text (scored by the run's reward function)."""
    response = client.chat.completions.create(model=task.model, messages=task.messages)
    _record(task, task.messages, response)
    return "the answer is " + (task.answer or "")


def rewriting_agent(task, client):
    """Two calls whose second drops the first exchange (a summarising agent): its history is rewritten."""
    first = client.chat.completions.create(model=task.model, messages=task.messages)
    _record(task, task.messages, first)
    summary = [{"role": "user", "content": "Summary: " + (first.choices[0].message.content or "")[:20]}]
    second = client.chat.completions.create(model=task.model, messages=summary)
    _record(task, summary, second)
    return text_reward(second.choices[0].message.content)


class ToolFailed(RuntimeError):
    pass


def failing_agent(task, client):
    """Calls the model once, then its tool raises."""
    response = client.chat.completions.create(model=task.model, messages=task.messages)
    _record(task, task.messages, response)
    raise ToolFailed("the calculator is down")


def looping_agent(task, client):
    """Calls until it is refused (agent.max_calls), then gives up by raising the client's error."""
    messages = list(task.messages)
    while True:
        response = client.chat.completions.create(model=task.model, messages=messages)
        _record(task, messages, response)
        messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]


async def slow_agent(task, client):
    """An async program whose tool hangs."""
    response = await client.chat.completions.create(model=task.model, messages=task.messages)
    _record(task, task.messages, response)
    await asyncio.sleep(3600)
    return 1.0


def probing_agent(task, client):
    """Sends what the endpoint must refuse (a wrong key, a streamed call, n = 2), records each status, then one
    valid call."""
    import httpx

    url = task.base_url + "/chat/completions"
    body = {"model": task.model, "messages": task.messages}
    statuses = [httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code,
                httpx.post(url, json={**body, "stream": True}, headers={"Authorization": f"Bearer {task.api_key}"}
                           ).status_code,
                httpx.post(url, json={**body, "n": 2}, headers={"Authorization": f"Bearer {task.api_key}"}).status_code]
    with _LOCK:
        CALLS.setdefault(task.api_key + ":statuses", []).extend(statuses)
    return answer_agent(task, client)
