"""Distillation guards (issue 13): cheap per-step metrics that show on-policy distillation (OPD) going wrong.

- `repetition_rate(responses, n)`: the share of n-grams that repeat one seen earlier in the same response.
- `gap_metrics(gap, mask, entropy)`: where in the responses the student/teacher gap `logp_s - logp_t` sits
  (by relative position) and whether it sits at high-entropy "forking" tokens.
- `CollapseGuard`: alarms (optionally stops the run) on "truncation collapse", the OPD failure that the
  StableOPD paper describes (length inflation and repetition in on-policy distillation): responses inflate in length and saturate with repeated n-grams until
  truncated trajectories dominate the batch. The thresholds and the alarm rule are ours, not the paper's.

Pure functions on token lists and `[N, T]` tensors (N responses by T response positions); no model.
"""

from __future__ import annotations

import math

import torch

from rollwise.types import Sample

from rollwise.errors import UserError

PREFIX = "distill/"


def repetition_rate(responses: list[list[int]], n: int = 4) -> float:
    """Fraction of all n-grams, over every response, that repeat an n-gram seen EARLIER IN THE SAME response.

    A response of length L holds `L - n + 1` n-grams (none when L < n); the first occurrence of an n-gram never
    counts as a repeat, every later one does. `[[1, 2, 1, 2, 1]]` with n=2: grams 12, 21, 12, 21 -> 2 / 4 = 0.5.
    0.0 when there are no n-grams at all. StableOPD's repetition saturation drives
    this towards 1 as responses loop until `max_new_tokens`.
    """
    if n < 1:
        raise ValueError(f"repetition_rate: n={n}; the n-gram size must be at least 1")
    repeats = total = 0
    for tokens in responses:
        seen: set[tuple[int, ...]] = set()
        for start in range(len(tokens) - n + 1):
            gram = tuple(tokens[start:start + n])
            repeats += gram in seen
            seen.add(gram)
            total += 1
    return repeats / total if total else 0.0


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Length of each response `[N, T] -> [N]` (long): the number of positions up to and including its LAST
    masked token (0 for a row without any). Holes in the mask (tool-output tokens inside a multi-turn
    response) still count as positions, so relative positions follow the response as generated."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # [T]
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(dim=-1)  # [N]


def _check_shapes(gap: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None,
                  top_frac: float, buckets: int) -> None:
    if gap.dim() != 2 or gap.shape != mask.shape:
        raise ValueError(f"gap_metrics: gap {tuple(gap.shape)} and mask {tuple(mask.shape)} must both be [N, T]")
    if entropy is not None and entropy.shape != gap.shape:
        raise ValueError(f"gap_metrics: entropy {tuple(entropy.shape)} must match gap {tuple(gap.shape)}")
    if not 0.0 < top_frac <= 1.0 or buckets < 1:
        raise ValueError(f"gap_metrics: top_frac={top_frac} must be in (0, 1] and buckets={buckets} at least 1")


