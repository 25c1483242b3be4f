"""LoRA through PEFT: only adapters train, the reference is the base with adapters disabled, merged weights
equal the adapted model, adapters and checkpoints round-trip."""

import random

import pytest
import torch
from torch.testing import assert_close

peft = pytest.importorskip("peft")

from helpers_model import tiny_llama  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from rollwise.config import AlgoConfig, LoraConfig, TrainConfig  # noqa: E402
from rollwise.generate import TorchEngine  # noqa: E402
from rollwise.train import lora  # noqa: E402
from rollwise.train.batching import collate  # noqa: E402
from rollwise.train.logprobs import token_logprobs  # noqa: E402
from rollwise.train.lora_trainer import LoraTrainer  # noqa: E402
from rollwise.train.trainer import Trainer  # noqa: E402
from rollwise.types import GenerationRequest, Prompt, Sample, SamplingParams, Status  # noqa: E402

VOCAB = 97
RANK = 4


def _pair(seed: int = 3, **overrides):
    """(LoRA-wrapped tiny Llama, an untouched plain copy of its base)."""
    return (lora.apply_lora(tiny_llama(VOCAB, seed=seed, **overrides), LoraConfig(rank=RANK), seed=0),
            tiny_llama(VOCAB, seed=seed, **overrides))


