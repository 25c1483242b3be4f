"""A rollwise workload alone and beside CPU-bound competitors, with the old and the new thread choice.

The workload is a `rollwise eval` of the embedded SmolLM2-135M-Instruct on held-out `arith` prompts, sampled and
greedy (the step-0 evaluation of the default recipe, smaller), or with `--workload train` two RL steps of
recipes/quickstart.toml with a small evaluation. Each run is a fresh `.venv/bin/rollwise` subprocess. Competitors,
started before the run and killed after it: `loop`, a `python -c "while True: pass"` (one core each), and `torch`,
a torch job of small matmuls on 2 OpenMP threads (what another user's training or test run looks like).

    python benchmarks/shared_machine.py [--workload eval|train] [--n 24] [--repeats 2] [--timeout-s 120]
        [--competitors loop:1,loop:2,torch:1]

Variants: `old` is `ROLLWISE_THREADS=cores` (one torch thread per physical core, as before), `new` the default
(threads from the cores other processes leave free, `rollwise/hardware.py`). The alone case is run `--repeats`
times per variant, alternating, and the fastest kept (other users of the machine only ever slow a run down).
Printed: the exact commands, the machine's load average, and per variant and competitor count the wall time,
the threads chosen and the slowdown against the same variant alone. A run past `--timeout-s` is killed and
shown as `>TIMEOUT`. For a CPU-bound job, one competitor on 2 cores leaves it about half the machine: ~2x is
in proportion.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollwise.hardware import physical_cores

ROOT = Path(__file__).resolve().parent.parent
ROLLWISE = str(ROOT / ".venv" / "bin" / "rollwise")
VARIANTS = {"old": {"ROLLWISE_THREADS": "cores"}, "new": {"ROLLWISE_THREADS": "auto"}}
COMPETITORS = {  # a pure-Python busy loop (one core), and a torch job on 2 OpenMP threads (another user's training)
    "loop": [sys.executable, "-c", "while True: pass"],
    "torch": [sys.executable, "-c", "import torch\ntorch.set_num_threads(2)\n"
              "x, w = torch.randn(64, 576), torch.randn(576, 576)\nwhile True: (x @ w).relu_()"],
}


def workload_command(workload: str, n: int, run_dir: Path) -> list[str]:
    if workload == "eval":
        return [ROLLWISE, "eval", "--model", "smollm2-135m-instruct", "--n", str(n), "--max-new-tokens", "48"]
    return [ROLLWISE, "train", str(ROOT / "recipes" / "quickstart.toml"), "--run-dir", str(run_dir),
            "train.steps=2", "eval.n=" + str(n), "eval.every_steps=0", "run.save_every_steps=0", "run.console=false"]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_once(cmd: list[str], variant: str, kind: str, competitors: int, timeout_s: float) -> dict:
    """One workload run beside `competitors` processes of `kind`; wall seconds (None past `timeout_s`), threads."""
    env = {**os.environ, **VARIANTS[variant]}
    busy = [subprocess.Popen(COMPETITORS[kind], env={**os.environ, "ROLLWISE_THREADS": "auto"})
            for _ in range(competitors)]
    try:
        time.sleep({"loop": 0.5, "torch": 3.0}[kind] if competitors else 0.0)  # started (torch imported), placed
        load = loadavg()
        start = time.perf_counter()
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            wall_s = time.perf_counter() - start
            if out.returncode != 0:
                raise SystemExit(f"{shlex.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
        except subprocess.TimeoutExpired as timeout:
            wall_s, out = None, timeout
    finally:
        for p in busy:
            p.kill()
            p.wait()
    stderr = out.stderr if isinstance(out.stderr, str) else (out.stderr or b"").decode(errors="replace")
    found = re.search(r"rollwise: threads: (\d+) of (\d+) cores", stderr)
    threads = found.group(1) if found else str(physical_cores())  # no note: one thread per core
    return {"variant": variant, "competitors": f"{competitors} {kind}" if competitors else "0",
            "wall_s": wall_s, "threads": threads, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("eval", "train"), default="eval")
    parser.add_argument("--n", type=int, default=24, help="held-out prompts evaluated")
    parser.add_argument("--repeats", type=int, default=2, help="alone runs per variant (the fastest is kept)")
    parser.add_argument("--competitors", default="loop:1,loop:2,torch:1",
                        help="KIND:COUNT,... to run beside (kinds: loop, torch)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a run past this is killed")
    parser.add_argument("--variants", default="old,new")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the workload and competitors are killed
    variants = args.variants.split(",")
    counts = [(kind, int(k)) for kind, _, k in (c.partition(":") for c in args.competitors.split(",") if c)]
    cmd = workload_command(args.workload, args.n, Path("/tmp") / f"rollwise-shared-machine-{os.getpid()}")
    print(f"workload: {shlex.join(cmd)}")
    print("variants: " + "; ".join(f"{v}: {' '.join(f'{k}={x}' for k, x in VARIANTS[v].items())}" for v in variants))
    for kind, argv in COMPETITORS.items():
        print(f"competitor {kind}: {shlex.join(argv)}")
    print(f"cores: {os.cpu_count()}; load average at start: {loadavg()}")
    rows = []
    for _ in range(args.repeats):
        for variant in variants:
            rows.append(run_once(cmd, variant, "loop", 0, args.timeout_s))
            print(f"  {variant} alone: {rows[-1]['wall_s']}", flush=True)
    for kind, k in counts:
        for variant in variants:
            rows.append(run_once(cmd, variant, kind, k, args.timeout_s))
            print(f"  {variant} beside {k} {kind}: {rows[-1]['wall_s']}", flush=True)
    print_table(rows, variants, counts, args.timeout_s)
    print(f"load average at end: {loadavg()}")


def print_table(rows: list[dict], variants: list[str], counts: list[tuple[str, int]], timeout_s: float) -> None:
    def fmt(s):
        return f">{timeout_s:.0f}" if s is None else f"{s:.1f}"

    print(f"\n| variant | competitors | threads | wall s | slowdown vs alone | load avg (1 min) before |")
    print("|---|---|---|---|---|---|")
    for variant in variants:
        alone = [r for r in rows if r["variant"] == variant and r["competitors"] == "0"]
        times = [r["wall_s"] for r in alone if r["wall_s"] is not None]
        best = min(times) if times else None
        pick = min(alone, key=lambda r: r["wall_s"] if r["wall_s"] is not None else float("inf"))
        print(f"| {variant} | 0 (best of {len(alone)}: {', '.join(fmt(r['wall_s']) for r in alone)}) | "
              f"{pick['threads']} | {fmt(best)} | 1.00 | {pick['load'].split()[0]} |")
        for kind, k in counts:
            for r in (r for r in rows if r["variant"] == variant and r["competitors"] == f"{k} {kind}"):
                ratio = "n/a" if best is None else (f">{timeout_s / best:.1f}" if r["wall_s"] is None
                                                    else f"{r['wall_s'] / best:.2f}")
                print(f"| {variant} | {r['competitors']} | {r['threads']} | {fmt(r['wall_s'])} | {ratio} | "
                      f"{r['load'].split()[0]} |")


if __name__ == "__main__":
    main()
