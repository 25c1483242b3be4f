"""`rollwise eval`: resolve what to evaluate (model, checkpoint or run directory) and run it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rollwise import sandbox
from rollwise.config_load import load_config
from rollwise.validate import validate
from rollwise.envs import build_env
from rollwise.envs.episode import final_text, transcript
from rollwise.rollout import episodes_for
from rollwise.data import PromptEncoder, build_prompt_source
from rollwise.evaluate import evaluate, origin_of
from rollwise.hardware import configure_allocator, configure_threads
from rollwise.models import load_model
from rollwise.rewards import build_reward_fn
from rollwise.generate.factory import apply_engine_flags, engine_summary, open_engine
from rollwise.session import encode_eval_prompts
from rollwise.train.checkpoint import BEST, CHECKPOINTS, best_checkpoint, latest_checkpoint


def resolve_target(model: str, best: bool = False) -> tuple[str, Path | None]:
    """(model to load, recipe of the run it came from). A run directory resolves to its newest checkpoint, or
    with `best` (or given as RUN_DIR/checkpoints/best) to the checkpoint of its best evaluation (kept whenever
    the run evaluates: rollwise.early_stop)."""
    path = Path(model)
    if path.name == BEST and path.parent.name == CHECKPOINTS and path.is_file():
        path, best = path.parent.parent, True
    if best:
        if not (path / CHECKPOINTS).is_dir():
            raise FileNotFoundError(f"--best takes a run directory; {path} has no {CHECKPOINTS}/ folder")
        ckpt = best_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"{path} has no {CHECKPOINTS}/{BEST} naming a complete checkpoint: the run had no "
                                    "evaluation (eval.n = 0, or none yet) or train.keep_best = false; drop --best "
                                    "for its newest checkpoint")
        return str(ckpt), path / "config.toml"
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
                     overrides: list[str], data: str | None = None, out: str | None = None, k: int | None = None,
                     greedy: bool = True, best: bool = False, decode: str = "plain", device: str | None = None,
                     engine: str | None = None) -> dict:
    """`rollwise eval`: one JSON-ready dict. `k` sampled responses per prompt (None = eval.k of the run's
    recipe, else 1): with k > 1 the result has pass@j and avg@k (and per source, under `sources`). The responses
    come from the engine the run sampled with (`rollout.engine`, `engine_options`, `train.device`, `model.dtype`;
    `device` / `engine` override the run's), with its `rollout.top_p`, `top_k` and `stop`; `engine` in the
    result names what generated."""
    if k is not None and k < 1:
        raise ValueError(f"--k must be at least 1, got {k}")
    if decode not in DECODES:
        raise ValueError(f"--decode {decode!r} is not one of {', '.join(DECODES)}")
    target, recipe = resolve_target(model, best)
    cfg = eval_config(recipe, task, data, overrides, device, engine)
    configure_allocator()
    configure_threads(cfg.model.threads)
    sandbox.allow_unconfined(cfg.sandbox.allow_unconfined)
    start = time.perf_counter()
    task_source = build_prompt_source(cfg.data, cfg.train.seed)
    if data and cfg.data.system_prompt is None:  # file rows run behind the task's own system prompt
        cfg.data.system_prompt = getattr(task_source, "system_prompt", None)
    source = FilePrompts(data, cfg.data) if data else task_source
    env = build_env(cfg.env, getattr(task_source, "default_env", None))
    k = k or cfg.eval.k
    max_new_tokens = max_new_tokens or cfg.rollout.max_new_tokens
    kept: list = []
    with policy_engine(cfg, target, "eval") as (generator, tokenizer):
        encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
        prompts = encode_eval_prompts(source, encoder, n)
        reward_fn = build_reward_fn(cfg.reward, task_source.default_reward)
        episodes = None if env is None else episodes_for(cfg, env, tokenizer, getattr(task_source, "default_env", None))
        try:
            metrics = decode_all(cfg, generator, prompts, reward_fn, episodes, kept, temperature, max_new_tokens, k,
                                 greedy, decode)
        finally:
            getattr(reward_fn, "close", lambda: None)()  # reward worker processes (reward.isolate)
        used = {"engine": engine_summary(cfg, generator), **engine_metrics(generator)}
    if out:
        write_episodes(Path(out), kept)
    episode_keys = {key.removeprefix("eval/"): round(v, 4) for key, v in metrics.items() if "_episode/" in key}
    return {
        "model": target,
        "task": cfg.data.path or cfg.data.task,
        "n": len(prompts),
        "temperature": temperature,
        "k": k,
        "sampled_accuracy": metrics["eval/sampled_accuracy"],
        **pass_figures(metrics, "eval/"),
        "greedy_accuracy": metrics.get("eval/greedy_accuracy"),
        **{key.removeprefix("eval/"): metrics.get(key) for key in PRIOR_KEYS if key in metrics},
        "response_len_mean": metrics["eval/response_len_mean"],
        "greedy_response_len_mean": metrics.get("eval/greedy_response_len_mean"),
        **episode_keys,
        **per_source(metrics, {origin_of(p) for p, _ in prompts}),
        **({"out": out} if out else {}),
        **({"sampled_tokens_per_prompt": round(metrics["eval/response_len_mean"] * k, 1)} if decode != "plain" else {}),
        **{key.replace("/", "_"): value for key, value in metrics.items() if key.startswith("deeplook/")},
        **used,
        "seconds": round(time.perf_counter() - start, 1),
    }


# what a constant answer cannot buy (rollwise.metrics.prior), in `rollwise eval`'s JSON
PRIOR_KEYS = ("eval/sampled_balanced_accuracy", "eval/greedy_balanced_accuracy", "eval/reference_mode_frac",
              "eval/sampled_answer_mode_frac", "eval/sampled_answer_mode", "eval/greedy_answer_mode_frac",
              "eval/greedy_answer_mode")


def eval_config(recipe: Path | None, task: str | None, data: str | None, overrides: list[str], device: str | None,
                engine: str | None):
    """The run's config (`recipe`; defaults without one) with `overrides`, `--task` / `--data` and `--device` /
    `--engine` applied, validated; the notes of the flags go to stderr."""
    extra = [f"data.task={_quote(task)}"] if task else []
    cfg = load_config(recipe if recipe and recipe.exists() else None, overrides + extra)
    if task or data:  # another task than the run's (or a file of prompts): its own data and split
        cfg.data.path = None
        cfg.data.eval_path = None
        cfg.data.split = "prompt"
    for note in apply_engine_flags(cfg, device, engine, overrides):
        print(f"rollwise eval: {note}", file=sys.stderr, flush=True)
    return validate(cfg)


@contextmanager
def policy_engine(cfg, target: str, command: str):
    """(engine, tokenizer) of the policy `target` on the run's engine (`rollwise.generate.factory.open_engine`),
    closed on the way out; a vLLM engine's weights folder lives in a scratch folder removed then."""
    work = Path(tempfile.mkdtemp(prefix=f"rollwise-{command}-"))
    try:
        policy, tokenizer = load_policy(target, cfg.model.name)
        generator = open_engine(cfg, policy, tokenizer, work)
        del policy  # the engine holds its own copy (on a GPU, one is enough)
        try:
            yield generator, tokenizer
        finally:
            generator.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def decode_all(cfg, engine, prompts, reward_fn, episodes, kept: list, temperature: float, max_new_tokens: int,
               k: int, greedy: bool, decode: str) -> dict:
    """`evaluate`'s metrics with the run's `rollout.top_p`, `top_k` and `stop`; with `decode = "deeplook"` the
    `deeplook/*` figures too (the plain sampled figures are their baseline at the same temperature)."""
    rollout = cfg.rollout
    metrics = evaluate(engine, prompts, reward_fn, temperature, max_new_tokens, greedy=greedy,
                       reward_timeout_s=cfg.reward.timeout_s, episodes=episodes, keep_samples=kept, k=k,
                       stop=tuple(rollout.stop), top_p=rollout.top_p, top_k=rollout.top_k)
    if decode == "deeplook":
        metrics.update(deeplook_figures(engine, prompts, reward_fn, temperature, max_new_tokens, cfg))
        from rollwise.decode.deeplook import vote_accuracy

        metrics["deeplook/plain_vote_accuracy"] = vote_accuracy(dict(kept)["sampled"], k)
    return metrics


def engine_metrics(engine) -> dict:
    """`{"engine_metrics": {...}}` of what the engine counted (e.g. `spec_accept_rate` with a draft model), or {}."""
    found = getattr(engine, "pop_metrics", lambda: {})()
    return {"engine_metrics": {key.removeprefix("rollout/"): v for key, v in found.items()}} if found else {}


DECODES = ("plain", "deeplook")


def deeplook_figures(engine, prompts, reward_fn, temperature: float, max_new_tokens: int, cfg) -> dict:
    """`deeplook/*` of `rollwise eval --decode deeplook`, with the run's `eval.deeplook_*` settings."""
    from rollwise.decode.deeplook import DeepLookSettings, deeplook_eval

    e = cfg.eval
    settings = DeepLookSettings(e.deeplook_segment_tokens, e.deeplook_drop_ratio, e.deeplook_window,
                                e.deeplook_branches, e.deeplook_horizon_tokens, e.deeplook_voters,
                                e.deeplook_max_triggers)
    r = cfg.rollout
    return deeplook_eval(engine, prompts, reward_fn, temperature, max_new_tokens, settings, cfg.reward.timeout_s,
                         stop=tuple(r.stop), top_p=r.top_p, top_k=r.top_k)


def pass_figures(metrics: dict, prefix: str) -> dict:
    """`pass@j` and `avg@k` of an eval row, under `prefix`, without it."""
    return {key.removeprefix(prefix): value for key, value in metrics.items()
            if key.startswith(prefix) and key.removeprefix(prefix).startswith(("pass@", "avg@"))}


def per_source(metrics: dict, origins: set[str]) -> dict:
    """`{"sources": {origin: {n, sampled_accuracy, greedy_accuracy, pass@j, avg@k}}}` with more than one origin."""
    if len(origins) < 2:
        return {}
    return {"sources": {o: {key.removeprefix(f"eval/{o}/"): value for key, value in metrics.items()
                            if key.startswith(f"eval/{o}/")} for o in sorted(origins)}}


class FilePrompts:
    """`rollwise eval --data FILE`: every row of FILE (prompt + answer, as in data.path) is a held-out prompt."""

    def __init__(self, path: str, cfg) -> None:
        from rollwise.data.files import load_prompts

        self.name = Path(path).name
        self._rows = load_prompts(path, cfg)
        self.num_eval = len(self._rows)

    def eval_prompts(self, n: int):
        return self._rows[:n]

    def split_summary(self) -> str:
        return f"all {self.num_eval} rows of {self.name} (--data)"


def write_episodes(path: Path, kept: list) -> None:
    """One JSON line per evaluated response (both modes): prompt, answer, transcript, final, correct."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for mode, samples in kept:
            for s in samples:
                f.write(json.dumps({"mode": mode, "prompt": s.prompt.messages[-1]["content"], "answer": s.prompt.answer,
                                    "transcript": transcript(s), "final": final_text(s), "correct": s.correct,
                                    "reward": s.reward, "status": s.status.value, "error": s.reward_error,
                                    "source": s.prompt.source}) + "\n")
    tmp.replace(path)


def _quote(value: str) -> str:
    return '"' + value.replace('"', '\\"') + '"'
