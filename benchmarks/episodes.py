"""Episode throughput with and without the sandbox (pyexec, the embedded SmolLM2-135M-Instruct, torch engine).

The same episodes three ways, interleaved per repeat (A B C A B C ...) so machine load hits each alike:
- `bwrap`: the `pyexec` environment, code run under bubblewrap (`rollwise.sandbox`, backend "bwrap");
- `rlimits`: the same with the fallback backend (pool uid + rlimits, no namespaces);
- `no_exec`: the same episodes' generation with an environment that never runs code (every turn ends the
  episode as if the tests passed): the generation-only floor.
Every side samples with the same seeds, so `bwrap` and `rlimits` produce the same tokens; `no_exec` stops after
the first turn and is reported per turn as well. JSON on stdout.

    python benchmarks/episodes.py [--prompts 8] [--repeats 2] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
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
from rollwise.envs.episode import EpisodeCodec, episode_metrics
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


def run_side(side: str, engine, codec, prompts, params, max_episode_tokens: int) -> dict:
    os.environ["ROLLWISE_SANDBOX"] = "rlimits" if side == "rlimits" else "bwrap"
    env = NoExec() if side == "no_exec" else build_env(EnvConfig(max_turns=2), "pyexec")
    engine.generator.manual_seed(0)
    groups = new_groups(prompts, 1, 0)
    start = time.perf_counter()
    Episodes(env, codec, max_episode_tokens).run(engine, groups, params, count())
    wall = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    m = episode_metrics(samples)
    turns = sum(s.episode.assistant_turns for s in samples)
    return {"wall_s": wall, "episodes_per_s": len(samples) / wall, "turns_per_s": turns / wall,
            "sandbox_s": m["episode/sandbox_s"], "env_s": m["episode/env_s"], "turns_mean": m["episode/turns_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
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
            runs[side].append(run_side(side, engine, codec, prompts, params, 2 * args.max_new_tokens + 256))
    out = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    out["ratio_turns_per_s_bwrap_over_no_exec"] = out["bwrap"]["turns_per_s"] / out["no_exec"]["turns_per_s"]
    out["ratio_episodes_per_s_bwrap_over_rlimits"] = out["bwrap"]["episodes_per_s"] / out["rlimits"]["episodes_per_s"]
    out["setup"] = {"prompts": args.prompts, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                    "threads": torch.get_num_threads()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
