"""Shared fixtures for the config, CLI, resume and end-to-end tests.

- `tiny_model_dir`: a tiny random Llama + tiny ChatML tokenizer saved as a local HF directory (session scope),
  usable as `model.name`.
- `tiny_config(model_dir, *overrides, **overrides)`: a small, fast `Config` built through `rollwise.validate.load` (parsed and validated, as the CLI does).
- `tests/` is put on `sys.path` so plugins can be named by dotted path (`toy_plugins:fn`), and on
  `PYTHONPATH` (`subprocess_env()`) for CLI subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
# The installed console script (the venv's, next to this interpreter, when not on PATH).
ROLLWISE = shutil.which("rollwise") or str(Path(sys.executable).with_name("rollwise"))
# tests never write into the user's cache (the measured matmul peak, model caches)
os.environ["ROLLWISE_CACHE"] = tempfile.mkdtemp(prefix="rollwise-test-cache-")
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="rollwise-test-hf-home-")  # hub tests lay out their own cache
if str(TESTS_DIR) not in sys.path:  # dotted-path plugins ('toy_plugins:fn') must be importable
    sys.path.insert(0, str(TESTS_DIR))
# A test suite started in the background by a shell without job control inherits SIGINT ignored, and so would
# every process a test starts: the Ctrl-C tests (rollwise serve, the generation process, Ray) would wait forever.
# Catching it here gives the children the default action again (a caught signal is reset on exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from helpers_model import tiny_llama  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from rollwise.validate import load
from rollwise.config import Config# noqa: E402

# Small and fast: 4 prompts x 4 samples x 8 new tokens per step, a 16-prompt eval only at start and end.
TINY_DEFAULTS: dict[str, object] = {
    "model.threads": 1,
    "data.eval_size": 64,
    "rollout.prompts_per_step": 4,
    "rollout.samples_per_prompt": 4,
    "rollout.max_new_tokens": 8,
    "rollout.temperature": 1.0,
    "train.steps": 2,
    "train.lr": 1e-3,
    "train.seed": 0,
    "eval.n": 16,
    "eval.every_steps": 0,
    "run.save_every_steps": 0,
    "run.samples_logged_per_step": 4,
    "run.console": False,
    "run.report": True,
}


def toml_literal(value: object) -> str:
    """`value` as the right-hand side of a `section.key=value` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as an override")


def tiny_overrides(model_dir: str | Path, **overrides: object) -> list[str]:
    """`section.key=value` strings for the tiny config; keyword overrides use `__` for the dot
    (`train__steps=4`) or pass a dict with dotted keys via `tiny_config(..., **{"train.steps": 4})`."""
    values: dict[str, object] = {"model.name": str(model_dir), **TINY_DEFAULTS}
    for key, value in overrides.items():
        values[key.replace("__", ".")] = value
    return [f"{key}={toml_literal(value)}" for key, value in values.items() if value is not None]


def tiny_config(model_dir: str | Path, **overrides: object) -> Config:
    """A small Config for tests on the tiny model (see TINY_DEFAULTS), through `rollwise.validate.load`."""
    return load(None, tiny_overrides(model_dir, **overrides))


def subprocess_env() -> dict[str, str]:
    """Environment for a `rollwise` subprocess: tests/ importable, one thread, no colour."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return env


def read_rows(run_dir: str | Path) -> list[dict]:
    """Every row of RUN_DIR/metrics.jsonl (all must parse)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama and the tiny tokenizer saved together as a local HF model directory."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def make_config(tiny_model_dir):
    """`make_config(**{"train.steps": 4})` -> a tiny Config on the session's tiny model."""

    def make(**overrides: object) -> Config:
        return tiny_config(tiny_model_dir, **overrides)

    return make
