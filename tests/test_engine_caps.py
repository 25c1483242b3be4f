"""The engine contract as data: every engine class declares `caps` (an `EngineCaps`), an optional method exists
exactly when its capability is declared, and the callers' choices follow the declared capabilities.

Engine classes are found by reading the source (`ast`), not by a list: a class that defines both `generate` and
`abort`, or inherits from one, anywhere under rollwise/ (and test doubles under tests/).
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate.base import CAP_METHODS, EngineCaps
from rollwise.generate.torch_engine import TorchEngine
from rollwise.types import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("generate", "abort", "update_weights", "close")
# views handed to `run_episodes` (generate, abort, version): they need no weight sync or close of their own
VIEWS = {"rollwise.serve.jobs._CancellableEngine"}
EXPECTED = {"TorchEngine", "VLLMEngine", "OpenAIEngine", "VLLMServerEngine", "SGLangEngine", "RemoteEngine"}


def _classes(folder: Path, package: str) -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class under `folder`: "module.Class" -> (module, its ast), `package` naming the folder."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        module = ".".join([package, *path.relative_to(folder).with_suffix("").parts]).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found[f"{module}.{node.name}"] = (module, node)
    return found


def _methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _bases(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}


def _engine_classes(folder: Path, package: str) -> dict[str, tuple[str, ast.ClassDef]]:
    """The classes that define `generate` and `abort`, and their subclasses (by base name), Protocols aside."""
    every = _classes(folder, package)
    engines = {k: v for k, v in every.items() if {"generate", "abort"} <= _methods(v[1])
               and "Protocol" not in _bases(v[1])}
    grew = True
    while grew:
        names = {node.name for _, node in engines.values()}
        more = {k: v for k, v in every.items() if k not in engines and _bases(v[1]) & names}
        engines.update(more)
        grew = bool(more)
    return engines


ENGINES = _engine_classes(ROOT / "rollwise", "rollwise")


def _load(key: str):
    module, node = ENGINES[key]
    return getattr(importlib.import_module(module), node.name)


def test_the_scan_finds_every_engine():
    assert EXPECTED <= {node.name for _, node in ENGINES.values()}, sorted(ENGINES)


@pytest.mark.parametrize("key", sorted(ENGINES))
def test_every_engine_class_declares_caps_and_the_methods_they_promise(key):
    cls = _load(key)
    assert isinstance(cls.__dict__.get("caps", None) or getattr(cls, "caps", None), EngineCaps), \
        f"{key} has no class attribute caps = EngineCaps(...)"
    required = ("generate", "abort") if key in VIEWS else REQUIRED
    assert all(callable(getattr(cls, m, None)) for m in required), f"{key} lacks one of {required}"
    for cap, methods in CAP_METHODS.items():
        for method in methods:
            has = callable(getattr(cls, method, None))
            if getattr(cls.caps, cap):
                assert has, f"{key} declares caps.{cap} but has no {method}()"
            else:
                assert not has, f"{key} has {method}() but does not declare caps.{cap}"


@pytest.mark.parametrize("key", sorted(ENGINES))
def test_an_engine_takes_a_request_feed_exactly_when_it_declares_one(key):
    """caps.request_feed is a keyword of `generate`, not a method: the signature says it."""
    import inspect

    cls = _load(key)
    takes = "feed" in inspect.signature(cls.generate).parameters
    assert takes == cls.caps.request_feed, f"{key}: caps.request_feed = {cls.caps.request_feed}, generate(feed=) {takes}"


def test_episodes_take_turns_in_rounds_on_an_engine_without_a_feed():
    """An engine without caps.request_feed is never handed a feed: each turn is one generate call."""
    from itertools import count

    from rollwise.envs.base import StepResult
    from rollwise.envs.episode import EpisodeCodec, run_episodes
    from rollwise.generate.groups import new_groups
    from rollwise.types import Prompt

    class OneCallAtATime:
        """The torch engine behind the bare contract (no feed), counting its calls."""

        caps = EngineCaps(continue_aborted=True)

        def __init__(self, engine):
            self.engine, self.calls = engine, 0

        def generate(self, requests, on_finish=None):
            self.calls += 1
            return self.engine.generate(requests, on_finish=on_finish)

        def abort(self, request_ids):
            self.engine.abort(request_ids)

    class TwoTurns:
        name, max_turns, stop = "two", 2, tuple("etaoinshrdlu 0123456789")  # a turn ends at almost any token

        def reset(self, prompt):
            return {}

        def step(self, state, text):
            return StepResult(messages=[{"role": "tool", "content": "again"}])

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = OneCallAtATime(TorchEngine(model, tok))
    prompt = Prompt("p", [{"role": "user", "content": "hi"}])
    groups = new_groups([(prompt, tok("hi", add_special_tokens=False).input_ids)], 3, 0)
    run_episodes(engine, groups, SamplingParams(max_new_tokens=16), count(), TwoTurns(), EpisodeCodec(tok))
    turns = [s.episode.assistant_turns for s in groups[0].samples]
    assert engine.calls == max(turns) == 2


def test_a_class_redefining_caps_declares_its_own_abilities():
    """A subclass that adds optional methods (vLLM server: reload_from) must not inherit its parent's caps."""
    from rollwise.generate.http_engine import OpenAIEngine, _ServerEngine
    from rollwise.generate.sglang_engine import SGLangEngine
    from rollwise.generate.vllm_server import VLLMServerEngine

    assert not _ServerEngine.caps.probe_logprobs and OpenAIEngine.caps.probe_logprobs
    assert VLLMServerEngine.caps.reload_from and SGLangEngine.caps.reload_from and not OpenAIEngine.caps.reload_from


