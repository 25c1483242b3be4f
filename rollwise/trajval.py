"""TrajVal: per-source learnability of a `[[data.mix]]` run from a short probe run and two endpoint evaluations,
turned into the mixture's sampling weights (`rollwise trajval RECIPE --probe-steps N`).

    probe   : the recipe's run for N steps with every source at weight 1, held-out evaluation at step 0 and N
    gain_i  = acc_i(N) - acc_i(0)                       (eval/<source>/<metric>_accuracy of the two evaluations)
    L_i     = max(gain_i, 0)                            (learnability: the positive response to training)
    prior_i = (L_i + floor) / mean_j (L_j + floor)      (mean 1; floor > 0 keeps every source in the mixture)
    weight_i = recipe weight_i x prior_i                (a multiplicative prior on the recipe's weights)

Written to RUN_DIR: `trajval.json` (the endpoints, gains, learnability, prior and weight of each source) and
`trajval.toml` (the recipe, resolved, with those weights: `rollwise train RUN_DIR/trajval.toml`); the
`[[data.mix]]` tables with the new weights are printed.

Paper: TrajVal (task learnability for RL post-training; see the seeds' abstracts): learnability is "a
regime-conditional measure of expected positive response to continued training", distinct from current
solvability (pass rate), and TrajVal approximates it per task "from a short probe run and two endpoint
evaluations", used "as a standalone static prior for task sampling or as a multiplicative prior for existing
online schedulers". The abstract gives no estimator formula; what is filled in here, and why:
- The probe gives every source the same weight, so each source's gain is measured under the same exposure (with
  the recipe's weights a heavily weighted source would look more learnable only because it was trained more).
  It keeps every other setting of the recipe (the "fixed RL post-training regime" learnability is relative to).
- Learnability is the positive part of the held-out gain between the two endpoints: the expected *positive*
  response; a source that got worse or stayed flat has learnability 0, not a negative weight. The gain is not
  divided by the headroom (1 - start): the abstract separates learnability from how solvable a task is now.
- The prior multiplies the recipe's weights (with equal recipe weights it is the standalone static prior); rollwise
  has no online mixture scheduler for the multiplicative use. `floor` (default 0.05, in accuracy units) is the
  learnability a flat source is credited with, so that it still gets prompts: two endpoint evaluations on a few
  held-out prompts are noisy, and a weight of 0 would drop a source for good on one unlucky probe.
- The held-out accuracy is the sampled accuracy by default (`--metric greedy` for the greedy one): it averages
  over the evaluation's samples, the greedy one moves in steps of 1/n.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rollwise.config import Config
from rollwise.config_toml import _toml_value, to_toml
from rollwise.errors import UserError

METRICS = ("sampled", "greedy")
DEFAULT_FLOOR = 0.05


class TrajValError(UserError, ValueError):
    """A recipe or probe run TrajVal cannot value (the message says what to change)."""


def learnability_weights(start: dict[str, float], end: dict[str, float], recipe_weights: dict[str, float],
                         floor: float = DEFAULT_FLOOR) -> dict[str, dict[str, float]]:
    """Per source: start, end, gain, learnability, prior and weight (module docstring). Plain floats."""
    if not (floor > 0.0 and math.isfinite(floor)):
        raise TrajValError(f"--floor {floor}: must be a finite number > 0 (the learnability a flat source keeps)")
    learn = {name: max(end[name] - start[name], 0.0) for name in recipe_weights}
    mean = sum(v + floor for v in learn.values()) / len(learn)
    out = {}
    for name, weight in recipe_weights.items():
        prior = (learn[name] + floor) / mean
        out[name] = {"start": start[name], "end": end[name], "gain": end[name] - start[name],
                     "learnability": learn[name], "prior": prior, "recipe_weight": weight, "weight": weight * prior}
    return out


def endpoint_accuracies(rows: list[dict], names: list[str], metric: str = "sampled"
                        ) -> tuple[int, dict[str, float], int, dict[str, float]]:
    """(first eval step, accuracy by source, last eval step, accuracy by source) from a run's metrics rows, read
    from `eval/<source>/<metric>_accuracy`. TrajValError when the run has fewer than two evaluations or a
    source has no accuracy in one of them."""
    evals = [r for r in rows if r.get("kind") == "eval"]
    if len(evals) < 2 or evals[0]["step"] == evals[-1]["step"]:
        raise TrajValError(f"the probe run has {len(evals)} evaluation(s); TrajVal needs one at step 0 and one at "
                           "the end: keep eval.n > 0 and --probe-steps >= 1")
    first, last = evals[0], evals[-1]

    def read(row: dict) -> dict[str, float]:
        values = {}
        for name in names:
            value = row.get(f"eval/{name}/{metric}_accuracy")
            if value is None:
                raise TrajValError(f"the evaluation at step {row['step']} has no eval/{name}/{metric}_accuracy "
                                   f"(source {name!r} got no scored held-out prompt): raise eval.n or that "
                                   "source's eval_size")
            values[name] = float(value)
        return values

    return first["step"], read(first), last["step"], read(last)


def probe_config(cfg: Config, probe_steps: int) -> Config:
    """The probe run's config: the recipe with every source at weight 1, `probe_steps` steps, evaluations only
    at step 0 and at the end, no intermediate or best checkpoints, no report."""
    mix = [entry.model_copy(update={"weight": 1.0}) for entry in cfg.data.mix]
    return cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"mix": mix}),
        "train": cfg.train.model_copy(update={"steps": probe_steps, "early_stop": None, "keep_best": False}),
        "eval": cfg.eval.model_copy(update={"at_start": True, "every_steps": 0}),
        "run": cfg.run.model_copy(update={"save_every_steps": 0, "report": False}),
    })


def weighted_config(cfg: Config, weights: dict[str, float]) -> Config:
    """`cfg` with each `[[data.mix]]` table's weight replaced by `weights[name]` (rounded to 4 digits)."""
    mix = [entry.model_copy(update={"weight": round(weights[entry.name], 4)}) for entry in cfg.data.mix]
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"mix": mix})})


