"""Checkpoints: HF-loadable round trip, `latest` written last, pruning, stale temp dirs, and real SIGKILLs."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollwise.train.checkpoint as ckpt_mod
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.train.checkpoint import (
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    save_checkpoint,
)

TESTS_DIR = Path(__file__).parent


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, seed=0):
    return tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _assert_same_weights(a, b):
    assert_close(dict(a.state_dict()), dict(b.state_dict()), rtol=0, atol=0)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _steps(run_dir):
    return [int(p.name.split("-")[1]) for p in list_checkpoints(run_dir)]


def test_round_trip_loads_with_hf_and_restores_trainer_state(tmp_path, tok):
    model = _model(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "data_pos": 24, "note": ("a", 1)}

    path = save_checkpoint(tmp_path, 3, model, tok, state)

    assert path == tmp_path / "checkpoints" / "step-3"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-3"
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "COMPLETE"]:
        assert (path / name).is_file(), name
    loaded = AutoModelForCausalLM.from_pretrained(path)
    _assert_same_weights(model, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(path).pad_token_id == tok.pad_token_id
    restored = load_trainer_state(path)
    assert restored["step"] == 3 and restored["data_pos"] == 24 and restored["note"] == ("a", 1)
    assert torch.equal(restored["rng"], state["rng"])
    assert_close(restored["optimizer"], state["optimizer"], rtol=0, atol=0)


def test_latest_is_written_after_the_checkpoint_is_in_place(tmp_path, tok, monkeypatch):
    seen = []
    real_write = ckpt_mod.write_text_atomic

    def spy(path, text):
        root = path.parent
        seen.append((is_complete(root / text.strip()), sorted(p.name for p in root.iterdir() if p.name[0] == ".")))
        real_write(path, text)

    monkeypatch.setattr(ckpt_mod, "write_text_atomic", spy)
    save_checkpoint(tmp_path, 1, _model(tok), tok, {})
    save_checkpoint(tmp_path, 2, _model(tok), tok, {})
    assert seen == [(True, []), (True, [])]


def test_keep_prunes_oldest_but_never_latest(tmp_path, tok):
    model = _model(tok)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, tok, {}, keep=2)
    assert _steps(tmp_path) == [4, 5]
    # latest may name an older step (e.g. a rollback); it survives pruning
    save_checkpoint(tmp_path, 10, model, tok, {}, keep=1)
    save_checkpoint(tmp_path, 3, model, tok, {}, keep=1)
    assert latest_checkpoint(tmp_path).name == "step-3"
    assert _steps(tmp_path) == [3, 10]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_resave_same_step_replaces_it(tmp_path, tok):
    save_checkpoint(tmp_path, 4, _model(tok, seed=0), tok, {"v": 0})
    newer = _model(tok, seed=1)
    path = save_checkpoint(tmp_path, 4, newer, tok, {"v": 1})
    _assert_same_weights(newer, AutoModelForCausalLM.from_pretrained(path))
    assert load_trainer_state(path)["v"] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-4"]


def test_stale_temp_dirs_are_ignored_and_removed(tmp_path, tok):
    save_checkpoint(tmp_path, 1, _model(tok), tok, {})
    root = tmp_path / "checkpoints"
    dead = root / f".step-2.tmp-{_dead_pid()}"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    mine = root / f".step-3.tmp-{os.getpid()}"  # this process is not saving: left by a failed save
    mine.mkdir()
    live = root / f".step-4.tmp-{os.getppid()}"  # a live writer: left alone
    live.mkdir()
    (root / f".latest.tmp-{_dead_pid()}-abcd1234").write_text("step-2\n")

    assert latest_checkpoint(tmp_path) == root / "step-1"
    assert sorted(p.name for p in root.iterdir()) == [live.name, "latest", "step-1"]


def test_a_killed_unreaped_writer_counts_as_dead():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert ckpt_mod._pid_alive(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while ckpt_mod._pid_alive(proc.pid) and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert not ckpt_mod._pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_latest_pointing_at_missing_or_incomplete_dir_falls_back(tmp_path, tok):
    model = _model(tok)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, tok, {})
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step-9\n")
    assert latest_checkpoint(tmp_path) == root / "step-2"
    (root / "latest").write_text("../../etc\n")
    assert latest_checkpoint(tmp_path) == root / "step-2"
    (root / "latest").write_text("step-2\n")
    (root / "step-2" / "model.safetensors").write_bytes(b"truncated")  # size no longer matches COMPLETE
    assert latest_checkpoint(tmp_path) == root / "step-1"
    (root / "step-1" / "COMPLETE").unlink()
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "no-such-run") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_trainer_state(root / "step-1")


def test_interrupted_resave_restores_the_moved_aside_checkpoint(tmp_path, tok):
    model = _model(tok)
    save_checkpoint(tmp_path, 5, model, tok, {"v": "old"})
    root = tmp_path / "checkpoints"
    pid = _dead_pid()  # crash between "rename step-5 aside" and "rename the new one in"
    os.rename(root / "step-5", root / f".step-5.old-{pid}")
    (root / f".step-5.tmp-{pid}").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step-5"
    assert load_trainer_state(root / "step-5")["v"] == "old"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-5"]


def test_failed_save_leaves_no_temp_dir_and_keeps_latest(tmp_path, tok):
    model = _model(tok)
    save_checkpoint(tmp_path, 1, model, tok, {})

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, BrokenTokenizer(), {})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]
    assert latest_checkpoint(tmp_path) == root / "step-1"


def test_quantization_config_is_stripped_from_the_saved_config(tmp_path, tok):
    model = _model(tok)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    path = save_checkpoint(tmp_path, 1, model, tok, {})
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert model.config.quantization_config["quant_method"] == "gguf"  # the live model is unchanged


WRITER = """
import os, sys
import torch
torch.set_num_threads(1)
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint

