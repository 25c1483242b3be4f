"""`rollwise eval`: resolve what to evaluate (model, checkpoint or run directory) and run it."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rollwise.config import load_config
from rollwise.data import PromptEncoder, build_prompt_source
from rollwise.evaluate import evaluate
from rollwise.generate import TorchEngine
from rollwise.hardware import configure_allocator, configure_threads
from rollwise.models import load_model
from rollwise.rewards import build_reward_fn
from rollwise.session import encode_eval_prompts, engine_dtype
from rollwise.train.checkpoint import latest_checkpoint


def resolve_target(model: str) -> tuple[str, Path | None]:
    """(model to load, recipe of the run it came from). A run directory resolves to its newest checkpoint."""
    path = Path(model)
    if (path / "checkpoints").is_dir():
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"{path} is a run directory without a complete checkpoint")
        return str(ckpt), path / "config.toml"
    if (path / "trainer_state.pt").exists() and (path.parent.parent / "config.toml").exists():
        return str(path), path.parent.parent / "config.toml"  # runs/NAME/checkpoints/step-N
    return model, None


def load_policy(target: str, base_name: str):
    """(model, tokenizer) of `target`; a LoRA checkpoint (adapter/ beside the trainer state) is its base
    (`model.name` of the run) with the adapter merged in."""
    from rollwise.train.lora import is_lora_checkpoint

    if not is_lora_checkpoint(target):
        return load_model(target, dtype=torch.float32)
    from rollwise.train.lora import load_lora_checkpoint

    base, tokenizer = load_model(base_name, dtype=torch.float32)
    return load_lora_checkpoint(target, base).merge_and_unload(), tokenizer


def run_eval_command(model: str, task: str | None, n: int, temperature: float, max_new_tokens: int | None,
                     overrides: list[str]) -> dict:
    target, recipe = resolve_target(model)
    extra = [f"data.task={_quote(task)}"] if task else []
    cfg = load_config(recipe if recipe and recipe.exists() else None, overrides + extra)
    if task:  # another task than the run's: its own data and split
        cfg.data.path = None
        cfg.data.eval_path = None
        cfg.data.split = "prompt"
    configure_allocator()
    configure_threads(cfg.model.threads)
    start = time.perf_counter()
    policy, tokenizer = load_policy(target, cfg.model.name)
    engine = TorchEngine(policy, tokenizer, dtype=engine_dtype(cfg.model.dtype), max_batch_size=cfg.rollout.max_batch_size)
    source = build_prompt_source(cfg.data, cfg.train.seed)
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    prompts = encode_eval_prompts(source, encoder, n)
    reward_fn = build_reward_fn(cfg.reward, source.default_reward)
    try:
        metrics = evaluate(engine, prompts, reward_fn, temperature, max_new_tokens or cfg.rollout.max_new_tokens,
                           reward_timeout_s=cfg.reward.timeout_s)
    finally:
        getattr(reward_fn, "close", lambda: None)()  # reward worker processes (reward.isolate)
    return {
        "model": target,
        "task": cfg.data.path or cfg.data.task,
        "n": len(prompts),
        "temperature": temperature,
        "sampled_accuracy": metrics["eval/sampled_accuracy"],
        "greedy_accuracy": metrics["eval/greedy_accuracy"],
        "response_len_mean": metrics["eval/response_len_mean"],
        "greedy_response_len_mean": metrics["eval/greedy_response_len_mean"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def _quote(value: str) -> str:
    return '"' + value.replace('"', '\\"') + '"'