def gap_metrics(gap: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None = None,
                top_frac: float = 0.1, buckets: int = 4) -> dict[str, float]:
    """Where the student/teacher gap lies. `gap`, `mask`, `entropy`: `[N, T]`; returns plain floats.

    `gap` is `logp_student - logp_teacher` of the sampled tokens; `mask` is 1 on the tokens that are scored.
    - `distill/gap_mean`: masked mean of the gap, a sampled estimate of KL(student || teacher) per token.
    - `distill/gap_pos_q{i}` (i = 1..buckets): masked mean over the tokens whose relative position
      `t / L` (t from 0, L from `response_lengths`) falls in bucket i, i.e. `floor(t * buckets / L) = i - 1`;
      a bucket without tokens is absent. A gap growing towards the end is the StableOPD signature of a student
      drifting into long, repeated tails.
    - with `entropy` (the student's per-token entropy): `distill/entropy_mean` (masked mean) and
      `distill/entropy_at_top_gap`, the mean entropy over the `top_frac` share of masked tokens with the
      largest |gap| (`max(1, floor(top_frac * tokens))` of them; ties broken by `torch.topk`). Above
      `entropy_mean` says the gap sits at high-entropy "forking" tokens (the privileged
      self-distillation study: privileged context reshapes learning at high-entropy forking positions);
      below it says it sits at confident tokens where the student is wrong.
    With no masked token at all nothing is returned ({}): no gap was measured, and a 0.0 would read as "the
    student matches the teacher". The trainer calls this once per step over the whole batch
    (`rollwise.distill.terms.StepRecord`), so the top share is the batch's, not a micro-batch's.
    """
    _check_shapes(gap, mask, entropy, top_frac, buckets)
    on = mask > 0  # [N, T]
    gap = gap.detach().float()
    count = int(on.sum())
    if count == 0:
        return {}
    out = {PREFIX + "gap_mean": float(gap[on].mean())}
    lengths = response_lengths(mask)  # [N]
    positions = torch.arange(gap.shape[-1], device=gap.device)  # [T]
    bucket = (positions[None, :] * buckets) // lengths.clamp(min=1)[:, None]  # [N, T], in 0..buckets-1 on `on`
    for index in range(buckets):
        chosen = on & (bucket == index)  # [N, T]
        if chosen.any():
            out[f"{PREFIX}gap_pos_q{index + 1}"] = float(gap[chosen].mean())
    if entropy is not None:
        scored_entropy = entropy.detach().float()[on]  # [count]
        top = max(1, math.floor(top_frac * count))
        largest = gap[on].abs().topk(top).indices  # [top]
        out[PREFIX + "entropy_mean"] = float(scored_entropy.mean())
        out[PREFIX + "entropy_at_top_gap"] = float(scored_entropy[largest].mean())
    return out


class CollapseError(UserError, RuntimeError):
    """Raised by `CollapseGuard(stop=True)` on a truncation-collapse alarm; the message says what to change."""


