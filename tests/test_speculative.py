"""Speculative decoding on the torch engine (rollwise.generate.speculative): rejection sampling keeps the target's
exact distribution (hand-computed cases and chi-square bounds), greedy output equals plain greedy decoding, the
reported log-probs are the target's, and a tiny training run reports `rollout/spec_accept_rate`."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch

from conftest import read_rows, tiny_overrides
from helpers_model import tiny_llama
from rollwise.config import ConfigError
from rollwise.generate import TorchEngine
from rollwise.generate.speculative import SpecStats, sampling_probs, verify
from rollwise.loop import train
from rollwise.models.resolve import load_model_dir
from rollwise.types import GenerationRequest, SamplingParams, Status
from rollwise.validate import load

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "seed" / "speculative.toml"
# chi-square 0.999 quantiles by degrees of freedom: a correct sampler fails one in a thousand runs at most
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 5: 20.52, 8: 26.12}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_verify_hand_cases():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    # q puts all its mass on token 2, which the target never emits: always rejected, residual = p (p - q < 0 at 2)
    q = torch.tensor([[0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(400):
        v = verify([2], q, p, gen)
        assert v.accepted == 0 and len(v.tokens) == 1
        counts[v.tokens[0]] += 1
    assert counts[2] == 0 and abs(float(counts[0]) - 200) < 60
    # q == p: always accepted, then the bonus token comes from p's second row
    v = verify([1], p[:1].clone(), p, gen)
    assert v.accepted == 1 and v.tokens[0] == 1 and v.tokens[1] in (0, 1, 2)


def test_accept_rate_is_overlap_mass():
    """P(accept) = sum_x min(p(x), q(x)) (Leviathan et al., Definition 3.1): 0.6 here."""
    p = torch.tensor([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.3, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(1)
    n, accepted = 6000, 0
    counts = torch.zeros(3)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        v = verify([x], q, p, gen)
        accepted += v.accepted
        counts[v.tokens[0]] += 1
    assert abs(accepted / n - 0.6) < 4 * math.sqrt(0.24 / n)
    assert _chi2(counts, p[0]) < CHI2_999[2]  # the emitted token is distributed as p, not q


def test_sampling_probs_apply_temperature_and_truncation_to_both():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = sampling_probs(logits, 0.5, top_k=2, top_p=1.0)[0]
    e = torch.exp(torch.tensor([4.0, 2.0]))
    torch.testing.assert_close(probs, torch.tensor([e[0] / e.sum(), e[1] / e.sum(), 0.0, 0.0]))
    assert sampling_probs(logits, 0.0, 0, 1.0)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_spec_stats_pop():
    stats = SpecStats(proposed=8, accepted=6)
    assert stats.pop() == {"rollout/spec_accept_rate": 0.75, "rollout/spec_proposed": 8.0}
    assert stats.pop() == {}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_model_dir):
    """A second tiny model with the same tokenizer and different weights (a draft that disagrees)."""
    _, tok = load_model_dir(tiny_model_dir)
    model = tiny_llama(len(tok), seed=7, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _engines(tiny_model_dir, draft_dir, k=3, seed=0):
    model, tok = load_model_dir(tiny_model_dir)
    plain = TorchEngine(model, tok, seed=seed)
    spec = TorchEngine(model, tok, seed=seed, draft_model=str(draft_dir), draft_tokens=k)
    return tok, plain, spec


def test_greedy_equals_plain_greedy_and_logprobs_are_the_targets(tiny_model_dir, draft_dir):
    tok, plain, spec = _engines(tiny_model_dir, draft_dir)
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("What is 7 + 3?", "abc")]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    reqs = [GenerationRequest(i, p, params) for i, p in enumerate(prompts)]
    a, b = plain.generate(reqs), spec.generate(reqs)
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.status == y.status
        torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4, rtol=0)
    # sampled: the behaviour log-probs are the target's own (probe at temperature 1, no truncation)
    res = spec.generate([GenerationRequest(5, prompts[0], SamplingParams(max_new_tokens=8, temperature=1.0))])[0]
    probe = spec.probe_logprobs(prompts[0] + res.response_ids)[len(prompts[0]) - 1:]
    torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(probe), atol=1e-4, rtol=0)
    rate = spec.pop_metrics()["rollout/spec_accept_rate"]
    assert 0.0 <= rate < 1.0  # a different random draft: some proposals are rejected
    assert spec.pop_metrics() == {}


@pytest.mark.slow
def test_engine_output_distribution_is_the_targets(tiny_model_dir, draft_dir):
    """Joint law of the first two tokens under top-k = 2, temperature 0.8: chi-square against the target's exact
    probabilities (4 outcomes), with a draft that disagrees (so the residual draws are exercised)."""
    tok, plain, spec = _engines(tiny_model_dir, draft_dir, k=1, seed=3)
    prompt = tok("What is 7 + 3?", add_special_tokens=False).input_ids
    params = SamplingParams(max_new_tokens=2, temperature=0.8, top_k=2)
    n = 100  # each request is two or three forwards of each model; the verify-level test above draws 6000
    results = spec.generate([GenerationRequest(i, prompt, params) for i in range(n)])
    model = plain.model
    with torch.no_grad():
        p1 = sampling_probs(model(torch.tensor([prompt])).logits[0, -1:], 0.8, 2, 1.0)[0]
        firsts = p1.nonzero().flatten().tolist()
        joint = {}
        for t in firsts:
            p2 = sampling_probs(model(torch.tensor([prompt + [t]])).logits[0, -1:], 0.8, 2, 1.0)[0]
            for u in p2.nonzero().flatten().tolist():
                joint[(t, u)] = float(p1[t] * p2[u])
    index = {pair: i for i, pair in enumerate(joint)}
    counts = torch.zeros(len(index))
    for r in results:
        pair = tuple(r.response_ids[:2])
        if len(pair) < 2:  # the first token ended the response (EOS): counted under its own outcome
            pytest.fail(f"EOS among the top-2 first tokens changes the outcome space: {pair}")
        assert pair in index, f"{pair} has probability 0 under the target"
        counts[index[pair]] += 1
    probs = torch.tensor([joint[p] for p in index])
    assert _chi2(counts, probs) < CHI2_999[3]
    rate = spec.pop_metrics()["rollout/spec_accept_rate"]
    assert 0.0 < rate < 1.0


def test_bad_settings_fail_at_dry_run(tiny_model_dir):
    def error(options, **extra):
        with pytest.raises(ConfigError) as info:
            load(RECIPE, tiny_overrides(tiny_model_dir, **{"rollout.engine_options": options, **extra}))
        return str(info.value)

    assert "draft_tokens = 0: use an integer >= 1" in error({"draft_model": str(tiny_model_dir), "draft_tokens": 0})
    assert "is not a model directory" in error({"draft_model": "/no/such/dir"})
    assert "needs draft_model" in error({"draft_tokens": 2})
    async_mode = {"control.mode": "async", "algo.is_correction": "tis_token"}
    assert "not applied by the async engine process" in error({"draft_model": str(tiny_model_dir)}, **async_mode)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["same", "other"])
def test_recipe_two_steps_reports_accept_rate(draft, tmp_path, tiny_model_dir, draft_dir):
    """The recipe on the tiny model: with the policy itself as draft nearly every proposal is accepted at step 0;
    with a different model fewer are. The rollouts train either way (exactness makes them on-policy)."""
    draft_path = tiny_model_dir if draft == "same" else draft_dir
    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 0, "run.report": False, "run.name": None,
                 "rollout.engine_options": {"draft_model": str(draft_path), "draft_tokens": 3}}
    cfg = load(RECIPE, tiny_overrides(tiny_model_dir, **overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "run")
    rows = [r for r in read_rows(tmp_path / "run") if r["kind"] == "train"]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    rate = rows[0]["rollout/spec_accept_rate"]
    assert rows[0]["rollout/spec_proposed"] > 0
    if draft == "same":
        assert rate > 0.97  # p == q up to rounding between the one-token and (k+1)-token forwards
    else:
        assert rate < 0.9


# -- vLLM engine options (speculative_config, quantization): checked at --dry-run, passed through unchanged ----

VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_vllm_options_fail_at_dry_run_with_one_line(tiny_model_dir, monkeypatch):
    """Against the fallback lists (importing vLLM takes seconds; the installed vLLM's lists are checked below)."""
    from rollwise.generate import vllm_options as vo

    monkeypatch.setattr(vo, "speculative_keys", lambda: (vo.FALLBACK_SPECULATIVE_KEYS, "vLLM 0.32"))
    monkeypatch.setattr(vo, "quantization_methods", lambda: (vo.FALLBACK_QUANTIZATION, "vLLM 0.32"))

    def error(options, engine="vllm"):
        with pytest.raises(ConfigError) as info:
            load(None, tiny_overrides(tiny_model_dir, **{"rollout.engine": engine, "rollout.engine_options": options,
                                                         "sync.transport": "auto"}))
        return str(info.value)

    assert "unknown keys num_spec_tokens" in error({"speculative_config": {"method": "ngram", "num_spec_tokens": 3}})
    assert "num_speculative_tokens = 0: use an integer >= 1" in error(
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}})
    assert "quantization = 'fp3' is not a quantization method" in error({"quantization": "fp3"})
    assert "is vLLM's; rollout.engine = 'torch'" in error({"quantization": "fp8"}, engine="torch")
    cfg = load(None, tiny_overrides(tiny_model_dir, **{"rollout.engine": "vllm", "sync.transport": "auto",
                                                       "rollout.engine_options": {"speculative_config": VLLM_SPEC,
                                                                                  "quantization": "fp8"}}))
    assert cfg.rollout.engine_options["speculative_config"] == VLLM_SPEC


