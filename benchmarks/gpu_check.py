"""The GPU check's work (run by `benchmarks/gpu_check.sh`): GRPO on CUDA at the default recipe's shape, the figures
a user needs from a GPU run, and FSDP2 on one rank over NCCL.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on the GPU machine (about 3-5 minutes)
    python benchmarks/gpu_check.py --out runs/gpu_check --dry      # the same code on this CPU, tiny shapes (CI)

No network and no embedded model there: the models are random-initialised at SmolLM2-135M's and Qwen2.5-0.5B's
shapes (tiny ones with `--dry`), with a word-level tokenizer whose vocabulary fills the model's, saved as local HF
folders. Each run is `rollwise train` (through `rollwise.loop.train`) on the built-in arithmetic task with the
default recipe's batch (8 prompts x 8 samples, 48 new tokens), the reward `toy_plugins:even_id_fraction` (a random
model gets arithmetic right too rarely for groups to vary). Reported per run: the engine-vs-trainer log-prob gap
of every step (`mismatch/logprob_abs_diff_mean`, like with like), the sync probe's gap, rollout and train tok/s,
MFU against the device's measured peak of the precision used, peak GPU memory beside the memory estimate
(`rollwise.train.memory_config.estimate_dict`, what `--dry-run` prints), and whether the checkpoint loads in
transformers with the trained weights. The FSDP2 check compares one NCCL rank's step with the local trainer's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # rollwise from this tree, tests/toy_plugins for the reward

SHAPES = {  # HF config of each model shape: the real models' dimensions, random weights
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048, rope_theta=10000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=1000000.0),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=512),
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


def make_model(shape: str, folder: Path) -> Path:
    """A random-initialised model of `shape` and its tokenizer, saved to `folder` (seeded: the same each time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(SHAPES[shape])
    tok = word_tokenizer(params["vocab_size"])
    config = AutoConfig.for_model(**params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def grpo(model_dir: Path, run_dir: Path, precision: str, dry: bool) -> dict:
    """Steps of GRPO at the default recipe's shape (`train.precision` and `model.dtype` per `precision`)."""
    from rollwise.loop import train
    from rollwise.validate import load

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    steps, shape = (2, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8"]) \
        if dry else (5, [])
    cfg = load(ROOT / "recipes" / "quickstart.toml", [
        f"model.name={model_dir}", f"model.dtype={dtype}", f"train.precision={precision}", "train.device=auto",
        f"train.steps={steps}", "eval.n=0", "reward.fn=toy_plugins:even_id_fraction", "run.console=false",
        "run.report=false", f"run.save_every_steps={steps}", "data.max_prompt_tokens=96", *shape])
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    keys = ["mismatch/logprob_abs_diff_mean", "mismatch/k3", "sync/logprob_max_abs_diff", "perf/rollout_tokens_per_s",
            "perf/train_tokens_per_s", "perf/rollout_mfu", "perf/train_mfu", "perf/mfu", "perf/peak_gflops_train",
            "perf/peak_gflops_rollout", "perf/cuda_peak_allocated_gb", "perf/step_s"]
    from rollwise.train.memory_config import estimate_dict

    peaks = [r["perf/cuda_peak_allocated_gb"] for r in rows if r.get("perf/cuda_peak_allocated_gb") is not None]
    return {"precision": precision, "device": str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
            "wall_s": time.perf_counter() - start, "per_step": [{k: r.get(k) for k in keys} for r in rows],
            "memory": {"estimate": estimate_dict(cfg), "cuda_max_allocated_gib": max(peaks, default=None)},
            "checkpoint_logit_max_abs_diff": checkpoint_reloads(run_dir / "checkpoints" / f"step-{steps}")}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on this machine's CPU (what CI runs)")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; use --dry to run the same code on the CPU", file=sys.stderr)
        return 2
    summary: dict = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available()
                     else None, "dry": args.dry, "runs": {}}
    small = "tiny" if args.dry else "smollm2-135m"
    model_dir = make_model(small, out / f"model-{small}")
    for precision in ("fp32", "bf16"):
        summary["runs"][f"{small}-{precision}"] = grpo(model_dir, out / f"grpo-{small}-{precision}", precision,
                                                       args.dry)
    if not args.dry:
        big = make_model("qwen2.5-0.5b", out / "model-qwen2.5-0.5b")
        summary["runs"]["qwen2.5-0.5b-bf16"] = grpo(big, out / "grpo-qwen2.5-0.5b-bf16", "bf16", args.dry)
    summary["fsdp2_one_rank"] = fsdp_one_rank(model_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
