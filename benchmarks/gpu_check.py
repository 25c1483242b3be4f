"""The GPU check's work (run by `benchmarks/gpu_check.sh`): GRPO on CUDA at the shapes users run, the figures a
user needs from a GPU run, TRL's GRPOTrainer beside it, and FSDP2 on one rank over NCCL.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on the GPU machine (about 6 minutes at most)
    python benchmarks/gpu_check.py --out runs/gpu_check --dry      # the same code on this CPU, tiny shapes (CI)

No network and no embedded model there: the models are random-initialised at real models' shapes (`SHAPES`; tiny
ones with `--dry`), with a word-level tokenizer whose vocabulary fills the model's, saved as local HF folders. The
reward is `toy_plugins:even_id_fraction` (a random model gets arithmetic right too rarely for groups to vary).

Each part runs in its own process with a time budget (`PARTS`; killed and reported as skipped past it, and not
started when the check's whole budget, `--budget-s`, has less left than the part needs), so one part's memory
peak, crash or hang does not touch the others:

- `recipe`: `recipes/gpu/qwen2.5-0.5b-gsm8k.toml`'s [rollout], [algo] and [train] keys (32 prompts x 8 samples,
  512 new tokens, `train.micro_batch_tokens = 8192`, bf16) on a Qwen2.5-0.5B-shaped model, 3 steps, with EOS
  suppressed so that every response is 512 tokens long (a random model samples EOS at random). Reported: rollout
  and train tok/s, trainer MFU against the datasheet and the measured peak, peak GPU memory against the `--dry-run`
  estimate (`rollwise.train.memory_config.estimate_dict`), and HF `generate` batched on the same model, prompts and
  shape as the rollout's reference (target: the torch engine within 2x of it).
- `memory-1.5b`: one step of the same recipe at Qwen2.5-1.5B's shape: peak GPU memory against the estimate.
- `trl`: TRL's GRPOTrainer on the same GPU, model and shape (256 completions of 512 tokens per generation, four
  optimizer steps of 64, bf16, HF generate), side by side with `recipe`'s step time.
- `quickstart`: 5 steps of the default recipe (8 prompts x 8 samples, 48 new tokens) at SmolLM2-135M's shape in
  fp32 and bf16: the engine-vs-trainer log-prob gap of every step, the sync probe's gap, and a checkpoint that
  must load in transformers with the trained weights.
- `fsdp`: one FSDP2 rank over NCCL (gloo on the CPU) against the local trainer on the same batch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # rollwise from this tree, tests/toy_plugins for the reward
GPU_RECIPE = ROOT / "recipes" / "gpu" / "qwen2.5-0.5b-gsm8k.toml"

SHAPES = {  # HF config of each model shape: the real models' dimensions, random weights
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048, rope_theta=10000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=1000000.0),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=512),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True,
                       max_position_embeddings=1024),
}
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly `vocab_size` ids (specials, digits and operators, then filler words), so
    every id a random model samples decodes to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    words = specials + list("0123456789+-*=?.,:") + ["What", "is", "The", "answer", "Solve", "the", "arithmetic",
                                                     "problem", "End", "your", "reply", "with", "N", "system", "user",
                                                     "assistant", "\n"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Punctuation()])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>")
    out.chat_template = CHAT
    return out


def make_model(shape: str, folder: Path, bf16: bool = False) -> Path:
    """A random-initialised model of `shape` and its tokenizer, saved to `folder` (seeded: the same each time; built
    on the GPU when there is one, where initialising a billion weights takes a second, not a minute on the CPU).
    Kept when `folder` already holds it. `bf16`: saved in bf16 (half the bytes to write and read back)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "tokenizer.json").is_file():  # written last: the folder is complete
        return folder
    params = dict(SHAPES[shape])
    tok = word_tokenizer(params["vocab_size"])
    config = AutoConfig.for_model(**params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[] if device == "cpu" else [0]):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16 if bf16 else torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


PERF_KEYS = ["mismatch/logprob_abs_diff_mean", "mismatch/k3", "sync/logprob_max_abs_diff", "perf/rollout_tokens_per_s",
             "perf/train_tokens_per_s", "perf/rollout_s", "perf/train_s", "perf/step_s", "perf/rollout_mfu",
             "perf/train_mfu", "perf/train_mfu_datasheet", "perf/mfu", "perf/peak_gflops_train",
             "perf/peak_gflops_train_datasheet", "perf/peak_gflops_rollout", "perf/cuda_peak_allocated_gb",
             "rollout/response_len_mean"]