class CollapseGuard:
    """Per-step truncation-collapse alarm for OPD (after StableOPD; the rule and thresholds are ours).

    The baseline length is the mean of `mean_len` over the first `window_steps` steps observed (of the steps
    seen so far before that). `len_rise = mean_len / baseline - 1`. A step alarms when ALL hold: at least
    `window_steps` steps seen; `len_rise > length_rise`; `repetition_rate > repetition`; and either
    `truncated_frac > truncated` or `repetition_rate > 2 * repetition` (looping hard, truncated or not).
    Every alarming step returns `distill/collapse_alarm = 1.0`; the first one prints one line to stdout;
    `stop=True` raises `CollapseError` with that line instead of training on. `state_dict()` is json-able, so
    a resumed run keeps its baseline and alarms exactly where the uninterrupted run would.
    """

    def __init__(self, window_steps: int = 5, length_rise: float = 0.5, repetition: float = 0.2,
                 truncated: float = 0.5, stop: bool = False) -> None:
        if window_steps < 1:
            raise ValueError(f"CollapseGuard: window_steps={window_steps} must be at least 1")
        self.window_steps, self.length_rise, self.repetition = window_steps, length_rise, repetition
        self.truncated, self.stop = truncated, stop
        self.baseline_lens: list[float] = []
        self.steps_seen = 0
        self.alarmed = False

    def observe(self, step: int, mean_len: float, repetition_rate: float, truncated_frac: float) -> dict[str, float]:
        """Record one step (mean response length in tokens, `repetition_rate`, share of truncated responses)."""
        if len(self.baseline_lens) < self.window_steps:
            self.baseline_lens.append(float(mean_len))
        self.steps_seen += 1
        baseline = sum(self.baseline_lens) / len(self.baseline_lens)
        len_rise = mean_len / baseline - 1.0 if baseline > 0 else 0.0
        alarm = (self.steps_seen >= self.window_steps and len_rise > self.length_rise
                 and repetition_rate > self.repetition
                 and (truncated_frac > self.truncated or repetition_rate > 2 * self.repetition))
        if alarm:
            line = self._message(step, mean_len, baseline, len_rise, repetition_rate, truncated_frac)
            if not self.alarmed:
                print(line, flush=True)
            self.alarmed = True
            if self.stop:
                raise CollapseError(line)
        return {PREFIX + "collapse_alarm": 1.0 if alarm else 0.0, PREFIX + "len_rise": float(len_rise)}

    def _message(self, step: int, mean_len: float, baseline: float, len_rise: float,
                 repetition_rate: float, truncated_frac: float) -> str:
        return (f"rollwise: step {step}: truncation collapse: mean response length {mean_len:.1f} tokens is "
                f"{len_rise:+.0%} over the first {len(self.baseline_lens)} steps' {baseline:.1f} (limit "
                f"{self.length_rise:+.0%}), repetition rate {repetition_rate:.2f} (limit {self.repetition:.2f}), "
                f"truncated {truncated_frac:.2f} (limit {self.truncated:.2f}); lower distill.coef, set "
                f"algo.kl_coef > 0 to hold the student to the reference, or change teacher.temperature")

    def state_dict(self) -> dict:
        """Plain json-able state: the baseline lengths, the steps seen and whether the alarm has fired."""
        return {"baseline_lens": list(self.baseline_lens), "steps_seen": self.steps_seen, "alarmed": self.alarmed}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output (e.g. from a checkpoint's json)."""
        missing = [key for key in ("baseline_lens", "steps_seen", "alarmed") if key not in state]
        if missing:
            raise ValueError(f"CollapseGuard.load_state_dict: state lacks {missing}; pass the dict state_dict() saved")
        self.baseline_lens = [float(length) for length in state["baseline_lens"]][: self.window_steps]
        self.steps_seen = int(state["steps_seen"])
        self.alarmed = bool(state["alarmed"])


class Guards:
    """The run's guards (`[distill] guard_*`): per-step guard metrics of the responses (`rollout/repetition_rate`) and the truncation-collapse alarm."""

    def __init__(self, cfg) -> None:
        d = cfg.distill
        self.collapse = CollapseGuard(window_steps=d.guard_window_steps, length_rise=d.guard_length_rise,
                                      repetition=d.guard_repetition)  # the loop stops (after a checkpoint)
        self.stop = d.guard_stop

    def alarmed(self, row: dict) -> bool:
        """This step's row raised the collapse alarm and `distill.guard_stop` asks to stop on it."""
        return self.stop and row.get("distill/collapse_alarm") == 1.0

    def check_stop(self, step: int, row: dict) -> None:
        """`distill.guard_stop`: CollapseError when this step's row raised the alarm (the loop saved first)."""
        if self.stop and row.get("distill/collapse_alarm") == 1.0:
            raise CollapseError(f"step {step}: stopped at the truncation-collapse alarm (distill.guard_stop = true; "
                                f"mean length {row.get('rollout/response_len_mean', 0):.1f}, repetition rate "
                                f"{row.get('rollout/repetition_rate', 0):.2f}); the checkpoint of this step is saved")

    def observe(self, step: int, samples: list[Sample], row: dict, alarm: bool = True) -> dict[str, float]:
        """`rollout/repetition_rate` (repeated 4-grams of the policy's tokens) of this step's responses; with
        `alarm` (teacher stages) the collapse guard's `distill/collapse_alarm` and `distill/len_rise` too."""
        responses = [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in samples]
        rate = repetition_rate(responses, n=4)
        out = {"rollout/repetition_rate": rate}
        if alarm and samples:
            out.update(self.collapse.observe(step, row.get("rollout/response_len_mean", 0.0), rate,
                                             row.get("rollout/truncated_frac", 0.0)))
        return out

    def state_dict(self) -> dict:
        return self.collapse.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.collapse.load_state_dict(state)
