"""What a step decides about a sample stays with that step, in real tiny runs (tests/conftest.py):

- a sample Self-Routing sent to `self_distill` (reward weight 0) in a teacher stage and replayed in a later `rl`
  stage trains there with its stored reward advantage, not with 0;
- with `train.old_logprobs = "behaviour"` and top-p sampling, the OPD gap compares the teacher with the student's
  own untruncated log-probs, so `distill/teacher_kl` is the token-weighted mean of the per-sample gaps that
  `samples/step-N.jsonl` logs from `full_logprobs`.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from conftest import read_rows, tiny_overrides

from rollwise.validate import load
from rollwise.distill.terms import StepTerms
from rollwise.loop import train

TWO_STAGES = '\n[[stage]]\nkind = "opd"\nsteps = 1\n\n[[stage]]\nkind = "rl"\nsteps = 1\n'


def _recipe(tmp_path: Path, model_dir: Path, body: str, **overrides) -> Path:
    tables: dict[str, list[str]] = {}
    for item in tiny_overrides(model_dir, **overrides):
        key, _, value = item.partition("=")
        sec, name = key.split(".")
        tables.setdefault(sec, []).append(f"{name} = {value}")
    path = tmp_path / "recipe.toml"
    path.write_text("\n".join(f"[{sec}]\n" + "\n".join(lines) + "\n" for sec, lines in tables.items()) + body)
    return path


def _run(cfg, run_dir: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, run_dir)


def test_a_sample_routed_self_distill_trains_with_its_reward_advantage_when_replayed_in_an_rl_stage(
        tmp_path, tiny_model_dir, monkeypatch):
    from rollwise.train.terms import PolicyTerms

    seen = []  # (stage is a teacher stage, samples of the micro-batch, the advantages the policy loss got, routes)
    real_teacher, real_plain = StepTerms.advantages, PolicyTerms.advantages

    def spy_teacher(self, own_logp, mb, entropy=None):  # the opd stage's terms
        out = real_teacher(self, own_logp, mb, entropy)
        seen.append((self.teacher, list(mb.samples), out.detach().clone(),
                     {id(s): self.marks.routes.get(id(s), "") for s in mb.samples}))
        return out

    def spy_plain(self, own_logp, mb, entropy=None):  # the rl stage's: the plain policy terms, no marks
        out = real_plain(self, own_logp, mb, entropy)
        seen.append((False, list(mb.samples), out.detach().clone(), {id(s): "" for s in mb.samples}))
        return out

    monkeypatch.setattr(StepTerms, "advantages", spy_teacher)
    monkeypatch.setattr(PolicyTerms, "advantages", spy_plain)
    cfg = load(_recipe(tmp_path, tiny_model_dir, TWO_STAGES, **{
        "train.steps": 2, "teacher.weights": "base", "teacher.context": "hint", "distill.routing": "self_routing",
        "reward.fn": "toy_plugins:digit_fraction", "replay.kind": "hard_case", "replay.mix_ratio": 1.0,
        "replay.hard_reward_threshold": 2.0, "algo.is_correction": "tis_token", "eval.n": 0, "train.seed": 1}))
    _run(cfg, tmp_path / "run")
    key = lambda s: (s.group_id, tuple(s.response_ids))  # noqa: E731
    routes = {key(s): marks[id(s)] for teacher, samples, _, marks in seen if teacher for s in samples}
    assert "self_distill" in routes.values()  # the random model is unsure: wrong answers go to the teacher
    replayed = [(s, adv[i], marks[id(s)]) for teacher, samples, adv, marks in seen if not teacher
                for i, s in enumerate(samples) if s.replayed]
    routed = [(s, a, now) for s, a, now in replayed if routes.get(key(s)) == "self_distill" and s.advantage != 0]
    assert routed, "no sample routed self_distill with a nonzero advantage was replayed"
    for s, a, now in routed:  # the rl stage's advantage is the stored outcome advantage, weight 1
        assert float(a) == pytest.approx(s.advantage)
        assert now == ""  # the rl step did not route it: what the teacher step decided stayed there
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert rows[1]["replay/replayed_entries"] > 0


def test_the_opd_gap_uses_the_students_untruncated_logprobs_under_top_p(tmp_path, tiny_model_dir):
    cfg = load(None, tiny_overrides(tiny_model_dir, **{
        "teacher.weights": "base", "teacher.context": "hint", "train.old_logprobs": "behaviour",
        "rollout.top_p": 0.5, "rollout.samples_per_prompt": 2, "run.samples_logged_per_step": 100,
        "train.steps": 1, "eval.n": 0}))
    _run(cfg, tmp_path / "run")
    (row,) = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-1.jsonl").read_text().splitlines()]
    scored = [r for r in logged if r.get("teacher_tokens")]
    assert len(scored) == 8  # 4 prompts x 2 samples, each scored and trained
    tokens = sum(r["teacher_tokens"] for r in scored)
    expected = sum(r["teacher_gap_mean"] * r["teacher_tokens"] for r in scored) / tokens  # from full_logprobs
    assert row["mismatch/truncation_logprob_gap_mean"] > 0.1  # top-p moved the behaviour log-probs
    assert row["distill/teacher_kl"] == pytest.approx(expected, abs=1e-4)
    assert row["distill/gap_mean"] == pytest.approx(expected, abs=1e-4)
    assert torch.isfinite(torch.tensor(row["train/loss"]))


def test_the_gkd_loss_of_a_run_is_continuous_at_beta_zero(tmp_path, tiny_model_dir):
    # the first step's `distill/gkd` is measured before any update on the same samples (same seed), so runs at
    # beta = 0 (forward KL) and beta = 1e-4 differ only by the first-order term, 1e-4 x (KL - chi2 / 2) per token
    # (docs/algorithms.md): under 1% here. Unnormalised, the second would be 1e-4 times the first.
    from helpers_model import tiny_llama
    from helpers_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()  # a peaked teacher of other random weights, with the student's tokenizer
    teacher = tiny_llama(len(tok), seed=7, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(6.0)
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    values = {}
    for beta in (0.0, 1e-4):
        cfg = load(None, tiny_overrides(tiny_model_dir, **{
            "teacher.weights": str(tmp_path / "teacher"), "distill.objective": "gkd", "distill.gkd_beta": beta,
            "train.steps": 1, "eval.n": 0}))
        _run(cfg, tmp_path / f"run-{beta}")
        (row,) = [r for r in read_rows(tmp_path / f"run-{beta}") if r["kind"] == "train"]
        values[beta] = row["distill/gkd"]
    assert values[0.0] > 0.01
    assert values[1e-4] == pytest.approx(values[0.0], rel=1e-2)