def test_vllm_server_gets_speculative_config_as_json():
    import json

    from rollwise.generate.vllm_server import server_command

    cmd = server_command("/m", 8000, "bfloat16", {"speculative_config": VLLM_SPEC, "quantization": "fp8"})
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == VLLM_SPEC
    assert cmd[cmd.index("--quantization") + 1] == "fp8"


@pytest.mark.slow
def test_vllm_kwargs_build_the_real_speculative_config(tiny_model_dir):
    """The in-process engine's `vllm.LLM` kwargs carry both options unchanged, and vLLM's own EngineArgs turn
    them into its `SpeculativeConfig` (CPU build of vLLM; no engine is started: vLLM does not run on this GPU-less
    machine's tests)."""
    pytest.importorskip("vllm")
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from rollwise.generate.vllm_options import llm_kwargs, vllm_option_errors

    assert vllm_option_errors("vllm", {"speculative_config": dict(VLLM_SPEC), "quantization": "fp8"}) == []
    [line] = vllm_option_errors("vllm", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                                "lookahead": 4}})
    assert "unknown keys lookahead (valid in the installed vLLM: " in line and "prompt_lookup_max" in line
    kwargs, _ = llm_kwargs(tiny_model_dir, torch.float32, 8, 0, 256, {"speculative_config": dict(VLLM_SPEC)},
                           cuda=False, in_process=False)
    assert kwargs["speculative_config"] == VLLM_SPEC
    names = {"model", "tokenizer", "dtype", "seed", "max_num_seqs", "max_model_len", "speculative_config"}
    config = EngineArgs(**{k: v for k, v in kwargs.items() if k in names}).create_engine_config()
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.num_speculative_tokens == 3
    assert config.speculative_config.method == "ngram"


def test_an_engine_option_vllm_does_not_take_fails_the_dry_run_with_one_line(tiny_model_dir):
    """Through `rollwise train --dry-run`: a torch-engine option and a misspelt key on an in-process vLLM are
    refused before anything starts (vLLM itself would refuse them only after loading the model); keys of the
    installed vLLM's `LLM` / `EngineArgs` and rollwise's own pass."""
    pytest.importorskip("vllm")
    from typer.testing import CliRunner

    from rollwise.cli import app

    def dry_run(options: str):
        args = ["train", "--dry-run", f"model.name={tiny_model_dir}", "rollout.engine=vllm",
                f"rollout.engine_options={options}"]
        return CliRunner().invoke(app, args)

    result = dry_run("{gqa_attention = true}")
    assert result.exit_code != 0
    assert "rollout.engine_options.gqa_attention is the torch engine's" in result.output
    result = dry_run("{enforce_eagre = true}")
    assert result.exit_code != 0 and "rollout.engine_options.enforce_eagre is not an option of the installed vLLM" \
        in result.output
    ok = dry_run("{enforce_eager = true, in_process = true, kv_cache_memory_bytes = 67108864}")
    assert ok.exit_code == 0, ok.output