def run_rollwise(model_dir: Path, run_dir: Path, precision: str, steps: int, overrides: list[str],
                 recipe: Path = ROOT / "recipes" / "quickstart.toml") -> dict:
    """`steps` steps of `rollwise train recipe` on `model_dir` (`train.precision` and `model.dtype` per `precision`)
    with `overrides`; returns {config, per-step figures, peak memory beside its estimate, wall time}."""
    from rollwise.loop import train
    from rollwise.train.memory_config import estimate_dict
    from rollwise.validate import load

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    cfg = load(recipe, [
        f"model.name={model_dir}", f"model.dtype={dtype}", f"train.precision={precision}", "train.device=auto",
        f"train.steps={steps}", "eval.n=0", "reward.fn=toy_plugins:even_id_fraction", "run.console=false",
        "run.report=false", f"run.save_every_steps={steps}", *overrides])
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    peaks = [r["perf/cuda_peak_allocated_gb"] for r in rows if r.get("perf/cuda_peak_allocated_gb") is not None]
    estimate = estimate_dict(cfg)
    measured = max(peaks, default=None)
    return {"precision": precision, "engine": cfg.rollout.engine, "engine_options": dict(cfg.rollout.engine_options),
            "device": str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
            "wall_s": time.perf_counter() - start, "per_step": [{k: r.get(k) for k in PERF_KEYS} for r in rows],
            "memory": {"estimate": estimate, "cuda_max_allocated_gib": measured,
                       "measured_over_estimate": (measured / estimate["total_gib"]) if measured and estimate
                       else None}}


def grpo(model_dir: Path, run_dir: Path, precision: str, dry: bool) -> dict:
    """Steps of GRPO at the default recipe's shape, and whether the last checkpoint reloads."""
    steps, shape = (2, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8"]) \
        if dry else (5, [])
    out = run_rollwise(model_dir, run_dir, precision, steps, ["data.max_prompt_tokens=96", *shape])
    out["checkpoint_logit_max_abs_diff"] = checkpoint_reloads(run_dir / "checkpoints" / f"step-{steps}")
    return out


def recipe_overrides(dry: bool) -> list[str]:
    """The GPU recipe's [rollout], [algo] and [train] keys and `data.max_prompt_tokens`, as overrides (its model,
    GSM8K data, step count and evaluation are the check's own); `dry`: tiny batches, the same keys otherwise."""
    recipe = tomllib.loads(GPU_RECIPE.read_text())
    skip = {"train.steps", "train.warmup_steps", "train.device"}
    out = [f"{section}.{key}={json.dumps(value)}" for section in ("rollout", "algo", "train")
           for key, value in recipe[section].items() if f"{section}.{key}" not in skip]
    out.append(f"data.max_prompt_tokens={recipe['data']['max_prompt_tokens']}")
    if dry:  # and the torch engine's CUDA decode path (the model's forward, grouped attention) on the CPU
        out += ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
                "rollout.max_batch_size=4", "rollout.engine_options={fused = false, gqa_attention = true}"]
    return out


def suppress_eos() -> None:
    """Responses run to `max_new_tokens`: the torch engine's end-of-sequence ids are emptied (what vLLM's
    `ignore_eos` does), since a random model samples its EOS at random and lengths would vary run to run."""
    from rollwise.generate import torch_engine

    torch_engine._eos_ids = lambda model, tokenizer: set()


