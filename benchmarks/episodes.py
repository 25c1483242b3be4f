"""Episode throughput: how turns are scheduled when tools are slow, and the sandbox's share of an episode.

`--compare schedule` (what `env.schedule` buys): the same episodes, torch engine, three ways, interleaved per
repeat after a warm-up (A B C A B C ...) so machine load hits each alike; medians and ratios of medians:
- `rounds`: one `generate` call per turn, every `env.step` in the engine's finish callback (the path before
  the request feed; `env.schedule = "rounds"`);
- `continuous`: env steps in a pool of `env.workers` threads, the next turn fed into the running batch
  `lag_steps` engine steps after the turn ended (the default; reproducible);
- `asap`: the same, joining as soon as the tool returns.
The tool is `SlowTool`: every assistant turn but the last gets a tool message after a delay drawn from
`--tool-s LO,HI` (a hash of the prompt and the turn: the same delays on every side). A turn that reaches
`--max-new-tokens` is truncated and ends its episode (as in training), so the turns per episode are reported. Every side samples at
T=1 from the same engine seed; the schedules batch turns differently, so the sampled tokens differ: each side
reports its generated (policy) tokens and tokens/s next to episodes/s.

`--compare sandbox` (the earlier figure): the same `pyexec` episodes with the code run under bubblewrap, under
the rlimits fallback, and not run at all (generation only), in rounds.

    python benchmarks/episodes.py --compare schedule --model tiny --prompts 8 --samples 4 --repeats 3
    python benchmarks/episodes.py --compare schedule --model smollm2-135m-instruct --repeats 3
    python benchmarks/episodes.py --compare sandbox [--prompts 8] [--repeats 2] [--max-new-tokens 96]

JSON on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from itertools import count

import torch

from rollwise.config import DataConfig, EnvConfig
from rollwise.data import PromptEncoder
from rollwise.data.sources import build_prompt_source
from rollwise.envs import build_env
from rollwise.envs.base import StepResult
from rollwise.envs.episode import EpisodeCodec, TurnSchedule, episode_metrics
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.models import load_model
from rollwise.rollout import Episodes
from rollwise.types import SamplingParams


class NoExec:
    """pyexec's turn structure without running anything: the first message ends the episode."""

    name, max_turns, stop = "no_exec", 2, ()

    def reset(self, prompt):
        return {}

    def step(self, state, text):
        return StepResult(done=True)


class SlowTool:
    """A tool that takes its time: every assistant turn before the `turns`-th gets a tool message after a delay
    in [lo, hi] s, fixed by the prompt and the turn (the same delays on every side); the last turn ends it."""

    name = "slow_tool"

    def __init__(self, turns: int, lo: float, hi: float, stop: tuple[str, ...] = ()) -> None:
        self.max_turns, self.lo, self.hi, self.stop = turns, lo, hi, stop

    def reset(self, prompt):
        return {"uid": prompt.uid, "turn": 0}

    def delay(self, uid: str, turn: int) -> float:
        h = int.from_bytes(hashlib.blake2b(f"{uid}/{turn}".encode(), digest_size=4).digest(), "little")
        return self.lo + (self.hi - self.lo) * h / 2**32

    def step(self, state, text):
        state["turn"] += 1
        if state["turn"] >= self.max_turns:
            return StepResult(done=True)
        time.sleep(self.delay(state["uid"], state["turn"]))
        return StepResult(messages=[{"role": "tool", "content": f"result {state['turn']}: 42"}])


