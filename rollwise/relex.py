"""RELEX (REinforcement Learning EXtrapolation): a checkpoint at a later step from a run's early checkpoints.

The abstract: RLVR weight trajectories are low-rank and predictable; most of the gain lies in a rank-1
approximation of the parameter deltas, whose magnitude grows near-linearly with the step. RELEX estimates the
rank-1 subspace from a short observation window and extrapolates future checkpoints by linear regression.

`rollwise extrapolate RUN --to STEP [--observe S]`: the observation window is RUN's saved checkpoints
(`checkpoints/step-N`, N <= S; at least two), theta_0 is RUN's starting model (`model.name` of RUN/config.toml).
For every weight tensor (flattened, d entries), with deltas M = [theta_n - theta_0 for each observed n] ([K, d]):

    v  = the top right singular vector of M        (via the K x K Gram matrix M M^T: K << d)
    c_n = <theta_n - theta_0, v>                   the deltas' coordinates on it ([K])
    c_n ~ a + b n                                  least squares over the observed steps n
    theta_STEP = theta_0 + (a + b STEP) v

as the paper's released code does (per tensor, rank 1, linear fit; we regress on the step numbers themselves,
so checkpoints need not be evenly spaced). The result is written as an HF model directory (default
RUN/extrapolated/step-STEP) with `relex.json` (the steps used and the variance the rank-1 direction explains), and
is evaluated like any checkpoint: `rollwise eval --model RUN/extrapolated/step-STEP`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rollwise.errors import UserError


class RelexError(UserError, ValueError):
    """A run that cannot be extrapolated (too few checkpoints, no full weights, a bad step); one line."""


def rank1_extrapolate(base: torch.Tensor, deltas: torch.Tensor, steps: torch.Tensor, target: float
                      ) -> tuple[torch.Tensor, float]:
    """(theta_target [d], explained variance of the rank-1 direction) from theta_0 `base` [d], `deltas` [K, d]
    (theta_n - theta_0) at `steps` [K] (K >= 2 distinct steps); see the module docstring. A tensor that never
    moved comes back unchanged (explained variance 0)."""
    m = deltas.double()
    gram = m @ m.T  # [K, K]
    values, vectors = torch.linalg.eigh(gram)  # ascending
    top = float(values[-1].clamp(min=0))
    total = float(values.clamp(min=0).sum())
    if top <= 0.0:
        return base.clone(), 0.0
    direction = m.T @ vectors[:, -1] / top ** 0.5  # [d], unit norm
    coords = m @ direction  # [K]
    n = steps.double()
    slope = float(((n - n.mean()) * (coords - coords.mean())).sum() / ((n - n.mean()) ** 2).sum())
    intercept = float(coords.mean()) - slope * float(n.mean())
    predicted = base.double() + (intercept + slope * target) * direction
    return predicted.to(base.dtype), top / total


def _tensor_files(ckpt: Path) -> dict[str, Path]:
    """Weight name -> the safetensors file of `ckpt` that holds it."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files or all(f.name.startswith("adapter") for f in files):
        raise RelexError(f"{ckpt} holds no full model weights (a LoRA run saves adapters): RELEX extrapolates "
                         "full-weight runs")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            out.update({key: f for key in handle.keys()})
    return out


def observed_checkpoints(run_dir: Path, observe: int | None) -> list[tuple[int, Path]]:
    """(step, checkpoint) of RUN's complete checkpoints with step <= `observe` (all when None), oldest first."""
    from rollwise.train.checkpoint import list_checkpoints

    found = [(int(p.name.split("-", 1)[1]), p) for p in list_checkpoints(run_dir)]
    window = [(n, p) for n, p in found if observe is None or n <= observe]
    if len(window) < 2:
        have = ", ".join(str(n) for n, _ in found) or "none"
        raise RelexError(f"{run_dir}: RELEX needs at least 2 checkpoints in the observation window (steps saved: "
                         f"{have}); save more often (run.save_every_steps) or raise --observe")
    return window


def extrapolate_run(run_dir: Path, to_step: int, observe: int | None = None, out: Path | None = None) -> Path:
    """Write RUN's rank-1 extrapolation to step `to_step` as an HF model directory; returns its path."""
    from safetensors import safe_open

    from rollwise.config_load import load_config
    from rollwise.models import load_model

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise RelexError(f"{run_dir} is not a run directory (no config.toml)")
    window = observed_checkpoints(run_dir, observe)
    if to_step <= window[-1][0]:
        print(f"rollwise: --to {to_step} is inside the observation window (steps {window[0][0]}-{window[-1][0]}): "
              "this is RELEX's rank-1 reconstruction, not an extrapolation", flush=True)
    model, tokenizer = load_model(load_config(run_dir / "config.toml").model.name, dtype=torch.float32)
    base = model.state_dict()
    files = [_tensor_files(p) for _, p in window]
    steps = torch.tensor([float(n) for n, _ in window])
    explained: dict[str, float] = {}
    handles, written = {}, set()
    try:
        for name in files[-1]:
            if name not in base:
                raise RelexError(f"{window[-1][1]} holds {name!r}, which the starting model has not")
            if base[name].data_ptr() in written:  # a tied weight, already extrapolated under its other name
                continue
            written.add(base[name].data_ptr())
            rows = []
            for f in files:
                handle = handles.setdefault(f[name], safe_open(str(f[name]), "pt"))
                rows.append(handle.get_tensor(name).float().flatten())
            theta0 = base[name].float().flatten()
            predicted, explained[name] = rank1_extrapolate(theta0, torch.stack(rows) - theta0, steps, float(to_step))
            with torch.no_grad():
                base[name].copy_(predicted.view_as(base[name]).to(base[name].dtype))
    finally:
        handles.clear()
    out = Path(out) if out is not None else run_dir / "extrapolated" / f"step-{to_step}"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    moved = [v for v in explained.values() if v > 0]
    info = {"to_step": to_step, "observed_steps": [n for n, _ in window], "tensors": len(explained),
            "explained_variance_mean": sum(moved) / len(moved) if moved else 0.0}
    (out / "relex.json").write_text(json.dumps(info, indent=1) + "\n")
    return out
