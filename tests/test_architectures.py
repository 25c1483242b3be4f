"""The architectures users bring, as a tested guarantee (docs/guide.md "Architectures and chat templates").

For each tiny random model of `helpers_model.ARCHITECTURES` (saved as a local HF directory with the tiny
tokenizer and loaded the way a run loads it):
- the torch engine's behaviour log-probs of its sampled tokens equal the trainer's (plain and prompt-shared
  rows) and the model's own forward, fp32, 1e-4, with a prompt longer than every sliding window;
- the fused decoder is used only where it reproduces the model (prefill and decode logits, 1e-5), for every
  model type it claims; everywhere else the engine falls back to the model's forward;
- two GRPO steps run through `rollwise train model.name=DIR`, with engine and trainer agreeing in every
  step's `mismatch/*`, and the checkpoint loads with `AutoModelForCausalLM.from_pretrained` and gives the
  trained weights' logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, CohereConfig, CohereForCausalLM
from typer.testing import CliRunner

from conftest import read_rows, tiny_overrides
from helpers_model import ARCHITECTURES, tiny_arch
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate.fused_decode import SUPPORTED_MODEL_TYPES, FusedDecoder
from rollwise.generate.groups import make_groups, make_requests
from rollwise.generate.slot_cache import SlotCache
from rollwise.generate.torch_engine import TorchEngine
from rollwise.models import load_model_dir
from rollwise.models.arch import ArchitectureError, describe
from rollwise.models.compat import cache_kwargs
from rollwise.train.batching import collate
from rollwise.train.logprobs import token_logprobs
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION
from rollwise.types import Prompt, Sample, SamplingParams, Status

NAMES = list(ARCHITECTURES)
# (what the fused decoder claims) name -> tiny_arch arguments; every SUPPORTED_MODEL_TYPES entry appears
FUSED_CLAIMS = {
    "llama": ("llama", {}),
    "llama3": ("llama3", {}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
    "llama-biases-untied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
# every other architecture: the reason it is refused
FUSED_REFUSED = {"mistral-window": "sliding-window", "gemma2": "model_type", "gemma3": "model_type",
                 "phi3": "model_type", "olmo2": "model_type", "gpt_neox": "model_type"}
FUSED_REFUSED_VARIANTS = {
    "llama-dynamic-rope": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type"),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    "qwen2-sliding-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                             "sliding-window"),
}
LONG_TEXT = "What is 7 + 3? Compute 12 - 5. The product of 4 and 5 is 20. " * 2  # 40+ tokens: over every window


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def build(tok, name: str, **overrides):
    return tiny_arch(name, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """`model_dir(name)`: the tiny model of `name` saved with the tiny tokenizer (built once per module)."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            build(tok, name).save_pretrained(made[name])
            tok.save_pretrained(made[name])
        return made[name]

    return get


def prompts(tok) -> list[tuple[Prompt, list[int]]]:
    texts = [LONG_TEXT, "Compute 12 - 5."]
    out = [(Prompt(str(i), []), tok(t, add_special_tokens=False).input_ids) for i, t in enumerate(texts)]
    assert len(out[0][1]) > 32  # longer than every sliding window here (8), and than 2 windows of prompt + reply
    return out