def tiny_policy(tokenizer):
    """A random 2-layer Llama (hidden 64) on the embedded model's tokenizer: decoding costs next to nothing, so
    what is left is scheduling and tools."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def schedule_side(kind: str, engine, codec, prompts, args) -> dict:
    lo, hi = (float(x) for x in args.tool_s.split(","))
    env = SlowTool(args.turns, lo, hi, tuple(s for s in args.stop.split(",") if s))
    schedule = TurnSchedule(kind, workers=args.workers, lag_steps=args.lag_steps)
    episodes = Episodes(env, codec, args.turns * args.max_new_tokens + 256, schedule)
    engine.generator.manual_seed(0)
    engine.stats.reset()
    groups = new_groups(prompts, args.samples, 0)
    start = time.perf_counter()
    episodes.run(engine, groups, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0), count())
    wall = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    m = episode_metrics(samples)
    policy_tokens = sum(sum(s.loss_mask) for s in samples)
    st = engine.stats
    return {"wall_s": wall, "episodes_per_s": len(samples) / wall, "policy_tokens": policy_tokens,
            "policy_tokens_per_s": policy_tokens / wall, "turns_mean": m["episode/turns_mean"],
            "env_s": m["episode/env_s"], "stall_s": m["episode/stall_s"], "decode_steps": st.decode_steps,
            "effective_batch": st.active_slot_steps / max(1, st.decode_steps), "padding_eff": st.padding_eff}


def compare_schedule(args) -> dict:
    _, tok = load_model("smollm2-135m-instruct")
    model = tiny_policy(tok) if args.model == "tiny" else load_model(args.model)[0]
    engine = TorchEngine(model, tok, dtype=torch.float32, max_batch_size=64, seed=0)
    source = build_prompt_source(DataConfig(task="calc"), seed=0)
    encoder = PromptEncoder(tok, None, 1024)
    prompts = [(p, encoder.encode(p)) for p in source.eval_prompts(args.prompts)]
    codec = EpisodeCodec(tok)
    sides = ["rounds", "continuous", "asap"]
    schedule_side("continuous", engine, codec, prompts[:2], args)  # warm-up (allocations, thread pools)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side in sides:
            runs[side].append(schedule_side(side, engine, codec, prompts, args))
            print(side, json.dumps({k: round(v, 3) for k, v in runs[side][-1].items()}), flush=True)
    out: dict = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    for side in ("continuous", "asap"):
        out[f"ratio_wall_rounds_over_{side}"] = out["rounds"]["wall_s"] / out[side]["wall_s"]
        out[f"ratio_tokens_per_s_{side}_over_rounds"] = (out[side]["policy_tokens_per_s"]
                                                         / out["rounds"]["policy_tokens_per_s"])
    out["runs"] = runs
    return out


def sandbox_side(side: str, engine, codec, prompts, params, max_episode_tokens: int) -> dict:
    os.environ["ROLLWISE_SANDBOX"] = "rlimits" if side == "rlimits" else "bwrap"
    env = NoExec() if side == "no_exec" else build_env(EnvConfig(max_turns=2), "pyexec")
    engine.generator.manual_seed(0)
    groups = new_groups(prompts, 1, 0)
    start = time.perf_counter()
    Episodes(env, codec, max_episode_tokens, TurnSchedule("rounds")).run(engine, groups, params, count())
    wall = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    m = episode_metrics(samples)
    turns = sum(s.episode.assistant_turns for s in samples)
    return {"wall_s": wall, "episodes_per_s": len(samples) / wall, "turns_per_s": turns / wall,
            "sandbox_s": m["episode/sandbox_s"], "env_s": m["episode/env_s"], "turns_mean": m["episode/turns_mean"]}


def compare_sandbox(args) -> dict:
    model, tok = load_model("smollm2-135m-instruct")
    engine = TorchEngine(model, tok, dtype=torch.float32, seed=0)
    source = build_prompt_source(DataConfig(task="pyexec"), seed=0)
    encoder = PromptEncoder(tok, None, 1024)
    prompts = [(p, encoder.encode(p)) for p in source.eval_prompts(args.prompts)]
    codec = EpisodeCodec(tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    runs: dict[str, list[dict]] = {"bwrap": [], "rlimits": [], "no_exec": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(sandbox_side(side, engine, codec, prompts, params, 2 * args.max_new_tokens + 256))
    out = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    out["ratio_turns_per_s_bwrap_over_no_exec"] = out["bwrap"]["turns_per_s"] / out["no_exec"]["turns_per_s"]
    out["ratio_episodes_per_s_bwrap_over_rlimits"] = out["bwrap"]["episodes_per_s"] / out["rlimits"]["episodes_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=["schedule", "sandbox"], default="sandbox")
    parser.add_argument("--model", default="tiny", help="schedule: 'tiny' (random, 2 layers) or a model name")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="schedule: episodes per prompt")
    parser.add_argument("--turns", type=int, default=3, help="schedule: assistant turns per episode")
    parser.add_argument("--tool-s", default="0.2,0.5", help="schedule: tool delay range LO,HI in seconds")
    parser.add_argument("--workers", type=int, default=8, help="schedule: env.workers")
    parser.add_argument("--lag-steps", type=int, default=TurnSchedule().lag_steps, help="schedule: env.lag_steps")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per turn (schedule 32, sandbox 96)")
    parser.add_argument("--stop", default=None, help="schedule: stop strings of a turn, comma-separated (tiny: "
                        "'x,q,z', about 6%% of its random tokens, so turns end before the limit; else none)")
    args = parser.parse_args()
    args.max_new_tokens = args.max_new_tokens or (32 if args.compare == "schedule" else 96)
    args.stop = args.stop if args.stop is not None else ("x,q,z" if args.model == "tiny" else "")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = compare_schedule(args) if args.compare == "schedule" else compare_sandbox(args)
    out["setup"] = {**vars(args), "threads": torch.get_num_threads()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