def recipe_shape(out: Path, dry: bool, shape: str, steps: int, reference: bool) -> dict:
    """`steps` steps of the GPU recipe's shape at `shape` (bf16); `reference`: HF generate beside the rollout."""
    model_dir = make_model(shape, out / f"model-{shape}", bf16=not dry)
    if torch.cuda.is_available():  # the first step's peak would otherwise include making the model
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    suppress_eos()
    overrides = recipe_overrides(dry)
    result = run_rollwise(model_dir, out / f"grpo-recipe-{shape}", "bf16", steps, overrides + [
        f"run.save_every_steps={steps + 1}"])  # no checkpoint: this part measures speed and memory
    result["overrides"] = overrides
    if reference:
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        cfg = dict(o.split("=", 1) for o in overrides)
        prompts, samples = int(cfg["rollout.prompts_per_step"]), int(cfg["rollout.samples_per_prompt"])
        ref = hf_generate(model_dir, prompts, samples, int(cfg["rollout.max_new_tokens"]))
        steady = [s["perf/rollout_tokens_per_s"] for s in result["per_step"][1:] if s["perf/rollout_tokens_per_s"]]
        ours = max(steady or [s["perf/rollout_tokens_per_s"] or 0.0 for s in result["per_step"]])
        ref["rollwise_rollout_tokens_per_s"] = ours  # the best step after the first (warm-up)
        ref["rollwise_over_hf"] = ours / ref["tokens_per_s"]
        ref["within_2x"] = ours >= ref["tokens_per_s"] / 2
        result["hf_generate"] = ref
    return result


