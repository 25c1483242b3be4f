"""Sandbox cost per execution, and the base model's pass rate on `pyexec`.

Cost (default): the cold start of `print(1)`, `--runs` times per side, sides interleaved (A B C A B C ...) so
load on a shared machine hits each alike: bubblewrap (`rollwise.sandbox.run`, backend "bwrap"), the fallback
(backend "rlimits": pool uid + rlimits + temp dir), and plain `/usr/bin/python3 -c 'print(1)'` via subprocess.
Median and p95 wall seconds per side, JSON on stdout.

    python benchmarks/sandbox.py [--runs 200]

Pass rate (`--pass-rate N`): the embedded SmolLM2-135M-Instruct on the first N held-out `pyexec` problems, as
two-turn episodes (execution feedback after a failure, `rollwise.envs.episode.run_episodes`), greedy and at
T=1 (one sample each), `max_new_tokens` 192 per turn; reports the share whose code passes EVERY test of the
row (the visible ones the episode ran and the hidden ones) after turn 1 and at the end (`sample.correct`),
the share passing at least one test at the end (what the figure read before `correct` was fixed), the mean
pass rate of the final code (the `code_tests` value) and how often any code was found.

    python benchmarks/sandbox.py --pass-rate 30

Scoring time (`--scoring N`): one `code_tests` scoring of a right 5-assert solution through `score_batch`,
N times; median and p95 wall seconds (one sandbox run each).

    python benchmarks/sandbox.py --scoring 100
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
    from rollwise.data.sources import build_prompt_source
    from rollwise.envs.episode import EpisodeCodec, run_episodes
    from rollwise.envs.pyexec import PyExecEnv
    from rollwise.generate.torch_engine import TorchEngine
    from rollwise.models import load_model
    from rollwise.rewards import REWARDS, score_samples
    from rollwise.generate.groups import new_groups
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
        first = [passes_all(s.tool_calls[0].args["code"], s.prompt.info["tests"]) if s.tool_calls else False
                 for s in samples]
        out[name] = {"solved_turn1": sum(first) / n, "solved_final": sum(bool(s.correct) for s in samples) / n,
                     "any_test_passed_final": sum((s.reward or 0.0) > 0 for s in samples) / n,
                     "mean_pass_rate_final": metrics.get("reward/mean"),
                     "code_found_any_turn": sum(bool(s.tool_calls) for s in samples) / n,
                     "turns_mean": sum(s.episode.assistant_turns for s in samples) / n,
                     "sandbox_s_total": sum(s.episode.sandbox_s for s in samples),
                     "wall_s": time.perf_counter() - start,
                     "example_final": samples[0].response_text[:400]}
    return out


def passes_all(code: str, tests: list[str]) -> bool:
    """Whether `code` passes every one of `tests` (visible and hidden), in one sandbox run."""
    from rollwise.rewards.code import run_tests

    outcome = run_tests(code, tests)
    return outcome.total > 0 and outcome.passed == outcome.total


def scoring_time(runs: int) -> dict:
    """Wall seconds of one `code_tests` scoring (a right solution, 5 asserts) through `score_batch`."""
    from rollwise.rewards import REWARDS, score_batch
    from rollwise.types import Prompt, Sample, Status

    tests = ["assert f([1, 2, 3]) == [3, 6, 9]", "assert f([]) == []", "assert f([-1, 0]) == [-3, 0]",
             "assert f([10]) == [30]", "assert f([2, 2]) == [6, 6]"]
    prompt = Prompt(uid="p", messages=[], answer=None, source="bench", info={"tests": tests})
    reward, times = REWARDS.get("code_tests"), []
    for i in range(runs + 1):
        sample = Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                        status=Status.COMPLETED, group_id=0,
                        response_text="```python\ndef f(xs):\n    return [x * 3 for x in xs]\n```")
        start = time.perf_counter()
        score_batch([sample], reward)
        if i:  # the first run pays the bubblewrap probe
            times.append(time.perf_counter() - start)
        assert sample.correct, sample.reward_error
    return {"runs": runs, "unit": "s", "median": statistics.median(times), "p95": percentile(times, 0.95),
            "min": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--pass-rate", type=int, default=0, metavar="N",
                        help="measure the base model on N held-out pyexec problems instead")
    parser.add_argument("--scoring", type=int, default=0, metavar="N",
                        help="time N code_tests scorings of a right solution instead")
    args = parser.parse_args()
    if args.pass_rate:
        print(json.dumps(pass_rate(args.pass_rate), indent=2))
    elif args.scoring:
        print(json.dumps(scoring_time(args.scoring), indent=2))
    else:
        print(json.dumps(cost(args.runs), indent=2))


if __name__ == "__main__":
    main()
