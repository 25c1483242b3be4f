"""Every recipe in recipes/ runs two RL steps end to end on the tiny model, with its objective's metrics; the
recipes whose objective is its clipping run enough minibatch updates for the clipping to act."""

from __future__ import annotations

import contextlib
import io
import math
import random
import re
from pathlib import Path

import pytest
import torch

from conftest import read_rows, tiny_overrides
from helpers_model import tiny_llama
from rollwise.validate import load
from rollwise import algo
from rollwise.config import Config, ConfigError, TrainConfig
from rollwise.loop import train
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# metrics that show the recipe's objective actually ran
EXPECTED = {
    "grpo": ["train/kl", "train/clip_frac"],
    "dr_grpo": ["train/clip_frac"],
    "dapo": ["reward/shaped_mean"],
    "cispo": ["reward/shaped_mean", "train/weight_mean"],
    "gspo": ["train/clip_frac"],
    "rloo": ["train/loss"],
    "reinforce_pp": ["reward/kl_penalty_mean"],
    "ppo": ["value/error_abs_mean", "value/values_mean"],
    "sao": ["value/error_abs_mean"],
    "quickstart": ["train/clip_frac"],
    "calc": ["episode/turns_mean", "curriculum/example_prob", "substitution/groups_hard"],
    "lookup": ["episode/turns_mean", "episode/tool_calls_mean"],
    "opd": ["distill/teacher_kl", "teacher/tokens"],
    "opsd": ["distill/teacher_kl", "distill/gap_mean"],
    "sft_then_grpo": ["stage/index"],
    "dcmdp": ["mismatch/lambda", "mismatch/discrepancy"],
    "acrl": ["mismatch/acrl_threshold", "mismatch/acrl_masked_frac"],
    "reasoning_gym": ["reward/part/answer_fallback"],
}


def test_every_recipe_is_covered():
    assert sorted(p.stem for p in RECIPES.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_runs_two_steps(name, tmp_path, tiny_model_dir):
    overrides = {
        "reward.fn": "toy_plugins:digit_fraction",  # dense reward: every group has variance on a random model
        "eval.n": 4,
        "run.report": False,
        "run.name": None,
    }
    if name == "sao":
        overrides["rollout.samples_per_prompt"] = None  # keep the recipe's single sample per prompt
        overrides["rollout.prompts_per_step"] = 8
    if name in ("dapo", "cispo"):  # the tiny run generates 8 tokens at most: the overlong buffer must fit inside
        overrides["algo.shaping"] = None
    if name in ("calc", "lookup"):  # the tiny tokenizer spends more tokens on the tool prompts
        overrides["data.max_prompt_tokens"] = 1024
        overrides["env.max_episode_tokens"] = 48
    if name == "reasoning_gym":  # the dataset's own scorer (its parts are the expected metrics)
        overrides["reward.fn"] = None
        overrides["data.max_prompt_tokens"] = 1024  # its system prompt is long in the tiny tokenizer
    if name == "opd":  # a teacher directory with the student's tokenizer (here: the tiny model itself)
        overrides["teacher.weights"] = str(tiny_model_dir)
    recipe = RECIPES / f"{name}.toml"
    if name == "sft_then_grpo":  # one step per stage (stages are set in the file, not by overrides)
        recipe = tmp_path / "sft_then_grpo.toml"
        recipe.write_text(re.sub(r"(\[\[stage\]\]\nkind = \"\w+\"\nsteps = )\d+", r"\g<1>1",
                                 (RECIPES / f"{name}.toml").read_text()))
    cfg = load(recipe, tiny_overrides(tiny_model_dir, **overrides))
    if name in ("dapo", "cispo"):
        cfg.algo.shaping = {"overlong_soft": {"cache_len": 4}}
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / name)
    rows = [r for r in read_rows(tmp_path / name) if r["kind"] == "train"]
    assert len(rows) == 2
    if name == "sft_then_grpo":  # the random model rarely ends a response: its SFT step may find no demonstration
        assert rows[0]["stage/index"] == 0 and 0 <= rows[0]["sft/accepted_frac"] <= 1
        rows = rows[1:]
    for row in rows:
        if name == "reasoning_gym" and row["train/loss"] is None:  # an exact name: the random model never scores,
            assert row["reward/std"] == 0.0, row  # every group is uniform and nothing trains
        else:
            assert math.isfinite(row["train/loss"]), (name, row)
        for key in EXPECTED[name]:
            assert row.get(key) is not None and math.isfinite(row[key]), (name, key, row)