def check_recipe(cfg: Config, probe_steps: int, metric: str) -> None:
    """TrajValError naming what to change when the recipe cannot be valued."""
    if len(cfg.data.mix) < 2:
        raise TrajValError("rollwise trajval values the sources of a mixture: the recipe needs at least two "
                           "[[data.mix]] tables")
    if probe_steps < 1:
        raise TrajValError(f"--probe-steps {probe_steps}: give at least 1 step")
    if metric not in METRICS:
        raise TrajValError(f"--metric {metric!r}: valid: {', '.join(METRICS)}")
    if metric == "greedy" and not cfg.eval.greedy:
        raise TrajValError("--metric greedy needs eval.greedy = true")
    if cfg.eval.n < 2 * len(cfg.data.mix):
        raise TrajValError(f"eval.n = {cfg.eval.n}: TrajVal reads each source's held-out accuracy; give eval.n >= "
                           f"{2 * len(cfg.data.mix)} (at least 2 prompts per source; more is less noisy)")


def mix_tables(cfg: Config) -> str:
    """The `[[data.mix]]` tables of `cfg` as TOML (name, weight, then the table's other set keys)."""
    lines = []
    for entry in cfg.data.mix:
        keys = entry.model_dump(mode="json", exclude_none=True, exclude_defaults=True,
                                exclude={"name", "weight", "mix"})
        lines += ["[[data.mix]]", f"name = {_toml_value(entry.name)}", f"weight = {_toml_value(entry.weight)}"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    return "\n".join(lines)


def run_trajval(cfg: Config, probe_steps: int, run_dir: Path, floor: float = DEFAULT_FLOOR,
                metric: str = "sampled") -> dict:
    """Run the probe in `run_dir`, value each source, write `trajval.json` and `trajval.toml` there; returns the
    JSON record (its `toml` entry is the path of the weighted recipe)."""
    from rollwise.loop import train
    from rollwise.validate import validate

    check_recipe(cfg, probe_steps, metric)
    learnability_weights({"a": 0.0}, {"a": 0.0}, {"a": 1.0}, floor)  # a bad floor fails before the probe runs
    train(validate(probe_config(cfg, probe_steps)), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    names = [entry.name for entry in cfg.data.mix]
    step0, start, step1, end = endpoint_accuracies(rows, names, metric)
    sources = learnability_weights(start, end, {e.name: float(e.weight) for e in cfg.data.mix}, floor)
    weighted = weighted_config(cfg, {name: s["weight"] for name, s in sources.items()})
    (run_dir / "trajval.toml").write_text(
        f"# TrajVal weights from a {probe_steps}-step probe ({run_dir}): rollwise train {run_dir}/trajval.toml\n"
        + to_toml(weighted))
    record = {"method": "trajval", "probe_steps": probe_steps, "eval_steps": [step0, step1],
              "metric": f"eval/<source>/{metric}_accuracy", "floor": floor, "run_dir": str(run_dir),
              "toml": str(run_dir / "trajval.toml"), "mix_tables": mix_tables(weighted), "sources": sources}
    (run_dir / "trajval.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