def _randomise_adapters(model, seed: int = 0, std: float = 0.2) -> None:
    """Give B non-zero values (PEFT starts it at zero, where the adapted model equals the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _samples(model, advantages=(1.0, -1.0)) -> list[Sample]:
    """Two groups of 3 random responses; group g has advantage `advantages[g]`; behaviour = trainer log-probs."""
    rng = random.Random(0)
    out = []
    for g, adv in enumerate(advantages):
        prompt = [rng.randrange(3, VOCAB) for _ in range(5)]
        for _ in range(3):
            resp = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [0.0] * len(resp), [1] * len(resp),
                              Status.COMPLETED, g, advantage=adv))
    mb = collate(out, pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    for row, sample in enumerate(mb.samples):
        sample.behaviour_logprobs = logp[row, : len(sample.response_ids)].tolist()
        sample.full_logprobs = list(sample.behaviour_logprobs)
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 42, 8, 91, 3, 60, 22], [33, 4, 4, 70, 12, 96, 1, 50]])


def _base_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_apply_lora_trains_only_adapters_and_counts_them():
    model, base = _pair()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # r * (in + out) per adapted linear; per layer q 64+64, k 64+32, v 64+32, o 64+64, gate/up/down 64+128 each
    assert lora.lora_info(model).trainable == RANK * 2 * 1024 == 8192
    base_total = sum(p.numel() for p in base.parameters())  # tied head counted once
    assert base_total == 97 * 64 + 2 * (2 * 4096 + 2 * 2048 + 3 * 8192 + 2 * 64) + 64
    assert lora.lora_info(model).total == base_total + 8192
    assert lora.lora_info(model).metrics()["train/trainable_params"] == 8192.0
    assert_close(_logits(model, IDS), _logits(base, IDS), rtol=0, atol=0)  # B = 0: the base, exactly


def test_adapter_init_is_deterministic_from_the_seed_and_leaves_the_global_rng():
    def a_matrices(seed):
        m = lora.apply_lora(tiny_llama(VOCAB, seed=3), LoraConfig(rank=RANK), seed=seed)
        return [p.detach().clone() for n, p in m.named_parameters() if "lora_A" in n]

    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    first, again, other = a_matrices(7), a_matrices(7), a_matrices(8)
    assert torch.equal(torch.rand(1), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_a_target_that_matches_nothing_names_the_linear_modules():
    model = tiny_llama(VOCAB)
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] match no module of LlamaForCausalLM") as err:
        lora.apply_lora(model, LoraConfig(rank=RANK, target_modules=["q_proj", "qkv_proj"]))
    assert "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in str(err.value)
    assert "\n" not in str(err.value)
    assert not any("lora_" in n for n, _ in model.named_parameters())  # refused before PEFT touched it


def test_all_linear_targets_every_linear_but_the_head():
    cfg = LoraConfig(rank=2, target_modules=["all-linear"])
    model = lora.apply_lora(tiny_llama(VOCAB, tie_word_embeddings=False), cfg)
    adapted = {n.split(".base_layer")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "base_layer" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_a_trainer_step_moves_only_the_adapters(kl_coef):
    model, _ = _pair()
    _randomise_adapters(model)  # so that A gets a gradient too
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = LoraTrainer(model, TrainConfig(lr=1e-2), AlgoConfig(kl_coef=kl_coef), pad_id=0, tokenizer=None)
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == \
        [id(p) for p in model.parameters() if p.requires_grad]
    metrics = trainer.step(_samples(model))
    assert metrics["train/passes/reference"] == float(kl_coef > 0)  # LoRA: the base serves as reference
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert not torch.equal(p, before[name]), f"{name} did not move"
        else:
            assert torch.equal(p, before[name]), f"base weight {name} changed"


def test_reference_logprobs_are_the_base_models():
    model, base = _pair()
    _randomise_adapters(model)
    samples = _samples(model)
    mbs = [collate(samples, pad_id=0)]
    lora_trainer = LoraTrainer(model, TrainConfig(), AlgoConfig(kl_coef=0.1, kl_in_reward=True), pad_id=0,
                               tokenizer=None)
    copy_trainer = Trainer(model, TrainConfig(), AlgoConfig(kl_coef=0.1, kl_in_reward=True), pad_id=0, ref_model=base)
    (ref,) = lora_trainer._reference_logprobs(mbs)
    with torch.no_grad():
        base_logp, _ = token_logprobs(base, mbs[0])
        policy_logp, _ = token_logprobs(model, mbs[0])  # adapters are back on after the reference pass
    assert_close(ref, base_logp, rtol=0, atol=1e-6)
    assert float((policy_logp - base_logp).abs().max()) > 1e-2
    penalties = lora_trainer.kl_penalties(samples)
    assert_close(penalties, copy_trainer.kl_penalties(samples), rtol=1e-5, atol=1e-6)
    assert max(abs(p) for p in penalties) > 1e-3


@pytest.mark.parametrize("tied", [True, False])
def test_merged_state_dict_gives_the_adapted_model_in_a_plain_copy(tied):
    model, base = _pair(tie_word_embeddings=tied)
    _randomise_adapters(model)
    untouched = _base_params(model)
    merged = lora.merged_state_dict(model)
    assert set(merged) == {n for n, _ in base.named_parameters()}
    plain = tiny_llama(VOCAB, seed=99, tie_word_embeddings=tied)
    plain.load_state_dict(merged, strict=False)
    assert_close(_logits(plain, IDS), _logits(model, IDS), rtol=0, atol=1e-5)
    assert float((_logits(plain, IDS) - _logits(base, IDS)).abs().max()) > 1e-2  # the adapters do matter
    assert all(torch.equal(p, untouched[n]) for n, p in _base_params(model).items())  # no in-place merge
    with model.disable_adapter():
        assert all(torch.equal(lora.merged_state_dict(model)[n], p) for n, p in base.state_dict().items()
                   if n in merged)


def test_torch_engine_after_a_merged_sync_gives_the_trainers_logprobs():
    tok = tiny_tokenizer()
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = TorchEngine(tiny_llama(len(tok), seed=2, **kwargs), tok)  # built from the base, before LoRA
    model = lora.apply_lora(tiny_llama(len(tok), seed=2, **kwargs), LoraConfig(rank=RANK))
    _randomise_adapters(model, std=0.3)
    engine.update_weights(lora.merged_state_dict(model), version=1)
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ["What is 7 + 3?", "Compute 12 - 5."]]
    reqs = [GenerationRequest(i, p, SamplingParams(max_new_tokens=10, temperature=1.0)) for i, p in enumerate(prompts)]
    res = engine.generate(reqs)
    samples = [Sample(Prompt(str(i), []), q.prompt_ids, r.response_ids, r.logprobs, [1] * len(r.response_ids),
                      r.status, i) for i, (q, r) in enumerate(zip(reqs, res))]
    mb = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = token_logprobs(model, mb)
        with model.disable_adapter():
            base_logp, _ = token_logprobs(model, mb)
    engine_logp = torch.zeros_like(trainer_logp)
    for row, s in enumerate(mb.samples):
        engine_logp[row, : len(s.response_ids)] = torch.tensor(s.behaviour_logprobs)
    assert_close(engine_logp, trainer_logp, rtol=0, atol=1e-4)
    assert float((base_logp - trainer_logp).abs().max()) > 1e-2  # a stale engine would fail the check above
    assert all(r.version_spans == [(0, len(r.response_ids), 1)] for r in res)


def test_saved_adapter_reloads_with_peft_to_the_same_logits(tmp_path):
    model, _ = _pair()
    _randomise_adapters(model)
    out = lora.save_adapter(model, tmp_path / "adapter-v3")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-v3"]  # no temp dir left behind
    lora.save_adapter(model, out)  # replacing an existing folder works too
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(VOCAB, seed=3), str(out))
    assert_close(_logits(reloaded, IDS), _logits(model, IDS), rtol=0, atol=1e-6)


def test_save_merged_writes_a_plain_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = _pair(tie_word_embeddings=False)
    _randomise_adapters(model)
    lora.save_merged(model, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    assert_close(_logits(plain, IDS), _logits(model, IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("save_merged", [False, True])
def test_lora_checkpoint_round_trip(tmp_path, save_merged):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    model = lora.apply_lora(tiny_llama(len(tok), seed=5), LoraConfig(rank=RANK))
    _randomise_adapters(model)
    files = lora.write_lora_checkpoint(tmp_path, model, tok, save_merged=save_merged)
    assert "adapter/adapter_model.safetensors" in files and "tokenizer.json" in files
    assert ("merged/model.safetensors" in files) == save_merged
    assert not (tmp_path / "config.json").exists()  # the root is never mistaken for a full model
    assert files == sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert lora.is_lora_checkpoint(tmp_path)

    resumed = lora.load_lora_checkpoint(tmp_path, tiny_llama(len(tok), seed=5), LoraConfig(rank=RANK))
    assert [n for n, p in resumed.named_parameters() if p.requires_grad] == \
        [n for n, p in model.named_parameters() if p.requires_grad]  # same order: the optimizer state fits
    assert_close(_logits(resumed, IDS), _logits(model, IDS), rtol=0, atol=1e-6)
    if save_merged:
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert_close(_logits(plain, IDS), _logits(model, IDS), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"'rank': \(4, 8\)"):
        lora.load_lora_checkpoint(tmp_path, tiny_llama(len(tok), seed=5), LoraConfig(rank=8))


def test_loading_a_full_checkpoint_as_lora_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="not written with lora.rank > 0"):
        lora.load_lora_checkpoint(tmp_path, tiny_llama(VOCAB))


def test_three_lora_steps_move_logprobs_with_the_advantage():
    model, _ = _pair()
    samples = _samples(model)  # group 0 advantage +1, group 1 advantage -1
    mb = collate(samples, pad_id=0)
    with torch.no_grad():
        start, _ = token_logprobs(model, mb)
    base = _base_params(model)
    trainer = LoraTrainer(model, TrainConfig(lr=2e-2), AlgoConfig(kl_coef=0.05), pad_id=0, tokenizer=None)
    metrics = [trainer.step(samples) for _ in range(3)]
    with torch.no_grad():
        end, _ = token_logprobs(model, mb)
    gain = ((end - start) * mb.loss_mask).sum(1) / mb.loss_mask.sum(1)  # [S] mean log-prob change per response
    positive = torch.tensor([s.advantage > 0 for s in mb.samples])
    assert float(gain[positive].min()) > 0.01 and float(gain[~positive].max()) < -0.01
    assert all(torch.equal(p, base[n]) for n, p in _base_params(model).items())
    assert all(m["train/nonfinite_steps"] == 0.0 and m["train/passes/reference"] == 1.0 for m in metrics)
