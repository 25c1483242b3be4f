"""Gradient checkpointing (`train.gradient_checkpointing`) and the memory estimate (`rollwise.train.memory`).

- Checkpointing changes nothing but memory: the same log-probs, loss and gradients (fp32, assert_close defaults)
  with the trainer's block attention (`rollwise_shared`) and plain SDPA, and the same step on the LoRA backend
  and with a frozen layer subset; the layers really run twice.
- The estimate's arithmetic, by hand on a small shape; `--dry-run` prints it as TOML comments; a run that cannot
  fit is refused with exit 2 in one line naming what to change.
- The estimate against a measured peak: a training step on the CPU under torch's memory profiler (every tensor
  allocation and free, in order), a 4-layer model (hidden 256, vocab 4096) at 2048-token micro-batches.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch
from torch.testing import assert_close
from typer.testing import CliRunner

from conftest import ROLLWISE, subprocess_env, tiny_overrides
from helpers_model import tiny_llama
from rollwise.cli import app
from rollwise.config import AlgoConfig, LoraConfig, TrainConfig
from rollwise.train.activation_checkpointing import configure_checkpointing
from rollwise.train.logprobs import token_logprobs
from rollwise.train.memory import (AUTO_PARAMS, ModelShape, StepSetup, decide_checkpointing, kv_cache_bytes,
                                   layer_bytes_per_token, shape_of, step_parts, training_estimate)
from rollwise.train.memory_config import MEMORY_ENV
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

VOCAB = 97


def make_samples(vocab: int, prompts: int = 3, group: int = 4, prompt_len: int = 6, seed: int = 0) -> list[Sample]:
    """`prompts` groups of `group` responses of 2-9 random tokens, advantages +-1, behaviour log-probs -3."""
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [-3.0] * len(resp), [1] * len(resp),
                              Status.COMPLETED, g, advantage=rng.choice([-1.0, 1.0])))
    return out


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # (a recompute stops early)
    return calls


# -- checkpointing changes nothing but memory --------------------------------------------------------------
@pytest.mark.parametrize("share_prompt", [True, False])
def test_checkpointing_gives_the_same_logprobs_loss_and_gradients(share_prompt):
    samples = make_samples(VOCAB)
    runs = []
    for on in (False, True):
        model = tiny_llama(VOCAB, seed=3)
        cfg = TrainConfig(share_prompt=share_prompt, gradient_checkpointing=on, micro_batch_tokens=64)
        trainer = Trainer(model, cfg, AlgoConfig(), pad_id=0)
        assert trainer.gradient_checkpointing is on
        assert (model.config._attn_implementation == "rollwise_shared") is share_prompt
        calls = _count_calls(model.model.layers[0])
        model.train()
        mbs = trainer._micro_batches(samples)
        assert len(mbs) > 1  # gradients accumulate over micro-batches
        logps, loss = [], torch.zeros(())
        for mb in mbs:
            logp, entropy = token_logprobs(model, mb)
            part = -(logp * mb.advantages[:, None] * mb.loss_mask).sum() - 0.1 * (entropy * mb.loss_mask).sum()
            part.backward()
            logps.append(logp.detach())
            loss += part.detach()
        assert calls[0] == len(mbs) * (2 if on else 1)  # on: each layer recomputed in backward
        runs.append((loss, logps, {n: p.grad for n, p in model.named_parameters()}))
    (loss_off, logps_off, grads_off), (loss_on, logps_on, grads_on) = runs
    assert_close(loss_on, loss_off)
    for a, b in zip(logps_on, logps_off):
        assert_close(a, b)
    assert grads_on.keys() == grads_off.keys() and all(g is not None for g in grads_on.values())
    for name in grads_off:
        assert_close(grads_on[name], grads_off[name])


def _step_weights(model, cfg: TrainConfig, trainer_cls=Trainer, **kwargs):
    trainer = trainer_cls(model, cfg, AlgoConfig(), pad_id=0, **kwargs)
    metrics = trainer.step(make_samples(VOCAB))
    return trainer, metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["local", "layers", "lora"])
def test_a_step_with_checkpointing_equals_the_step_without(backend):
    if backend == "lora":
        pytest.importorskip("peft")
    results = []
    for on in (False, True):
        cfg = TrainConfig(lr=1e-2, gradient_checkpointing=on, trainable="layers:1" if backend == "layers" else "all")
        model = tiny_llama(VOCAB, seed=5)
        if backend == "lora":
            from rollwise.train.lora import apply_lora
            from rollwise.train.lora_trainer import LoraTrainer

            model = apply_lora(model, LoraConfig(rank=4), seed=0)
            results.append(_step_weights(model, cfg, LoraTrainer, tokenizer=None))
        else:
            results.append(_step_weights(model, cfg))
    (off, m_off, w_off), (on, m_on, w_on) = results
    assert on.gradient_checkpointing and not off.gradient_checkpointing
    base = on.model.get_base_model() if backend == "lora" else on.model
    assert base.model.layers[0].gradient_checkpointing
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert_close(m_on[key], m_off[key])
    for name in w_off:
        assert_close(w_on[name], w_off[name])
    assert any(not torch.equal(w_on[n], tiny) for n, tiny in _start_weights(backend).items())  # it trained


def _start_weights(backend: str) -> dict[str, torch.Tensor]:
    model = tiny_llama(VOCAB, seed=5)
    if backend == "lora":
        from rollwise.train.lora import apply_lora

        model = apply_lora(model, LoraConfig(rank=4), seed=0)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_auto_is_on_from_a_billion_parameters_or_when_the_estimate_does_not_fit(monkeypatch):
    assert decide_checkpointing("auto", AUTO_PARAMS, 1, 10**12) == (True, "auto: 1.00B parameters")
    assert decide_checkpointing("auto", 10**6, 95, 100)[0] is True  # past 90% of what is left
    assert decide_checkpointing("auto", 10**6, 85, 100) == (False, "auto: fits without it")
    assert decide_checkpointing(False, AUTO_PARAMS, 10**12, 1) == (False, "set")
    model = tiny_llama(VOCAB)
    trainer = Trainer(model, TrainConfig(), AlgoConfig(), pad_id=0)  # a tiny model: plenty of memory
    assert trainer.gradient_checkpointing is False and not model.model.layers[0].gradient_checkpointing
    monkeypatch.setenv(MEMORY_ENV, "0.002")  # 2 MiB of device memory: the step would not fit without it
    trainer.cfg = TrainConfig(micro_batch_tokens=4096)
    assert configure_checkpointing(trainer) is True and model.model.layers[0].gradient_checkpointing


# -- the estimate's arithmetic ---------------------------------------------------------------------------
# 2 layers, H 8, I 16, 2 heads of 4 (q 8), 1 kv head (kv 4), vocab 32 tied; per layer q 8x8, k/v 8x4, o 8x8,
# gate/up 8x16, down 16x8 = 576 linear weights + 2 norms of 8 = 592; N = 32*8 embedding + 2*592 + final norm 8
LINEARS = tuple((f"model.layers.{i}.{name}", i_, o) for i in range(2) for name, i_, o in [
    ("self_attn.q_proj", 8, 8), ("self_attn.k_proj", 8, 4), ("self_attn.v_proj", 8, 4), ("self_attn.o_proj", 8, 8),
    ("mlp.gate_proj", 8, 16), ("mlp.up_proj", 8, 16), ("mlp.down_proj", 16, 8)])
SMALL = ModelShape(model_type="llama", layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4,
                   vocab=32, params=1448, linears=LINEARS, layer_params=(592, 592))


def test_the_estimate_by_hand_on_a_small_shape():
    assert SMALL.linear_params == 1152
    # s fp32 = 4 (6H + 2q + 2kv + 4I) + 4 nh + 8 = 4 (48 + 16 + 8 + 64) + 16; bf16 = 16H + 2 (5H + 2q + 2kv + 4I) + 16
    assert layer_bytes_per_token(SMALL, bf16=False) == 560
    assert layer_bytes_per_token(SMALL, bf16=True) == 128 + 2 * (40 + 16 + 8 + 64) + 16 == 400
    off = StepSetup(tokens=100, bf16=False, checkpointing=False)
    parts = step_parts(SMALL, off)
    assert parts == {"gradients": 4 * 1448, "activations": 100 * 2 * 560 + 100 * (12 * 8 + 8 * 4),  # T (L s + o)
                     "lm-head chunk": 100 * 32 * 16, "autocast copies": 0, "one layer": 100 * 560,
                     "backward buffers": 3 * 100 * 16 * 4}
    est = training_estimate(SMALL, off)
    assert est.parts["weights"] == 5792 and est.parts["optimizer"] == 11584
    assert est.step_peak == max(124800 + 51200, 5792 + 56000 + 19200) == 176000  # the start of backward
    assert est.total == 5792 + 11584 + 176000
    on = training_estimate(SMALL, StepSetup(tokens=100, bf16=False, checkpointing=True))
    assert on.parts["activations"] == 100 * 2 * 4 * 8 + 12800  # each layer's fp32 input, plus outside
    # the start of backward: every layer's input + the top layer recomputed (larger than the LM-head chunk here);
    # its end: the gradients + one layer + the first layer's input
    assert on.step_peak == max(19200 + max(51200, 56000 + 19200), 5792 + 56000 + 19200 + 100 * 4 * 8) == 94400
    bf16 = training_estimate(SMALL, StepSetup(tokens=100, bf16=True, checkpointing=False, reference=True))
    assert bf16.parts["autocast copies"] == 2 * (1152 + 32 * 8)
    assert bf16.parts["lm-head chunk"] == 100 * 32 * 18
    assert bf16.parts["reference"] == 2 * 1152 + 4 * (1448 - 1152)  # its linears in bf16
    assert kv_cache_bytes(SMALL, slots=4, context=10, dtype_bytes=2) == 4 * 10 * 2 * 2 * 1 * 4 * 2


def test_lora_and_layer_subsets_train_and_keep_less():
    lora = training_estimate(SMALL, StepSetup(tokens=100, bf16=False, checkpointing=False, lora=(2, ["q_proj"])))
    assert lora.parts["optimizer"] == 8 * 2 * 2 * (8 + 8)  # 2 layers x rank 2 x (in + out), 2 fp32 states
    subset = training_estimate(SMALL, StepSetup(tokens=100, bf16=False, checkpointing=False, trained_layers=[1]))
    assert subset.parts["gradients"] == 4 * 592
    assert subset.parts["activations"] == 100 * 1 * 560 + 12800  # layer 0 is frozen below: it keeps nothing


def test_shape_of_a_real_model_counts_its_parameters():
    model = tiny_llama(VOCAB, tie_word_embeddings=False)
    shape = shape_of(model)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim) == \
        (2, 64, 128, 4, 2, 16)
    assert shape.linear_params + 2 * VOCAB * 64 + 64 * 5 == shape.params  # + embeddings, head and 5 norms


# -- the dry run --------------------------------------------------------------------------------------------
def test_dry_run_prints_the_estimate_as_comments(tiny_model_dir, tmp_path, monkeypatch):
    import tomllib

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(tiny_model_dir, **{
        "train.device": "cpu", "train.micro_batch_tokens": 512})])
    assert result.exit_code == 0, result.output
    assert tomllib.loads(result.stdout)["train"]["gradient_checkpointing"] == "auto"  # still a recipe
    table = [line for line in result.stdout.splitlines() if line.startswith("#   ")]
    names = [line.split()[1] for line in table]
    for name in ("weights", "optimizer", "gradients", "activations", "lm-head", "step", "kv", "total"):
        assert name in names, result.stdout
    assert "2 layers x 512 tokens, checkpointing off (auto: fits without it)" in result.stdout
    assert list(tmp_path.iterdir()) == []


def big_model_dir(tmp_path):
    """A config.json alone, of Qwen2.5-1.5B's shapes (no weights: the estimate reads only this)."""
    folder = tmp_path / "big"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=32768)))
    return folder


