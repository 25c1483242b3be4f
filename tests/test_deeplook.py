"""DeepLook (rollwise.decode.deeplook): segment confidence, the trigger, ALC ranking, voting, tokens spent; and
`rollwise eval --decode deeplook` on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from conftest import tiny_overrides
from rollwise.decode.deeplook import (DeepLook, DeepLookSettings, average_lookahead_confidence, segment_confidence,
                                      segment_confidences, triggers, vote)
from rollwise.types import GenerationResult, Prompt, Status


def test_segment_confidence_and_alc_hand_values():
    assert segment_confidence([math.log(0.5), math.log(0.125)]) == pytest.approx(0.25)  # geometric mean
    assert segment_confidences([0.0, 0.0, math.log(0.25)], 2) == pytest.approx([1.0, 0.25])
    assert average_lookahead_confidence([0.0, 0.0, math.log(0.25)], 2) == pytest.approx(0.625)
    assert average_lookahead_confidence([], 2) == 0.0


def test_trigger_is_relative_to_recent_history():
    s = DeepLookSettings(drop_ratio=0.9, window=2)
    assert not triggers([], 0.01, s)  # nothing to compare with yet
    assert triggers([0.2, 0.8, 0.8], 0.71, s)  # 0.71 < 0.9 * mean(0.8, 0.8) = 0.72: the old 0.2 is out of window
    assert not triggers([0.2, 0.8, 0.8], 0.73, s)


def test_vote_majority_then_confidence():
    assert vote(["3", "4", "3", None], [0.1, 0.9, 0.2, 0.9]) == 2  # "3" wins; its more confident trace
    assert vote(["3", "4"], [0.4, 0.6]) == 1  # a tie goes to the more confident answer
    assert vote([None, None, "7"], [0.9, 0.9, 0.1]) == 2  # no answer votes last


class ScriptedEngine:
    """Continues each request by `max_new_tokens - len(response_ids)` tokens: token = the row's index in its call,
    log-prob = script[call](row). Never ends early (TRUNCATED at the limit)."""

    def __init__(self, script):
        self.script, self.calls = script, 0

    def generate(self, requests):
        out = []
        for row, r in enumerate(requests):
            n = r.params.max_new_tokens - len(r.response_ids)
            lp = self.script[min(self.calls, len(self.script) - 1)](row)
            out.append(GenerationResult(r.request_id, r.response_ids + [row] * n, r.response_logprobs + [lp] * n,
                                        Status.TRUNCATED, [], "", full_logprobs=[]))
        self.calls += 1
        return out


def test_low_confidence_segment_is_replaced_by_the_best_lookahead_branch():
    script = [lambda row: -0.1,  # segment 1: confidence 0.905, accepted
              lambda row: -1.0,  # segment 2: 0.37 < 0.9 * 0.905: discarded, look ahead
              lambda row: [-2.0, -0.05, -0.5][row]]  # three branches: row 1 has the highest ALC
    engine = ScriptedEngine(script)
    settings = DeepLookSettings(segment_tokens=2, drop_ratio=0.9, window=4, branches=3, horizon_tokens=4, voters=1)
    [trace] = DeepLook(settings).run(engine, [(Prompt([], None), [5, 6])], temperature=1.0, max_new_tokens=6)
    assert trace.ids == [0, 0, 1, 1, 1, 1]
    assert trace.triggers == 1
    assert trace.tokens_spent == 2 + 2 + 3 * 4  # the discarded segment and every branch count
    assert trace.history == pytest.approx([math.exp(-0.1), math.exp(-0.05), math.exp(-0.05)])


def test_no_trigger_spends_exactly_the_response():
    engine = ScriptedEngine([lambda row: -0.5])  # constant confidence never drops
    settings = DeepLookSettings(segment_tokens=3, branches=2, voters=2)
    traces = DeepLook(settings).run(engine, [(Prompt([], None), [5])], temperature=1.0, max_new_tokens=7)
    assert [len(t.ids) for t in traces] == [7, 7] and all(t.tokens_spent == 7 and t.triggers == 0 for t in traces)


def test_eval_cli_decode_deeplook_on_the_tiny_model(tiny_model_dir):
    """The command end to end: plain figures and deeplook_* side by side; an eager trigger (drop ratio 1) makes
    DeepLook spend more tokens per prompt than its traces keep."""
    from rollwise.cli import app

    overrides = [o for o in tiny_overrides(tiny_model_dir, **{"eval.deeplook_drop_ratio": 1.0,
                                                               "eval.deeplook_voters": 2,
                                                               "eval.deeplook_segment_tokens": 2,
                                                               "eval.deeplook_horizon_tokens": 3})]
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n", "3", "--no-greedy",
                                      "--max-new-tokens", "8", "--decode", "deeplook", *overrides])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["n"] == 3 and 0.0 <= out["deeplook_accuracy"] <= 1.0
    assert out["deeplook_triggers_per_trace"] > 0
    assert out["deeplook_tokens_per_prompt"] > out["deeplook_response_len_mean"] * 2
    assert "sampled_tokens_per_prompt" in out and 0.0 <= out["deeplook_plain_vote_accuracy"] <= 1.0


def test_plain_vote_accuracy_takes_each_prompts_majority():
    from types import SimpleNamespace

    from rollwise.decode.deeplook import vote_accuracy

    def s(text, correct):
        return SimpleNamespace(response_text=text, correct=correct, behaviour_logprobs=[-0.1], status=Status.COMPLETED)

    # prompt 1: "4" twice (correct) beats "5"; prompt 2: "7" twice (wrong) beats "8" (right)
    samples = [s("4", True), s("5", False), s("4", True), s("7", False), s("8", True), s("7", False)]
    assert vote_accuracy(samples, 3) == 0.5


def test_bad_decode_and_bad_keys_fail_with_one_line(tiny_model_dir):
    from rollwise.cli import app
    from rollwise.config import ConfigError
    from rollwise.validate import load

    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n", "1", "--decode", "deeplok"])
    assert result.exit_code != 0 and "--decode 'deeplok' is not one of plain, deeplook" in result.output
    with pytest.raises(ConfigError, match="deeplook_branches"):
        load(None, tiny_overrides(tiny_model_dir, **{"eval.deeplook_branches": 1}))