def forward_logprobs(model, samples, temperature: float) -> list[float]:
    """Each sample alone through the model's own forward (its logits, soft caps included)."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=model.device)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1).cpu()
        start = len(s.prompt_ids) - 1
        out += [float(logp[start + i, t]) for i, t in enumerate(s.response_ids)]
    return out


def trainer_logprobs(model, samples, pad_id: int, temperature: float, share: bool) -> torch.Tensor:
    trainer_model = copy.deepcopy(model)
    if share:
        trainer_model.set_attn_implementation(SHARED_ATTENTION)
    mb = collate(samples, pad_id, share_prompt=share).to(model.device)
    with torch.no_grad():
        logp, _ = token_logprobs(trainer_model, mb, temperature=temperature)
    return logp[mb.valid]  # the samples' tokens in order (collate keeps them in prompt order here)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_engine_logprobs_equal_trainer_and_model_forward(name, device, model_dir):
    model, tok = load_model_dir(model_dir(name))  # as a run loads it (Gemma 2: eager attention, for its cap)
    model = model.to(device)
    temperature = 0.8
    engine = TorchEngine(model, tok, seed=1)
    assert (engine.fused is not None) == (device == "cpu" and name in FUSED_CLAIMS)
    group = prompts(tok)
    results = engine.generate(make_requests(group, 3, SamplingParams(max_new_tokens=12, temperature=temperature)))
    samples = [s for g in make_groups(group, 3, results) for s in g.samples]
    behaviour = torch.tensor([lp for s in samples for lp in s.behaviour_logprobs])
    assert behaviour.numel() >= 40
    for share in (False, True):
        trainer = trainer_logprobs(model, samples, tok.pad_token_id, temperature, share).cpu()
        assert_close(trainer, behaviour, atol=1e-4, rtol=0, msg=f"{name}: trainer (share_prompt={share})")
    assert_close(torch.tensor(forward_logprobs(model, samples, temperature)), behaviour, atol=1e-4, rtol=0)


def _logp_and_grads(model, samples, pad_id: int, share: bool):
    model.zero_grad()
    mb = collate(samples, pad_id, share_prompt=share).to(model.device)
    logp, entropy = token_logprobs(model, mb, temperature=0.8)
    adv = torch.linspace(-1.0, 1.0, len(mb.samples), device=model.device)[:, None]
    ((logp * adv + 0.1 * entropy) * mb.valid).sum().backward()
    order = sorted(range(len(mb.samples)), key=lambda i: samples.index(mb.samples[i]))
    return logp[order].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("form", ["split", "prefix"])
@pytest.mark.parametrize("name", NAMES)
def test_packed_segment_attention_equals_the_plain_per_sample_forward(name, form, model_dir, monkeypatch):
    """The packed prompt-shared row (segments through one fused causal kernel, windows and soft caps where the
    architecture has them) gives the log-probs, entropies' gradients and parameter gradients of one padded row
    per sample, fp32, 1e-5; responses of varied length, one of them empty. Both segment forms: `split` (the CPU's)
    and `prefix` (CUDA's), forced here on the CPU."""
    from rollwise.train import shared_attention

    monkeypatch.setattr(shared_attention, "FORCE_FORM", form)
    model, tok = load_model_dir(model_dir(name))
    group = prompts(tok)
    lengths = [0, 3, 9, 14, 6, 11]
    samples = []
    for g, (prompt, ids) in enumerate(group):
        for k in range(3):
            n = lengths[g * 3 + k]
            resp = [(7 * j + 11 * k + g) % (len(tok) - 10) + 5 for j in range(n)]
            samples.append(Sample(prompt, ids, resp, [0.0] * n, [1] * n, Status.COMPLETED, g))
    plain_logp, plain_grads = _logp_and_grads(model, samples, tok.pad_token_id, share=False)
    model.set_attn_implementation(SHARED_ATTENTION)
    packed_logp, packed_grads = _logp_and_grads(model, samples, tok.pad_token_id, share=True)
    assert_close(packed_logp, plain_logp, rtol=1e-5, atol=1e-5)
    assert plain_grads.keys() == packed_grads.keys()
    for key, grad in plain_grads.items():
        assert_close(packed_grads[key], grad, rtol=1e-5, atol=1e-5, msg=f"{name}: {key}")


def test_gemma2_soft_caps_change_the_numbers_so_the_check_above_can_fail(tok):
    """The Gemma 2 case is meaningful: its caps move the logits, and SDPA (which skips the attention cap)
    differs from the eager attention the loaded model runs."""
    model = build(tok, "gemma2")
    ids = torch.tensor([tok(LONG_TEXT, add_special_tokens=False).input_ids])
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids).logits
        uncapped = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)
    assert (sdpa - eager).abs().max() > 1e-2
    assert (uncapped - eager).abs().max() > 1e-2


