"""pass@k (Chen et al. 2021) and avg@K: the estimator on hand-computed cases, and `rollwise eval --k` on the tiny
model with a reward whose correct count per prompt the test knows (tests/toy_eval_plugins.py)."""

from __future__ import annotations

import json
from math import comb

import pytest
from typer.testing import CliRunner

import toy_eval_plugins
from conftest import read_rows, tiny_config, tiny_overrides
from rollwise.cli import app
from rollwise.evaluate import correctness_metrics, known_metric, pass_at_k, pass_ks
from rollwise.types import Prompt, Sample, Status


def test_pass_at_k_by_hand_n5_c2():
    """n=5 samples, c=2 correct. pass@k = 1 - C(3,k)/C(5,k): k=1: 1 - 3/5 = 0.4; k=2: 1 - 3/10 = 0.7;
    k=3: 1 - 1/10 = 0.9; k=4, 5: every draw of 4 (or 5) of the 5 holds a correct one, 1.0."""
    assert [pass_at_k(5, 2, k) for k in range(1, 6)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0], abs=1e-12)


def test_pass_at_k_with_none_or_all_correct():
    assert [pass_at_k(5, 0, k) for k in range(1, 6)] == [0.0] * 5
    assert [pass_at_k(5, 5, k) for k in range(1, 6)] == [1.0] * 5
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_fewer_samples_than_k_is_an_error():
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples of the prompt, got n=3"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)  # more correct than samples