run_dir = sys.argv[1]
tok = tiny_tokenizer()


def write_forever():
    ckpt = latest_checkpoint(run_dir)  # resume like a trainer would
    step = load_trainer_state(ckpt)["step"] + 1 if ckpt else 1
    while True:
        model = tiny_llama(len(tok), seed=step, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        state = {"step": step, "optimizer": {"exp_avg": torch.full((8,), float(step))}, "data_pos": 8 * step}
        save_checkpoint(run_dir, step, model, tok, state, keep=3)
        if step % 3 == 0:  # re-save the same step, exercising the replace path
            save_checkpoint(run_dir, step, model, tok, state, keep=3)
        step += 1


print("ready", flush=True)
for _ in sys.stdin:  # one writer per line, forked so the imports are paid once
    pid = os.fork()
    if pid == 0:
        try:
            write_forever()
        finally:
            os._exit(1)
    print("child", pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def _line_reader(proc) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()
    return lines


def _read_line(lines: queue.Queue, timeout: float = 60.0) -> str:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError("the checkpoint writer did not answer") from None


def _check_run_dir(run_dir: Path, tok) -> int:
    """Every published step-N is complete and loads with the weights and state of step N; returns latest step."""
    latest = latest_checkpoint(run_dir)
    root = run_dir / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "stale temp entries left"
    published = [p for p in root.iterdir() if p.name.startswith("step-")]
    assert all(is_complete(p) for p in published), "a step-N directory became visible before it was complete"
    for path in published:
        step = int(path.name.split("-")[1])
        _assert_same_weights(_model(tok, seed=step), AutoModelForCausalLM.from_pretrained(path))
        state = load_trainer_state(path)
        assert state["step"] == step and state["data_pos"] == 8 * step
        assert torch.equal(state["optimizer"]["exp_avg"], torch.full((8,), float(step)))
    if latest is None:
        assert not published
        return 0
    assert latest in published
    return int(latest.name.split("-")[1])


def test_sigkill_at_random_moments_leaves_a_loadable_latest(tmp_path, tok):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    lines = _line_reader(proc)
    rng = random.Random(7)
    latest_steps = []
    try:
        assert _read_line(lines) == "ready"
        for _ in range(4):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            child = int(_read_line(lines).split()[1])
            time.sleep(rng.uniform(0.3, 1.5))
            os.kill(child, signal.SIGKILL)
            assert _read_line(lines) == "reaped"
            latest_steps.append(_check_run_dir(run_dir, tok))
    finally:
        proc.kill()
        proc.wait()
    assert latest_steps[-1] > 0
    assert latest_steps == sorted(latest_steps), "each writer resumed from latest and moved on"