def test_describe_reads_the_geometry_the_model_uses(tok):
    neox = describe(build(tok, "gpt_neox"))  # config: num_key_value_heads=2, head_dim=8, sliding_window=8
    assert (neox.layers, neox.kv_heads, neox.key_dim, neox.value_dim, neox.windows) == (2, 4, 16, 16, (None, None))
    assert describe(build(tok, "llama", sliding_window=8)).windows == (None, None)  # Llama ignores the key
    assert describe(build(tok, "mistral-window")).windows == (8, 8)
    assert describe(build(tok, "phi3")).windows == (8, 8)
    gemma3 = describe(build(tok, "gemma3"))
    assert gemma3.windows == (8, None) and gemma3.mask_keys == ("full_attention", "sliding_attention")
    gemma2 = describe(build(tok, "gemma2"))
    assert (gemma2.windows, gemma2.logit_softcap, gemma2.attn_softcap) == ((8, None), 2.0, 0.5)


def test_a_model_whose_logits_are_not_its_head_is_refused_in_one_line(tok):
    config = CohereConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=128, logit_scale=0.25, bos_token_id=None, eos_token_id=None,
                          pad_token_id=tok.pad_token_id)
    with pytest.raises(ArchitectureError, match=r"model_type 'cohere'.*not its LM head") as err:
        TorchEngine(CohereForCausalLM(config).eval(), tok)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------- fused decoder