def test_the_product_form_matches_the_binomials_and_stays_finite_for_large_n():
    """The product form equals 1 - C(n-c,k)/C(n,k) (exact integers) on a grid, and for n = 1000, where the
    binomials have hundreds of digits, it is still a probability."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12), (n, c, k)
    value = pass_at_k(1000, 3, 500)
    assert value == pytest.approx(1 - comb(997, 500) / comb(1000, 500), rel=1e-9) and 0.0 < value < 1.0


def test_reported_ks_are_powers_of_two_then_k():
    assert pass_ks(1) == [1] and pass_ks(2) == [1, 2] and pass_ks(3) == [1, 2, 3]
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(10) == [1, 2, 4, 8, 10]


def _samples(uid: str, verdicts: list[bool | None]) -> list[Sample]:
    prompt = Prompt(uid, [{"role": "user", "content": "q"}], answer="1")
    out = []
    for v in verdicts:
        s = Sample(prompt, [1], [2], [0.0], [1], Status.FAILED if v is None else Status.COMPLETED, 0)
        s.correct = v
        out.append(s)
    return out


def test_failed_rewards_are_left_out_of_n_not_counted_wrong():
    """Prompt a: 4 scored, 1 correct. Prompt b: 2 scored (both correct) and 2 failed. pass@1 = (1/4 + 2/2)/2;
    pass@2 = ((1 - C(3,2)/C(4,2)) + 1)/2 = (0.5 + 1)/2; pass@4 only from a: 1 - C(3,4)/C(4,4) = 1;
    avg@4 = (1/4 + 1)/2."""
    groups = [_samples("a", [True, False, False, False]), _samples("b", [True, None, True, None])]
    got = correctness_metrics(groups, 4)
    assert got == pytest.approx({"eval/pass@1": 0.625, "eval/pass@2": 0.75, "eval/pass@4": 1.0,
                                 "eval/avg@4": 0.625})
    assert correctness_metrics([_samples("c", [None, None])], 2) == {"eval/pass@1": None, "eval/pass@2": None,
                                                                     "eval/avg@2": None}


def test_known_metric_names():
    assert known_metric("eval/greedy_accuracy", 1, True) and not known_metric("eval/greedy_accuracy", 1, False)
    assert known_metric("eval/pass@4", 8, True) and known_metric("eval/avg@8", 8, True)
    assert not known_metric("eval/pass@16", 8, True) and not known_metric("eval/pass@1", 1, True)
    assert known_metric("eval/gsm8k/pass@2", 4, True) and not known_metric("eval/gsm8k/nonsense", 4, True)
    assert not known_metric("eval/greedy_acc", 1, True) and not known_metric("reward/mean", 1, True)


def test_rollwise_eval_k_reports_the_estimator_of_the_known_correct_counts(tmp_path, tiny_model_dir):
    """`rollwise eval --k 4` with `quota_correct` (prompt with answer A: exactly |A| mod 5 of its 4 samples
    correct): pass@1, @2, @4 and avg@4 equal the binomial formula over those counts, the greedy response is
    scored apart (always wrong here), and --out holds 4 sampled responses per prompt that are not all alike."""
    toy_eval_plugins.reset_quota()
    out = tmp_path / "eval.jsonl"
    overrides = [o for o in tiny_overrides(tiny_model_dir) if not o.startswith("model.name=")]
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n", "16", "--k", "4",
                                      "--max-new-tokens", "6", "--out", str(out), *overrides,
                                      "reward.fn=toy_eval_plugins:quota_correct"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout.strip().splitlines()[-1])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    sampled = [r for r in lines if r["mode"] == "sampled"]
    answers = [r["answer"] for r in sampled[::4]]
    assert got["n"] == 16 and got["k"] == 4 and len(sampled) == 64
    counts = [toy_eval_plugins.quota_of(a) for a in answers]
    assert len(set(counts)) >= 3  # the prompts span several correct counts

    def expected(j):
        return sum(1 - comb(4 - c, j) / comb(4, j) for c in counts) / len(counts)

    assert got["pass@1"] == pytest.approx(expected(1)) and got["pass@2"] == pytest.approx(expected(2))
    assert got["pass@4"] == pytest.approx(expected(4))
    assert got["avg@4"] == pytest.approx(sum(c / 4 for c in counts) / 16) == pytest.approx(got["sampled_accuracy"])
    assert got["greedy_accuracy"] == 0.0
    assert [sum(r["correct"] for r in sampled[i:i + 4]) for i in range(0, 64, 4)] == counts
    assert any(len({r["final"] for r in sampled[i:i + 4]}) > 1 for i in range(0, 64, 4))  # 4 draws, not 1


@pytest.mark.slow
def test_a_run_with_eval_k_logs_pass_at_k(tmp_path, tiny_model_dir):
    """`eval.k = 3` in a run: every eval row has pass@1, @2, @3 and avg@3, non-decreasing in k, with
    pass@1 = avg@3 (no reward failed: every prompt has n = 3)."""
    from rollwise.loop import train

    cfg = tiny_config(tiny_model_dir, **{"eval.k": 3, "train.steps": 1, "eval.n": 8})
    train(cfg, tmp_path / "run")
    evals = [r for r in read_rows(tmp_path / "run") if r["kind"] == "eval"]
    assert len(evals) == 2
    for row in evals:
        values = [row["eval/pass@1"], row["eval/pass@2"], row["eval/pass@3"]]
        assert values == sorted(values) and row["eval/pass@1"] == pytest.approx(row["eval/avg@3"])
        assert row["eval/avg@3"] == pytest.approx(row["eval/sampled_accuracy"])
    report = (tmp_path / "run" / "report.html").read_text()
    assert "<h2>pass@k</h2>" in report and "eval/pass@3" in report


def test_eval_metrics_per_source_when_prompts_have_several_origins(tiny_model_dir):
    """Prompts of two origins (`Prompt.origin`, set by a mixture): `eval/<origin>/pass@j`, `avg@k`, accuracies
    and n over each origin's prompts alone, from the known correct counts of `quota_correct`; one origin only
    writes no per-source keys."""
    import torch

    from rollwise.data import PromptEncoder, build_prompt_source
    from rollwise.evaluate import evaluate
    from rollwise.generate import TorchEngine
    from rollwise.models import load_model
    from rollwise.rewards import get_reward_fn

    cfg = tiny_config(tiny_model_dir)
    model, tok = load_model(str(tiny_model_dir), dtype=torch.float32)
    encoder = PromptEncoder(tok, None, 256)
    prompts = [(p, encoder.encode(p)) for p in build_prompt_source(cfg.data, 0).eval_prompts(12)]
    for i, (p, _) in enumerate(prompts):
        p.origin = "odd" if i % 2 else "even"
    engine = TorchEngine(model, tok, max_batch_size=64)
    reward = get_reward_fn("toy_eval_plugins:quota_correct")
    toy_eval_plugins.reset_quota()
    got = evaluate(engine, prompts, reward, 0.7, 4, k=4)
    for origin, part in (("even", prompts[0::2]), ("odd", prompts[1::2])):
        counts = [toy_eval_plugins.quota_of(p.answer) for p, _ in part]
        for j in (1, 2, 4):
            want = sum(1 - comb(4 - c, j) / comb(4, j) for c in counts) / len(counts)
            assert got[f"eval/{origin}/pass@{j}"] == pytest.approx(want), (origin, j)
        assert got[f"eval/{origin}/avg@4"] == pytest.approx(sum(counts) / 4 / len(counts))
        assert got[f"eval/{origin}/n"] == 6.0 and got[f"eval/{origin}/greedy_accuracy"] == 0.0
    for p, _ in prompts:
        p.origin = "one"
    toy_eval_plugins.reset_quota()
    assert not [key for key in evaluate(engine, prompts, reward, 0.7, 4, k=4) if key.startswith("eval/one/")]


def test_rollwise_eval_ends_responses_at_rollout_stop_as_training_does(tmp_path, tiny_model_dir):
    """`rollout.stop` applies to evaluation too: with a stop string taken from the unstopped responses, every
    response that held it ends there (none still contains it) and responses get shorter."""
    overrides = [o for o in tiny_overrides(tiny_model_dir) if not o.startswith("model.name=")]

    def run(name: str, *extra: str) -> tuple[dict, list[dict]]:
        out = tmp_path / name
        result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n", "8", "--k", "2",
                                          "--max-new-tokens", "12", "--out", str(out), *overrides, *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1]), [json.loads(x) for x in out.read_text().splitlines()]

    plain, plain_rows = run("plain.jsonl")
    finals = [r["final"] for r in plain_rows]
    stop = max({c for f in finals for c in f if not c.isspace()}, key=lambda c: sum(c in f for f in finals))
    assert sum(stop in f for f in finals) >= 4  # the stop string occurs in several unstopped responses
    stopped, rows = run("stop.jsonl", f"rollout.stop={json.dumps([stop])}")
    assert not any(stop in r["final"] for r in rows)
    assert stopped["response_len_mean"] < plain["response_len_mean"]