def test_value_head_is_checkpointed_and_restored(tmp_path, tiny_model_dir):
    import torch

    from rollwise.build import open_run

    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 0, "run.report": False,
                 "run.save_every_steps": 1, "run.name": None}
    cfg = load(RECIPES / "ppo.toml", tiny_overrides(tiny_model_dir, **overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "ppo")
    state = torch.load(tmp_path / "ppo" / "checkpoints" / "step-2" / "trainer_state.pt", weights_only=False)
    saved = state["value_head"]
    assert any(float(t.abs().sum()) > 0 for t in saved.values())  # the head learned from zero
    run = open_run(cfg, tmp_path / "ppo", resume=True)
    for name, tensor in run.trainer.value_head.state_dict().items():
        assert torch.equal(tensor, saved[name])
    assert run.trainer.updates == state["updates"] == 2


# ---- clipping acts only off-policy ---------------------------------------------------------------------------

# Recipes whose objective is defined by what it clips or truncates. With one PPO epoch and one minibatch the
# old log-probs are the current ones, every ratio is exactly 1 and none of these losses acts.
CLIPPING_RECIPES = ["dapo", "gspo", "sao", "cispo"]
VOCAB = 97


def _recipe_batch(cfg: Config) -> list[Sample]:
    """One rollout batch of the recipe's shape (prompts_per_step groups x samples_per_prompt) of random tokens
    and rewards, with the recipe's outcome advantages (a critic's are computed inside `Trainer.step`)."""
    rng = random.Random(0)
    samples = []
    for g in range(cfg.rollout.prompts_per_step):
        prompt = [rng.randrange(3, VOCAB) for _ in range(5)]
        for _ in range(cfg.rollout.samples_per_prompt):
            n = rng.randint(2, 8)
            samples.append(Sample(prompt=Prompt(str(g), []), prompt_ids=prompt,
                                  response_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
                                  behaviour_logprobs=[-4.0] * n, loss_mask=[1] * n, status=Status.COMPLETED,
                                  group_id=g, reward=rng.random()))
    if not algo.is_token_advantage(cfg.algo.advantage):
        rewards = torch.tensor([s.reward for s in samples])
        group_ids = torch.tensor([s.group_id for s in samples])
        for sample, a in zip(samples, algo.advantage(cfg.algo.advantage, rewards, group_ids).tolist()):
            sample.advantage = a
    return samples


def _clip_frac(cfg: Config, **train_overrides) -> tuple[float, dict]:
    """`train/clip_frac` of one RL step of the recipe's objective and train settings on the tiny model."""
    train_cfg = TrainConfig.model_validate({**cfg.train.model_dump(), **train_overrides})
    trainer = Trainer(tiny_llama(VOCAB, seed=1), train_cfg, cfg.algo, pad_id=0,
                      temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    metrics = trainer.step(_recipe_batch(cfg))
    return metrics["train/clip_frac"], metrics


@pytest.mark.parametrize("name", CLIPPING_RECIPES)
def test_clipping_recipes_clip(name):
    cfg = load(RECIPES / f"{name}.toml", [])
    assert cfg.train.minibatches_per_epoch * cfg.train.ppo_epochs > 1, name
    # lr 1e-2 (the recipe's is for the 135M model): the first update moves the tiny model's ratios out of the band
    clip_frac, metrics = _clip_frac(cfg, lr=1e-2)
    updates = cfg.train.minibatches_per_epoch * cfg.train.ppo_epochs
    assert metrics["train/optimizer_steps"] == updates
    # the first minibatch is on-policy (nothing clipped); the later ones are not
    assert 0.0 < clip_frac < 1.0, (name, clip_frac)
    # one epoch, one minibatch, same lr and samples: ratio exactly 1, nothing clipped
    single, _ = _clip_frac(cfg, lr=1e-2, minibatches_per_epoch=1, ppo_epochs=1)
    assert single == 0.0, (name, single)


# ------------------------------------------------------------------------------- GPU recipes (recipes/gpu/)

GPU_RECIPES = sorted((RECIPES / "gpu").glob("*.toml"))


def gpu_stand_ins(tmp_path, tiny_model_dir) -> list[str]:
    """Overrides pointing a GPU recipe at tiny local stand-ins: the tiny model, a GSM8K-shaped dataset folder (the
    recipe's config, splits and fields), the CPU. No GPU, no hub."""
    from helpers_hub import gsm8k_folder

    folder = gsm8k_folder(tmp_path / "gsm8k")
    return [f'model.name="{tiny_model_dir}"', f'data.path="{folder}"', 'train.device="cpu"']


def test_the_gpu_recipes_are_the_two_documented():
    assert [p.name for p in GPU_RECIPES] == ["qwen2.5-0.5b-gsm8k-lora.toml", "qwen2.5-0.5b-gsm8k.toml"]
    docs = (RECIPES.parent / "docs" / "gpu.md").read_text()
    assert all(f"recipes/gpu/{p.name}" in docs for p in GPU_RECIPES)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_a_gpu_recipe_loads_with_tiny_stand_ins(recipe, tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = load(recipe, gpu_stand_ins(tmp_path, tiny_model_dir))
    assert (cfg.data.config, cfg.data.split_name, cfg.data.eval_split_name) == ("main", "train", "test")
    assert (cfg.reward.fn, cfg.rollout.samples_per_prompt, cfg.algo.kl_coef) == ("gsm8k", 8, 0.0)
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.train.device) == (0.2, 0.28, "cpu")
    assert cfg.train.lr == (1e-5 if cfg.lora.rank else 1e-6)
    for line in recipe.read_text().splitlines():  # every key says what it is for
        assert "#" in line or not line.split("=")[0].strip().isidentifier(), line
    if not torch.cuda.is_available():  # as written it asks for a GPU, and says so before any work
        with pytest.raises(ConfigError, match=r"^train.device = 'cuda', but this machine has 0 CUDA device"):
            load(recipe, gpu_stand_ins(tmp_path / "again", tiny_model_dir)[:2])


@pytest.mark.parametrize("recipe", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if "lora" in p.name else [])
                                    for p in GPU_RECIPES])
def test_a_gpu_recipe_trains_two_steps_on_the_stand_ins(recipe, tmp_path, tiny_model_dir, monkeypatch):
    """The recipe's settings together (GSM8K reward, eval split, 4 minibatches, TIS, LoRA) on the CPU, shrunk."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    small = tiny_overrides(tiny_model_dir, **{"eval.n": 2, "run.report": False, "train.precision": "fp32",
                                              "model.dtype": "float32", "rollout.max_batch_size": 16,
                                              "train.warmup_steps": 0, "eval.every_steps": 0})
    cfg = load(recipe, gpu_stand_ins(tmp_path, tiny_model_dir) + small)
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "run")
    rows = read_rows(tmp_path / "run")
    assert [r["reward/errors"] for r in rows if r["kind"] == "train"] == [0.0, 0.0]  # every "####" reference read
    assert [r["eval/n"] for r in rows if r["kind"] == "eval"] == [2.0, 2.0]  # from the test split