def _random_cache(model, lengths, capacity=24):
    arch = describe(model)
    cache = SlotCache(arch.layers, len(lengths), arch.kv_heads, capacity, arch.key_dim, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    cache.lengths[:] = torch.tensor(lengths)
    return cache


def test_fused_claims_cover_every_supported_model_type():
    assert set(FUSED_CLAIMS) & set(NAMES) | set(FUSED_REFUSED) == set(NAMES)  # every architecture is one or other
    claimed = {getattr(transformers, ARCHITECTURES[base][0]).model_type for base, _ in FUSED_CLAIMS.values()}
    assert claimed == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("claim", list(FUSED_CLAIMS))
def test_fused_decoder_reproduces_every_architecture_it_claims(claim, tok):
    base, overrides = FUSED_CLAIMS[claim]
    model = build(tok, base, **overrides)
    assert model.config.model_type in SUPPORTED_MODEL_TYPES
    assert FusedDecoder.refusal(model) is None
    fused = FusedDecoder(model)
    contexts = [[5, 9, 13, 2, 7, 30, 31, 40, 41, 50], [4, 4], [8, 1, 6]]
    width = max(len(c) for c in contexts)
    ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
    logits, layer_kv = fused.prefill(ids, torch.tensor([len(c) for c in contexts]))
    for row, context in enumerate(contexts):  # prefill: each context alone, unpadded, through the model
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([context]), use_cache=True)
        assert_close(logits[row], out.logits[0, -1], atol=1e-5, rtol=1e-5)
        for layer, (k, v) in enumerate(layer_kv):
            assert_close(k[row, :, : len(context)], out.past_key_values.layers[layer].keys[0], atol=1e-5, rtol=1e-5)
    lengths = [3, 17, 9, 1]  # decode: slots at different lengths, one inactive (row 1)
    step_ids = torch.tensor([5, 11, 42, 7])
    ref_cache, fused_cache = _random_cache(model, lengths), _random_cache(model, lengths)
    positions, mask = ref_cache.begin_step()
    with torch.inference_mode():
        ref = model(input_ids=step_ids[:, None], attention_mask=mask, position_ids=positions,
                    **cache_kwargs(model, ref_cache), use_cache=True).logits[:, -1]
    positions, _ = fused_cache.begin_step()
    rows = torch.tensor([0, 2, 3])
    assert_close(fused.step(step_ids, positions[:, 0], fused_cache, rows), ref[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(FUSED_REFUSED) + list(FUSED_REFUSED_VARIANTS))
def test_fused_decoder_refuses_the_rest_and_the_engine_falls_back(name, tok):
    if name in FUSED_REFUSED:
        model, reason = build(tok, name), FUSED_REFUSED[name]
    else:
        base, overrides, reason = FUSED_REFUSED_VARIANTS[name]
        model = build(tok, base, **overrides)
    assert reason in (FusedDecoder.refusal(model) or "")
    engine = TorchEngine(model, tok, seed=0)
    assert engine.fused is None
    if name in FUSED_REFUSED_VARIANTS:  # (the architectures above are checked for agreement in the first test)
        group = prompts(tok)
        results = engine.generate(make_requests(group, 2, SamplingParams(max_new_tokens=8)))
        samples = [s for g in make_groups(group, 2, results) for s in g.samples]
        behaviour = torch.tensor([lp for s in samples for lp in s.behaviour_logprobs])
        assert_close(torch.tensor(forward_logprobs(model, samples, 1.0)), behaviour, atol=1e-4, rtol=0)
        for share in (False, True):
            assert_close(trainer_logprobs(model, samples, tok.pad_token_id, 1.0, share), behaviour, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------- the user's path (CLI)


@pytest.mark.parametrize("name", NAMES)
def test_two_grpo_steps_through_the_cli_and_the_checkpoint_loads(name, model_dir, tmp_path, monkeypatch):
    import rollwise.loop
    from rollwise.cli import app

    opened = []
    open_run = rollwise.loop.open_run
    monkeypatch.setattr(rollwise.loop, "open_run", lambda *a, **k: opened.append(open_run(*a, **k)) or opened[-1])
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(model_dir(name), **{"reward.fn": "toy_plugins:digit_fraction", "eval.n": 0,
                                                    "run.report": False, "model.dtype": "float32",
                                                    "train.precision": "fp32"})  # (the recipe's: auto)
    result = CliRunner().invoke(app, ["train", "--run-dir", str(run_dir), *overrides])
    assert result.exit_code == 0, result.output
    rows = [r for r in read_rows(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/tokens"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-4 for r in rows), [r["mismatch/logprob_abs_diff_max"]
                                                                          for r in rows]
    trained = opened[0].trainer.model
    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-2", attn_implementation="eager")
    ids = torch.tensor([tok_ids(model_dir(name))])
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        start = AutoModelForCausalLM.from_pretrained(model_dir(name))(input_ids=ids).logits
    assert (start - trained(input_ids=ids).logits).abs().max() > 1e-4  # it did train


def tok_ids(path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(LONG_TEXT, add_special_tokens=False).input_ids


def test_soft_capped_head_gradients_equal_autograd_of_the_formula():
    """The trainer's chunked LM-head log-prob (its own backward) with Gemma 2's final soft cap."""
    from rollwise.train.logprobs import _HeadLogprob

    gen = torch.Generator().manual_seed(0)
    h, weight = torch.randn(6, 8, generator=gen), torch.randn(20, 8, generator=gen) * 2
    targets, cap = torch.randint(0, 20, (6,), generator=gen), 1.5
    g_logp, g_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    ours = [t.clone().requires_grad_() for t in (h, weight)]
    logp, ent = _HeadLogprob.apply(*ours, targets, True, cap)
    (logp * g_logp + ent * g_ent).sum().backward()
    ref = [t.clone().requires_grad_() for t in (h, weight)]
    logits = torch.tanh(ref[0] @ ref[1].T / cap) * cap
    logp_all = torch.log_softmax(logits, dim=-1)
    ref_logp = logp_all.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    (ref_logp * g_logp + ref_ent * g_ent).sum().backward()
    assert_close(logp, ref_logp.detach())
    assert_close(ent, ref_ent.detach())
    for a, b in zip(ours, ref):
        assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