def test_remote_engine_caps_follow_the_worker_engine():
    from rollwise.cluster.engines import RemoteEngine, remote_caps

    torch_caps, vllm_caps = remote_caps("torch"), remote_caps("vllm")
    assert torch_caps.tensors and not torch_caps.adapters
    assert vllm_caps.adapters and not vllm_caps.tensors
    for caps in (torch_caps, vllm_caps):  # an instance narrows its class's abilities, never widens them
        assert all(getattr(RemoteEngine.caps, f.name) or not getattr(caps, f.name) for f in fields(EngineCaps))
        assert caps.probe_logprobs and caps.reload_from and caps.rng_state


def test_torch_engine_caps_hold_on_an_instance():
    tok = tiny_tokenizer()
    engine = TorchEngine(tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), tok)
    assert engine.caps.local_model and isinstance(engine.model, torch.nn.Module)
    requests = [GenerationRequest(i, [5, 6, 7], SamplingParams(max_new_tokens=6)) for i in range(3)]
    state = engine.rng_state()
    first = [r.response_ids for r in engine.generate(requests)]
    engine.set_rng_state(state)
    assert [r.response_ids for r in engine.generate(requests)] == first  # the one call restores the stream
    assert len(engine.probe_logprobs([5, 6, 7, 8])) == 3


def _fake(**caps):
    return SimpleNamespace(caps=EngineCaps(**caps), device=torch.device("cpu"), sync_dir=None, model_dir=None)


def test_the_transport_follows_the_caps():
    from rollwise.sync.transports import _auto_name, build_transport

    assert _auto_name(_fake(tensors=True, reload_from=True)) == "tensors"  # Ray torch workers
    assert _auto_name(_fake(reload_from=True)) == "safetensors"  # vLLM on CPU
    assert _auto_name(_fake()) == "tensors"  # no folder reload: update_weights is the only way in
    with pytest.raises(ValueError, match="'tensors' copies into an in-process torch engine"):
        build_transport("tensors", _fake(reload_from=True))
    with pytest.raises(ValueError, match="needs an engine with reload_from"):
        build_transport("safetensors", _fake(tensors=True))


def test_test_doubles_declare_caps():
    """Engines written for tests (a class with `generate` and `abort`) declare caps too."""
    doubles = {k: v for k, v in _classes(ROOT / "tests", "tests").items() if {"generate", "abort"} <= _methods(v[1])}
    assert doubles, "no test double found: the scan is broken"
    for key, (_, node) in doubles.items():
        assigned = {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        assert "caps" in assigned, f"{key} stands in for an engine but declares no caps"