# full fine-tuning in bf16 at 8192-token micro-batches: about 52 GiB without checkpointing, 30 GiB with it
BIG = ["train.device=cpu", "train.precision=bf16", "model.dtype=bfloat16", "train.micro_batch_tokens=8192"]


def test_a_run_that_cannot_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(MEMORY_ENV, "40")
    result = CliRunner().invoke(app, ["train", "--dry-run", f"model.name={big_model_dir(tmp_path)}", *BIG,
                                      "train.gradient_checkpointing=false"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the run needs about 52."), result.stderr
    for fix in ("set train.gradient_checkpointing = true (29.", "lower train.micro_batch_tokens to 4096",
                "use LoRA, lora.rank = 16"):
        assert fix in lines[0], lines[0]
    monkeypatch.setenv(MEMORY_ENV, "10")  # the weights of the policy and the engine alone take 11 GiB
    result = CliRunner().invoke(app, ["train", "--dry-run", f"model.name={tmp_path / 'big'}", *BIG])
    assert result.exit_code == 2 and "use a device with more memory or a smaller model" in result.stderr


def test_auto_at_dry_run_is_on_for_a_billion_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(MEMORY_ENV, "40")
    result = CliRunner().invoke(app, ["train", "--dry-run", f"model.name={big_model_dir(tmp_path)}", *BIG])
    assert result.exit_code == 0, result.output
    assert "28 layers x 8192 tokens, checkpointing on (auto: 1.54B parameters)" in result.stdout, result.stdout


# -- estimate against a measured peak ----------------------------------------------------------------------
def _profiled_peak_bytes(run) -> int:
    """The highest total of CPU tensor bytes allocated while `run()` ran, above what was allocated before: every
    allocation and free the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    total = peak = 0
    for _, size in sorted(events):
        total += size
        peak = max(peak, total)
    return peak


def _full_micro_batch(vocab: int) -> list[Sample]:
    """4 prompts of 32 tokens x 8 responses of 60: one packed micro-batch of exactly 2048 tokens."""
    rng = random.Random(0)
    return [Sample(Prompt(str(g), []), prompt, [rng.randrange(3, vocab) for _ in range(60)], [-8.0] * 60, [1] * 60,
                   Status.COMPLETED, g, advantage=rng.choice([-1.0, 1.0]))
            for g, prompt in enumerate([[rng.randrange(3, vocab) for _ in range(32)] for _ in range(4)])
            for _ in range(8)]


# Measured on the development CPU (MiB; weights 23 + AdamW 46 + the step's peak, estimate in brackets): fp32 off
# 317.3 (308.2, 0.97), fp32 on 159.1 (168.1, 1.06), bf16 off 244.2 (249.7, 1.02), bf16 on 132.2 (138.1, 1.04).
# With checkpointing the estimate is above the timeline (gradients are counted whole while the first layers
# recompute); without it the saved activations dominate and it is within a few percent. Tolerance: the total
# within 15% either way (the GPU target), so an estimate that undercounts a part fails here.
TOLERANCE = 0.15


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # slow: no native bf16
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_is_within_tolerance_of_the_measured_step_peak(precision, checkpointing):
    vocab, tokens = 4096, 2048
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # about 5 s a case on one core
    try:
        _check_estimate_against_measured(vocab, tokens, precision, checkpointing)
    finally:
        torch.set_num_threads(threads)


def _check_estimate_against_measured(vocab: int, tokens: int, precision: str, checkpointing: bool) -> None:
    model = tiny_llama(vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=1024, tie_word_embeddings=False)
    cfg = TrainConfig(micro_batch_tokens=tokens, precision=precision, gradient_checkpointing=checkpointing)
    trainer = Trainer(model, cfg, AlgoConfig(), pad_id=0)
    samples = _full_micro_batch(vocab)
    assert [mb.computed_tokens for mb in trainer._micro_batches(samples)] == [tokens]
    trainer.step(samples)  # AdamW's state exists from here on, as in every later step
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *(
        v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v))])
    measured = held + _profiled_peak_bytes(lambda: trainer.step(samples))
    estimate = training_estimate(shape_of(model), StepSetup(tokens=tokens, bf16=trainer.bf16,
                                                            checkpointing=checkpointing)).total
    ratio = estimate / measured
    print(f"{precision} checkpointing={checkpointing}: measured {measured / 2**20:.1f} MiB, "
          f"estimated {estimate / 2**20:.1f} MiB ({ratio:.3f})")
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE


# -- a real run ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_steps_of_rollwise_train_with_checkpointing(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, **{"train.gradient_checkpointing": True, "eval.n": 4,
                                                  "reward.fn": "toy_plugins:digit_fraction", "run.report": False})
    proc = subprocess.run([ROLLWISE, "train", "--run-dir", str(run_dir), *overrides], capture_output=True, text=True,
                          timeout=300, env=subprocess_env())
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["train/grad_norm"] > 0 for r in train_rows)
    assert "gradient_checkpointing = true" in (run_dir / "config.toml").read_text()


@pytest.mark.slow
def test_fsdp2_ranks_with_checkpointing_equal_the_local_trainer_without(tiny_model_dir):
    import copy

    from conftest import tiny_config
    from rollwise.models import load_model
    from rollwise.train.launch import build_trainer

    cfg = tiny_config(tiny_model_dir, **{"train.backend": "fsdp2", "train.world_size": 2, "train.lr": 1e-3,
                                         "train.micro_batch_tokens": 64, "train.gradient_checkpointing": True})
    model, tokenizer = load_model(str(tiny_model_dir))
    local_cfg = cfg.train.model_copy(update={"backend": "local", "world_size": 1, "gradient_checkpointing": False})
    local = Trainer(copy.deepcopy(model), local_cfg, cfg.algo, tokenizer.pad_token_id)
    samples = make_samples(len(tokenizer))
    fsdp = build_trainer(cfg, model, tokenizer.pad_token_id, None, str(tiny_model_dir))
    try:
        assert fsdp.gradient_checkpointing
        got, want = fsdp.step(copy.deepcopy(samples)), local.step(copy.deepcopy(samples))
        weights = fsdp.policy_state()
    finally:
        fsdp.close()
    assert_close(got["train/loss"], want["train/loss"])
    for name, param in local.model.named_parameters():
        assert_close(weights[name], param.detach(), rtol=1e-5, atol=1e-6)
