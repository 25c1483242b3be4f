"""Sandbox cost per execution, and the base model's pass rate on `pyexec`.

Cost (default): the cold start of `print(1)`, `--runs` times per side, sides interleaved (A B C A B C ...) so
load on a shared machine hits each alike: bubblewrap (`rollwise.sandbox.run`, backend "bwrap"), the fallback
(backend "rlimits": pool uid + rlimits + temp dir), and plain `/usr/bin/python3 -c 'print(1)'` via subprocess.
Median and p95 wall seconds per side, JSON on stdout.

    python benchmarks/sandbox.py [--runs 200]

Pass rate (`--pass-rate N`): the embedded SmolLM2-135M-Instruct on the first N held-out `pyexec` problems, as
two-turn episodes (execution feedback after a failure, `rollwise.envs.episode.run_episodes`), greedy and at
T=1 (one sample each), `max_new_tokens` 192 per turn; reports the share passing every test after turn 1 and at
the end, the mean pass rate of the final code (the `code_tests` value) and how often any code was found.

    python benchmarks/sandbox.py --pass-rate 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import warnings
from itertools import count

from rollwise.sandbox import SYSTEM_PYTHON, run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def plain_python() -> None:
    subprocess.run([SYSTEM_PYTHON, "-c", "print(1)"], capture_output=True, check=True)


def cost(runs: int) -> dict:
    warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's warning: expected here
    sides = {
        "bwrap": lambda: run("print(1)\n", backend="bwrap"),
        "rlimits_fallback": lambda: run("print(1)\n", backend="rlimits"),
        "plain_python3": plain_python,
    }
    for fn in sides.values():  # warm-up (the bwrap probe, page cache)
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(runs):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {"runs": runs, "code": "print(1)", "unit": "s",
            "sides": {name: {"median": statistics.median(t), "p95": percentile(t, 0.95), "min": min(t)}
                      for name, t in times.items()}}


def pass_rate(n: int) -> dict:
    import torch

    from rollwise.config import EMBEDDED_MODEL, DataConfig
    from rollwise.data.prompts import encode_prompt
    from rollwise.data.tasks import build_prompt_source
    from rollwise.envs.episode import EpisodeCodec, run_episodes
    from rollwise.envs.pyexec import PyExecEnv
    from rollwise.generate.torch_engine import TorchEngine
    from rollwise.models import load_model
    from rollwise.rewards import REWARDS, score_samples
    from rollwise.rollout import new_groups
    from rollwise.types import SamplingParams

    torch.set_num_threads(2)
    model, tok = load_model(EMBEDDED_MODEL)
    task = build_prompt_source(DataConfig(task="pyexec"), seed=0)
    prompts = [(p, encode_prompt(p, tok, None)) for p in task.eval_prompts(n)]
    env, codec, reward = PyExecEnv(max_turns=2), EpisodeCodec(tok), REWARDS.get("code_tests")
    out: dict = {"model": EMBEDDED_MODEL, "problems": n, "max_turns": 2, "max_new_tokens": 192}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        groups = new_groups(prompts, 1, 0)
        start = time.perf_counter()
        run_episodes(TorchEngine(model, tok), groups, SamplingParams(max_new_tokens=192, temperature=temperature,
                     seed=0), count(), env, codec, max_episode_tokens=1024)
        samples = [s for g in groups for s in g.samples]
        metrics = score_samples(samples, reward)
        first = [bool(s.tool_calls) and s.tool_calls[0].result == "all tests passed" for s in samples]
        out[name] = {"solved_turn1": sum(first) / n, "solved_final": sum(bool(s.correct) for s in samples) / n,
                     "mean_pass_rate_final": metrics.get("reward/mean"),
                     "code_found_any_turn": sum(bool(s.tool_calls) for s in samples) / n,
                     "turns_mean": sum(s.episode.assistant_turns for s in samples) / n,
                     "sandbox_s_total": sum(s.episode.sandbox_s for s in samples),
                     "wall_s": time.perf_counter() - start,
                     "example_final": samples[0].response_text[:400]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--pass-rate", type=int, default=0, metavar="N",
                        help="measure the base model on N held-out pyexec problems instead")
    args = parser.parse_args()
    print(json.dumps(pass_rate(args.pass_rate) if args.pass_rate else cost(args.runs), indent=2))


if __name__ == "__main__":
    main()
