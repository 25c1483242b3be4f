"""Distillation in the loop: stages switch at their steps and resume mid-stage, SFT trains demonstrations, the
zero-variance filter keeps groups in teacher stages, Self-Routing and TRB show in the metrics, bad configs fail
with one line. Real tiny runs (tests/conftest.py) on real files."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_rows, tiny_overrides
from rollwise.validate import load
from rollwise.config import ConfigError
from rollwise.distill.routing import ROUTES, confidence, route, route_samples
from rollwise.distill.terms import StepMarks
from rollwise.loop import train
from rollwise.types import Prompt, Sample, Status


def _recipe(tmp_path: Path, model_dir: Path, body: str, **overrides) -> Path:
    """A recipe file: the tiny overrides as tables plus `body` (e.g. [[stage]] tables)."""
    tables: dict[str, list[str]] = {}
    for item in tiny_overrides(model_dir, **overrides):
        key, _, value = item.partition("=")
        sec, name = key.split(".")
        tables.setdefault(sec, []).append(f"{name} = {value}")
    text = "\n".join(f"[{sec}]\n" + "\n".join(lines) + "\n" for sec, lines in tables.items()) + body
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def _train(cfg, run_dir: Path, resume: bool = False) -> dict:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        summary = train(cfg, run_dir, resume=resume)
    summary["stdout"] = out.getvalue()
    return summary


def _demos(path: Path, n: int = 12) -> Path:
    rows = [{"prompt": f"What is {i} + 1?", "response": f"The answer is {i + 1}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


STAGES = """
[[stage]]
kind = "sft"
steps = 2
data = "{demos}"

