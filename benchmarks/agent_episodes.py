"""Agent-program episodes with a slow tool: calls joining the running engine call (`caps.request_feed`) against
rounds (one engine call per batch of waiting calls, what an engine without the feed does).

The program (`slow_tool_agent`) makes `--calls` chat calls per episode through rollwise's loopback endpoint and
runs a tool between them that sleeps a delay drawn from `--tool-s LO,HI` (a hash of the prompt, the sample and
the call: the same delays on both sides). Sides are interleaved per repeat after a warm-up (A B A B ...) so
machine load hits each alike; medians of wall time, episodes/s and generated tokens/s, and the mean time a
call waited for the engine (`agent/call_wait_s_mean`).

    python benchmarks/agent_episodes.py --model tiny --prompts 8 --samples 4 --repeats 3
    python benchmarks/agent_episodes.py --model smollm2-135m-instruct --repeats 2

JSON on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import time
from collections import Counter
from itertools import count
from types import SimpleNamespace

import torch

from rollwise.agents.rollouts import agent_metrics
from rollwise.agents.runner import AgentRunner
from rollwise.config import AgentConfig, DataConfig
from rollwise.data import PromptEncoder
from rollwise.data.sources import build_prompt_source
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.models import load_model
from rollwise.types import SamplingParams

SETTINGS = SimpleNamespace(calls=3, lo=0.0, hi=0.5)


def delay(*key) -> float:
    h = int(hashlib.sha1(repr(key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return SETTINGS.lo + (SETTINGS.hi - SETTINGS.lo) * h


def slow_tool_agent(task, client):
    """`SETTINGS.calls` calls with a tool turn (a sleep) between each two."""
    messages = list(task.messages)
    for turn in range(SETTINGS.calls):
        reply = client.chat.completions.create(model=task.model, messages=messages)
        if turn + 1 < SETTINGS.calls:
            time.sleep(delay(task.prompt.uid, task.sample_index, turn))
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "content": f"result {turn}: 42"}]
    return 1.0


def tiny_policy(tokenizer):
    """A random 2-layer Llama on the embedded tokenizer: decoding costs little, scheduling and tools remain."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def side(feed: bool, engine, runner, prompts, args) -> dict:
    engine.caps = dataclasses.replace(TorchEngine.caps, request_feed=feed)
    engine.generator.manual_seed(0)
    engine.stats.reset()
    groups = new_groups(prompts, args.samples, 0)
    totals: Counter = Counter()
    start = time.perf_counter()
    runner.run(engine, groups, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0), count(),
               totals=totals)
    wall = time.perf_counter() - start
    m = agent_metrics(totals)
    episodes = sum(len(g.samples) for g in groups)
    return {"wall_s": wall, "episodes_per_s": episodes / wall, "tokens_per_s": engine.stats.generated_tokens / wall,
            "call_wait_s_mean": m["agent/call_wait_s_mean"], "failed": m["agent/failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random, 2 layers) or a model name")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tool-s", default="0,0.5", help="LO,HI seconds of the tool's delay")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    SETTINGS.calls = args.calls
    SETTINGS.lo, SETTINGS.hi = (float(x) for x in args.tool_s.split(","))
    _, tok = load_model("smollm2-135m-instruct")
    model = tiny_policy(tok) if args.model == "tiny" else load_model(args.model)[0]
    engine = TorchEngine(model, tok, dtype=torch.float32, max_batch_size=64, seed=0)
    encoder = PromptEncoder(tok, None, 1024)
    prompts = [(p, encoder.encode(p)) for p in build_prompt_source(DataConfig(task="arith"), 0).eval_prompts(args.prompts)]
    runner = AgentRunner(slow_tool_agent, tok, AgentConfig(timeout_s=600), None, args.max_new_tokens)
    try:
        side(True, engine, runner, prompts[:2], args)  # warm-up: the endpoint, thread start, allocations
        runs: dict[str, list[dict]] = {"request_feed": [], "rounds": []}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(side(name == "request_feed", engine, runner, prompts, args))
    finally:
        runner.close()
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(json.dumps({"settings": vars(args), "median": medians, "runs": runs,
                      "feed_over_rounds_episodes_per_s": medians["request_feed"]["episodes_per_s"]
                      / medians["rounds"]["episodes_per_s"]}, indent=1))


if __name__ == "__main__":
    main()