def arith_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` training prompts of the default recipe (the built-in arithmetic task, seed 0) as the
    rollout encodes them (chat template, system prompt), token ids."""
    from rollwise.config_load import load_config
    from rollwise.data.prompts import encode_prompt
    from rollwise.data.sources import build_prompt_source

    data = load_config(ROOT / "recipes" / "quickstart.toml").data
    source = build_prompt_source(data, 0)
    return [encode_prompt(source.train_prompt(i), tokenizer, data.system_prompt) for i in range(count)]


def hf_generate(model_dir: Path, prompts: int, samples: int, new_tokens: int) -> dict:
    """Tokens per second of HF `generate` on the whole batch at once (prompts x samples rows, left-padded), sampled
    at temperature 1 with EOS banned until `new_tokens` (`min_new_tokens`), bf16, after a short warm-up call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    rows = [p for p in arith_prompts(tok, prompts) for _ in range(samples)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)  # [N, P] left-padded
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    ids, mask = ids.to(device), mask.to(device)

    def run(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == width + n, out.shape
        return time.perf_counter() - start

    run(min(8, new_tokens))  # warm-up
    seconds = run(new_tokens)
    return {"rows": len(rows), "new_tokens": new_tokens, "prompt_tokens_mean": sum(map(len, rows)) / len(rows),
            "seconds": seconds, "tokens_per_s": len(rows) * new_tokens / seconds}


def checkpoint_reloads(ckpt: Path) -> float:
    """Max |logit| difference between the checkpoint loaded by transformers and the same weights reloaded by
    rollwise (0.0: the file round-trips; a NaN or a failure to load would show here)."""
    from transformers import AutoModelForCausalLM

    from rollwise.models import load_model

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours, _ = load_model(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        return float((plain(input_ids=ids).logits - ours.eval()(input_ids=ids).logits).abs().max())


def fsdp_one_rank(model_dir: Path) -> dict:
    """One FSDP2 rank over NCCL (gloo on CPU) against the local trainer, on the same fabricated batch: the
    step's loss and weights must agree."""
    import copy

    from rollwise.config import AlgoConfig, TrainConfig
    from rollwise.models import load_model
    from rollwise.train.distributed import Rendezvous, free_port, init_process_group
    from rollwise.train.fsdp import FSDPTrainer
    from rollwise.train.trainer import Trainer
    from rollwise.types import Prompt, Sample, Status

    import torch.distributed as dist

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(str(model_dir), dtype=torch.float32)
    model = model.to(device)
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(Prompt(str(i), []), torch.randint(10, 200, (12,), generator=gen).tolist(),
                      torch.randint(10, 200, (16,), generator=gen).tolist(), [-2.0] * 16, [1] * 16,
                      Status.COMPLETED, i // 2, advantage=(1.0 if i % 2 else -1.0)) for i in range(4)]
    cfg = TrainConfig(precision="fp32", lr=1e-4, old_logprobs="behaviour")
    local = Trainer(copy.deepcopy(model), cfg, AlgoConfig(), tok.pad_token_id)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 1)
    store = rendezvous.store(0, 120.0)
    init_process_group(0, 1, store, device.type, 120.0)
    sharded = None
    try:
        sharded = FSDPTrainer(copy.deepcopy(model), cfg, AlgoConfig(), tok.pad_token_id, rank=0, world_size=1)
        a, b = sharded.step(copy.deepcopy(samples)), local.step(copy.deepcopy(samples))
        weights = sharded.policy_state()
    finally:
        if sharded is not None:
            sharded.close()  # ends the process group too
        elif dist.is_initialized():
            dist.destroy_process_group()
    gap = max(float((weights[k].to(device) - p.detach()).abs().max()) for k, p in local.model.named_parameters())
    return {"backend": dist.Backend.NCCL if device.type == "cuda" else dist.Backend.GLOO,
            "loss_fsdp": a["train/loss"], "loss_local": b["train/loss"], "weights_max_abs_diff": gap}


def trl_grpo(out: Path, dry: bool, rounds: int) -> dict:
    """TRL's GRPOTrainer at the `recipe` part's shape on its model (HF generate, no vLLM): each round generates
    prompts x samples completions of max_new_tokens (EOS banned until then, as for rollwise) and takes
    `minibatches_per_epoch` optimizer steps over them in micro-batches of about `train.micro_batch_tokens`;
    bf16, lr, clip range and token-mean loss as the recipe. Seconds per round (the first is a warm-up)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    shape = "tiny-qwen2" if dry else "qwen2.5-0.5b"
    model_dir = make_model(shape, out / f"model-{shape}", bf16=not dry)
    cfg = dict(o.split("=", 1) for o in recipe_overrides(dry))
    prompts, samples = int(cfg["rollout.prompts_per_step"]), int(cfg["rollout.samples_per_prompt"])
    new_tokens, updates = int(cfg["rollout.max_new_tokens"]), int(cfg["train.minibatches_per_epoch"])
    per_update = prompts * samples // updates  # sequences per optimizer step
    micro = max(1, min(per_update, int(cfg["train.micro_batch_tokens"]) // (new_tokens + 64)))
    while per_update % micro:
        micro -= 1
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(p) for p in arith_prompts(tok, prompts * rounds)]
    stamps: list[float] = []

    class Clock(TrainerCallback):  # each round's end also goes to part-trl.partial.json (kept if the budget ends it)
        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            if len(stamps) % updates == 0:
                ends = stamps[updates - 1 :: updates]
                (out / "part-trl.partial.json").write_text(json.dumps({"round_s": [
                    b - a for a, b in zip([start, *ends], ends)]}))

    def even_ids(completions, completion_ids, **kwargs):  # toy_plugins.even_id_fraction
        return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=micro, gradient_accumulation_steps=per_update // micro,
        steps_per_generation=prompts * samples // micro, num_generations=samples, max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": new_tokens}, temperature=1.0, top_p=1.0, learning_rate=1e-6, beta=0.0,
        epsilon=float(cfg["algo.clip_low"]), epsilon_high=float(cfg["algo.clip_high"]), loss_type="dapo",
        bf16=True, model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=False, max_steps=rounds * updates,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, use_vllm=False, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available())
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=even_ids, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts]), callbacks=[Clock()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    ends = stamps[updates - 1 :: updates]  # the end of each round
    round_s = [b - a for a, b in zip([start, *ends], ends)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    return {"rounds": len(round_s), "round_s": round_s, "sequences_per_round": prompts * samples,
            "new_tokens": new_tokens, "completion_length_mean": lengths, "micro_batch_sequences": micro,
            "optimizer_steps_per_round": updates,
            "completion_tokens_per_s": prompts * samples * new_tokens / min(round_s[1:] or round_s),
            "cuda_max_allocated_gib": peak}


# -- the parts, each in its own process with a time budget ---------------------------------------------------------
# name -> (seconds on the GPU, seconds with --dry); each GPU figure leaves room over a guess of the part's time
# (most wanted first: a part is not started when the check's budget has less left than it needs)
PARTS = {"recipe": (150, 240), "trl": (100, 240), "memory-1.5b": (90, 240), "fsdp": (30, 120),
         "quickstart": (60, 240)}


def run_part(name: str, out: Path, dry: bool) -> dict:
    """The work of part `name` in this process (called by `--part`); its JSON-ready result."""
    if name == "recipe":
        return recipe_shape(out, dry, "tiny-qwen2" if dry else "qwen2.5-0.5b", 3, reference=True)
    if name == "memory-1.5b":
        return recipe_shape(out, dry, "tiny-qwen2" if dry else "qwen2.5-1.5b", 1, reference=False)
    if name == "trl":
        return trl_grpo(out, dry, rounds=1 if dry else 2)
    small = "tiny" if dry else "smollm2-135m"
    model_dir = make_model(small, out / f"model-{small}")
    if name == "quickstart":
        return {f"{small}-{p}": grpo(model_dir, out / f"grpo-{small}-{p}", p, dry) for p in ("fp32", "bf16")}
    if name == "fsdp":
        return fsdp_one_rank(model_dir)
    raise ValueError(f"unknown part {name!r}: one of {', '.join(PARTS)}")


def spawn_part(name: str, out: Path, dry: bool, budget_s: float) -> dict:
    """Part `name` in a child process killed after `budget_s`: {"status": "ok" | "failed" | "skipped", ...}."""
    result = out / f"part-{name}.json"
    result.unlink(missing_ok=True)
    (out / f"part-{name}.partial.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out)] + (["--dry"] * dry)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, timeout=budget_s)
    except subprocess.TimeoutExpired:
        print(f"gpu_check: {name} skipped: over its {budget_s:.0f} s budget", flush=True)
        partial = out / f"part-{name}.partial.json"  # what the part recorded before it was stopped, if anything
        return {"status": "skipped", "why": f"over its {budget_s:.0f} s budget", "seconds": budget_s,
                **({"partial": json.loads(partial.read_text())} if partial.is_file() else {})}
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not result.is_file():
        print(f"gpu_check: {name} failed (exit {done.returncode}; its traceback is above)", flush=True)
        return {"status": "failed", "returncode": done.returncode, "seconds": seconds}
    print(f"gpu_check: {name} done in {seconds:.0f} s", flush=True)
    return {"status": "ok", "seconds": seconds, "result": json.loads(result.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on this machine's CPU (what CI runs)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated part names, run in that order")
    parser.add_argument("--budget-s", type=float, default=300.0, help="the whole check's time budget (GPU)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child: run one part, write part-NAME.json
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; use --dry to run the same code on the CPU", file=sys.stderr)
        return 2
    if args.part:
        (out / f"part-{args.part}.json").write_text(json.dumps(run_part(args.part, out, args.dry), indent=1))
        return 0
    summary: dict = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available()
                     else None, "dry": args.dry, "parts": {}}
    start = time.perf_counter()
    for name in args.parts.split(","):
        budget = PARTS[name][1 if args.dry else 0]
        left = args.budget_s - (time.perf_counter() - start)
        if not args.dry and left < budget:
            print(f"gpu_check: {name} skipped: {left:.0f} s left of the check's budget, it needs {budget} s",
                  flush=True)
            summary["parts"][name] = {"status": "skipped", "why": f"{left:.0f} s left of the check's budget"}
            continue
        summary["parts"][name] = spawn_part(name, out, args.dry, budget)
    results = {name: part.get("result") for name, part in summary["parts"].items()}
    summary["runs"] = results.get("quickstart") or {}
    summary["recipe"], summary["memory_1.5b"] = results.get("recipe"), results.get("memory-1.5b")
    summary["trl"], summary["fsdp2_one_rank"] = results.get("trl"), results.get("fsdp")
    summary["side_by_side"] = side_by_side(summary["recipe"], summary["trl"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "parts"}, indent=1))
    return 0 if all(p["status"] == "ok" for p in summary["parts"].values()) or not args.dry else 1


def side_by_side(recipe: dict | None, trl: dict | None) -> dict | None:
    """rollwise's step (rollout + four updates) against TRL's round (generation + four updates) on the same work:
    the best step / round after the first of each."""
    if not recipe or not trl:
        return None
    steps = [s["perf/step_s"] for s in recipe["per_step"] if s.get("perf/step_s")]
    ours, theirs = min(steps[1:] or steps), min(trl["round_s"][1:] or trl["round_s"])
    return {"rollwise_step_s": ours, "trl_round_s": theirs, "trl_over_rollwise": theirs / ours,
            "rollwise_cuda_max_allocated_gib": recipe["memory"]["cuda_max_allocated_gib"],
            "trl_cuda_max_allocated_gib": trl["cuda_max_allocated_gib"]}


if __name__ == "__main__":
    raise SystemExit(main())