[[stage]]
kind = "opd"
steps = 2
"""


def test_stages_switch_at_their_steps_and_each_trains_its_objective(tmp_path, tiny_model_dir):
    recipe = _recipe(tmp_path, tiny_model_dir, STAGES.format(demos=_demos(tmp_path / "demos.jsonl")),
                     **{"train.steps": 4, "teacher.weights": "base", "teacher.context": "hint"})
    summary = _train(load(recipe), tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["stage/index"] for r in rows] == [0, 0, 1, 1]
    assert [r["stage/step"] for r in rows] == [1, 2, 1, 2]
    sft, opd = rows[:2], rows[2:]
    assert all(r["distill/sft_nll"] > 0 for r in sft) and all("distill/teacher_kl" not in r for r in sft)
    assert all(r["mismatch/k3"] is None for r in sft)  # demonstrations were not sampled: nothing to compare
    assert all(r["rollout/tokens"] == 0 for r in sft)  # no generation in a stage with a data file
    assert all("distill/teacher_kl" in r and r["teacher/tokens"] > 0 for r in opd)
    assert "step 3: stage 2/2 (opd, steps 3-4)" in summary["stdout"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-3.jsonl").read_text().splitlines()]
    assert logged and all(isinstance(r["teacher_gap_mean"], float) and r["teacher_logprob_sum"] < 0 for r in logged)
    report = (tmp_path / "run" / "report.html").read_text()
    assert "<h2>Distillation</h2>" in report and "Teacher KL" in report


def test_sft_lowers_the_nll_of_repeated_demonstrations(tmp_path, tiny_model_dir):
    body = f'\n[[stage]]\nkind = "sft"\nsteps = 6\ndata = "{_demos(tmp_path / "d.jsonl", n=4)}"\n'
    recipe = _recipe(tmp_path, tiny_model_dir, body, **{"train.steps": 6, "rollout.prompts_per_step": 1,
                                                         "rollout.samples_per_prompt": 4, "train.lr": 3e-3})
    _train(load(recipe), tmp_path / "run")
    nll = [r["distill/sft_nll"] for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert nll[-1] < 0.8 * nll[0]  # the same 4 demonstrations every step: the model learns them


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")


def test_a_run_resumed_mid_stage_ends_with_the_same_weights(tmp_path, tiny_model_dir):
    body = '\n[[stage]]\nkind = "rl"\nsteps = 1\n\n[[stage]]\nkind = "opsd"\nsteps = 3\n'
    overrides = {"train.steps": 4, "teacher.weights": "ema", "teacher.context": "hint", "teacher.ema_decay": 0.5,
                 "run.save_every_steps": 2}
    cfg = load(_recipe(tmp_path, tiny_model_dir, body, **overrides))
    _train(cfg, tmp_path / "straight")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-4")  # as if killed after the step-2 checkpoint
    (resumed / "checkpoints" / "latest").unlink(missing_ok=True)
    _train(cfg, resumed, resume=True)
    a, b = _weights(tmp_path / "straight" / "checkpoints" / "step-4"), _weights(resumed / "checkpoints" / "step-4")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [r for r in read_rows(resumed) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["stage/index"] for r in rows] == [0, 1, 1, 1]


def test_teacher_stages_keep_groups_whose_rewards_are_all_equal(tmp_path, tiny_model_dir):
    # the tiny random model never answers arithmetic: every group has reward 0 everywhere
    rl = load(None, tiny_overrides(tiny_model_dir))
    _train(rl, tmp_path / "rl")
    opd = load(None, tiny_overrides(tiny_model_dir, **{"teacher.weights": "base", "teacher.context": "hint"}))
    _train(opd, tmp_path / "opd")
    rl_rows = [r for r in read_rows(tmp_path / "rl") if r["kind"] == "train"]
    opd_rows = [r for r in read_rows(tmp_path / "opd") if r["kind"] == "train"]
    assert all(r["filter/zero_variance_frac"] == 1.0 and r["train/loss"] is None for r in rl_rows)
    assert all(r["filter/zero_variance_frac"] == 0.0 and r["train/tokens"] > 0 for r in opd_rows)
    assert all(abs(r["distill/teacher_kl"]) > 0 for r in opd_rows)


def test_trb_warm_up_blends_then_anneals_to_the_student(tmp_path, tiny_model_dir):
    cfg = load(None, tiny_overrides(tiny_model_dir, **{
        "teacher.weights": "base", "teacher.context": "hint", "distill.trb_steps": 2, "distill.trb_budget": 0.5,
        "train.steps": 3, "algo.is_correction": "tis_token", "train.old_logprobs": "recompute"}))
    _train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r.get("trb/budget") for r in rows] == [0.5, 0.25, None]
    assert rows[0]["trb/lam_mean"] > 0
    assert rows[0]["mismatch/truncation_logprob_gap_mean"] != 0  # behaviour = the mixture, full = the student
    assert rows[2]["mismatch/truncation_logprob_gap_mean"] == pytest.approx(0.0, abs=1e-6)


def test_rollout_mixture_draws_some_samples_from_the_teacher(tmp_path, tiny_model_dir):
    cfg = load(None, tiny_overrides(tiny_model_dir, **{
        "teacher.weights": "base", "teacher.context": "hint", "distill.teacher_rollouts_per_group": 1,
        "algo.is_correction": "tis_token", "teacher.temperature": 0.7}))
    out = _train(cfg, tmp_path / "run")["stdout"]
    assert "warning: teacher.temperature 0.7 differs from rollout.temperature 1" in out
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["rollout/teacher_samples_frac"] for r in rows] == [0.25, 0.25]  # 1 of 4 samples per group
    assert all(r["mismatch/truncation_logprob_gap_mean"] != 0 for r in rows)  # teacher samples: behaviour != student
    assert all(r["train/tokens"] > 0 for r in rows)


def test_stage_plan_boundaries():
    from rollwise.config import Config
    from rollwise.config_distill import StageConfig, TeacherConfig
    from rollwise.methods import MethodSetup
    from rollwise.methods.plan import MethodPlan, plan_stages
    from rollwise.methods.rl import RL
    from rollwise.methods.sft import SFT

    stages = plan_stages([StageConfig(kind="sft", steps=2), StageConfig(kind="rl", steps=3)], 5, TeacherConfig())
    plan = MethodPlan(stages, MethodSetup(Config()))
    assert [plan.at(k)[0].kind for k in range(6)] == ["sft", "sft", "rl", "rl", "rl", "rl"]
    assert [type(plan.at(k)[1]) for k in (0, 2)] == [SFT, RL] and plan.at(0)[1] is plan.at(1)[1]  # one per kind
    assert [plan.starts_now(k) for k in range(5)] == [True, False, True, False, False]
    assert plan_stages([], 4, TeacherConfig(weights="base", context="hint"))[0].kind == "opsd"
    assert plan_stages([], 4, TeacherConfig())[0].kind == "rl"


@pytest.mark.parametrize("body, overrides, message", [
    ('[[stage]]\nkind = "rl"\nsteps = 3\n', {"train.steps": 2}, "add up to 3 steps but train.steps = 2"),
    ('[[stage]]\nkind = "opd"\nsteps = 2\n', {}, "needs a teacher: set teacher.weights"),
    ('[[stage]]\nkind = "opsd"\nsteps = 2\n', {"teacher.weights": "base"}, "set teacher.context"),
    ('[[stage]]\nkind = "rl"\nsteps = 2\nlearning = 1\n', {}, r"unknown key 'stage.learning'.*\[\[stage\]\] number 1"),
    ('[[stage]]\nkind = "dpo"\nsteps = 2\n', {}, r"\[\[stage\]\] number 1: kind = 'dpo' is not a known method"),
    ("", {"teacher.weights": "live"}, "is the student itself"),
    ("", {"teacher.weights": "base", "distill.trb_steps": 2, "rollout.top_p": 0.9}, "top_p = 1"),
    ("", {"teacher.weights": "base", "distill.teacher_rollouts_per_group": 1}, "set algo.is_correction"),
    ("", {"teacher.weights": "live", "teacher.context": "hint", "teacher.backend": "engine"}, "scores with fixed weights"),
    ("", {"teacher.weights": "base", "teacher.backend": "engine", "teacher.temperature": 0.5}, "temperature = 1"),
    ("", {"distill.routing": "self_routing"}, "routes the samples of teacher stages"),
])
def test_inconsistent_distillation_configs_fail_with_one_line(tmp_path, tiny_model_dir, body, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(_recipe(tmp_path, tiny_model_dir, "\n" + body, **overrides))


def test_stage_tables_are_not_command_line_overrides(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"\[\[stage\]\] tables are set in the recipe file"):
        load(None, tiny_overrides(tiny_model_dir) + ["stage.kind=rl"])


def _sample(correct: bool, logps: list[float]) -> Sample:
    return Sample(prompt=Prompt("u", []), prompt_ids=[1], response_ids=[5] * len(logps), behaviour_logprobs=logps,
                  loss_mask=[1] * len(logps), status=Status.COMPLETED, group_id=0, correct=correct)


def test_self_routing_by_correctness_and_confidence():
    sure, unsure = [-0.01, -0.05], [-1.0, -2.0]  # geometric-mean token probability 0.97 and 0.22
    assert confidence(_sample(True, sure)) == pytest.approx(2.718281828 ** -0.03)
    assert [route(_sample(c, lp), 0.7) for c, lp in [(True, sure), (True, unsure), (False, unsure), (False, sure)]] \
        == ["skip", "grpo", "self_distill", "regularise"]
    marks = StepMarks()
    kept, metrics = route_samples([_sample(True, sure), _sample(False, unsure), _sample(False, sure)], 0.7, marks)
    assert [marks.routes[id(s)] for s in kept] == ["self_distill", "regularise"]
    assert [marks.weight(s) for s in kept] == [ROUTES["self_distill"], ROUTES["regularise"]]
    assert metrics["route/skip_frac"] == pytest.approx(1 / 3) and metrics["route/grpo_frac"] == 0.0


def test_rejection_sampling_keeps_correct_completed_responses():
    from rollwise.methods.sft import rejection_sampled
    from rollwise.types import Group

    samples = [_sample(True, [-1.0]), _sample(False, [-1.0]), _sample(True, [-1.0]), _sample(True, [-1.0])]
    samples[2].status = Status.TRUNCATED  # correct but cut: it never learned to stop
    samples[3].status = Status.FAILED  # its reward crashed
    kept, metrics = rejection_sampled([Group(0, samples[0].prompt, samples)])
    assert kept == [samples[0]]
    assert metrics == {"sft/demos": 1.0, "sft/accepted_frac": pytest.approx(1 / 3), "sft/prompts_with_demo": 1.0}


def test_the_collapse_stop_names_the_step_and_the_numbers():
    from rollwise.config import Config
    from rollwise.distill.guards import CollapseError
    from rollwise.distill.guards import Guards

    guards = Guards(Config.model_validate({"distill": {"guard_stop": True}}))
    guards.check_stop(3, {"distill/collapse_alarm": 0.0})  # no alarm: nothing happens
    with pytest.raises(CollapseError, match=r"step 4: stopped at the truncation-collapse alarm.*length 40.0.*0.35"):
        guards.check_stop(4, {"distill/collapse_alarm": 1.0, "rollout/response_len_mean": 40.0,
                              "rollout/repetition_rate": 0.35})


def test_a_teacher_with_another_tokenizer_stops_the_run_before_any_step(tmp_path, tiny_model_dir):
    import subprocess

    from conftest import ROLLWISE, subprocess_env
    from helpers_model import tiny_llama
    from helpers_tokenizer import tiny_tokenizer

    other = tiny_tokenizer(vocab_size=300)
    tiny_llama(len(other), eos_token_id=other.eos_token_id, pad_token_id=other.pad_token_id).save_pretrained(
        tmp_path / "teacher")
    other.save_pretrained(tmp_path / "teacher")
    args = tiny_overrides(tiny_model_dir, **{"teacher.weights": str(tmp_path / "teacher")})
    done = subprocess.run([ROLLWISE, "train", "--run-dir", str(tmp_path / "run"), *args], capture_output=True,
                          text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "its tokenizer differs from the student's" in error[0]
    assert str(tmp_path / "teacher") in error[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_bad_demonstration_row_stops_the_run_before_its_first_step(tmp_path, tiny_model_dir):
    from rollwise.data.files import DatasetError

    bad = tmp_path / "demos.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "response": "2"}\n{"prompt": "What is 2 + 2?"}\n')
    body = f'\n[[stage]]\nkind = "rl"\nsteps = 1\n\n[[stage]]\nkind = "sft"\nsteps = 1\ndata = "{bad}"\n'
    cfg = load(_recipe(tmp_path, tiny_model_dir, body, **{"train.steps": 2}))
    with pytest.raises(DatasetError, match=r"demos.jsonl.*line 2.*'response'"):
        _train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_rows(tmp_path / "run")
