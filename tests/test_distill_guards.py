"""Distillation guards (rollwise.distill.guards) against hand-computed values."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from rollwise.distill.guards import CollapseError, CollapseGuard, gap_metrics, repetition_rate, response_lengths


def test_repetition_rate_by_hand():
    # grams 12, 21, 12, 21: the last two repeat -> 2 / 4
    assert repetition_rate([[1, 2, 1, 2, 1]], n=2) == 0.5
    # [5]*6: 5555 three times, 2 repeats; [1,2,3,4,1,2,3,4]: 1234 2341 3412 4123 1234, 1 repeat;
    # [1,2,3] is shorter than n and adds nothing -> (2 + 1) / (3 + 5)
    assert repetition_rate([[5] * 6, [1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3]], n=4) == 3 / 8
    assert repetition_rate([[7, 7, 8]], n=1) == pytest.approx(1 / 3)


def test_repetition_rate_counts_only_within_a_response():
    assert repetition_rate([[1, 2, 3, 4], [1, 2, 3, 4]]) == 0.0  # the same 4-gram in two responses
    assert repetition_rate([]) == 0.0
    assert repetition_rate([[1, 2], []], n=4) == 0.0  # no 4-grams at all
    with pytest.raises(ValueError, match="n=0"):
        repetition_rate([[1, 2]], n=0)


def test_gap_metrics_mean_and_position_buckets():
    gap = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    out = gap_metrics(gap, mask, None, buckets=2)
    # row 0: L=4, buckets t*2//4 = 0,0,1,1; row 1: L=2, buckets t*2//2 = 0,1
    assert out == pytest.approx({"distill/gap_mean": 40 / 6, "distill/gap_pos_q1": 13 / 3,
                                 "distill/gap_pos_q2": 27 / 3})


def test_gap_metrics_holes_count_as_positions_and_empty_buckets_are_absent():
    gap = torch.tensor([[2.0, 99.0, 6.0, float("nan")]])
    mask = torch.tensor([[1, 0, 1, 0]])  # a tool token at t=1; the response ends at t=2, so L=3
    assert response_lengths(mask).tolist() == [3]
    out = gap_metrics(gap, mask, None, buckets=4)
    # t=0: 0*4//3 = 0 -> q1; t=2: 2*4//3 = 2 -> q3; q2 and q4 hold no token
    assert out == {"distill/gap_mean": 4.0, "distill/gap_pos_q1": 2.0, "distill/gap_pos_q3": 6.0}


def test_gap_metrics_entropy_at_top_gap():
    # ten scored tokens and one padding column whose huge gap and entropy must be ignored
    gap = torch.tensor([[-3.0, 0.1, 0.2, 2.5, 0.3, -0.4, 0.5, 0.6, 0.7, 0.8, 100.0]])
    entropy = torch.tensor([[4.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 50.0]])
    mask = torch.tensor([[1.0] * 10 + [0.0]])
    out = gap_metrics(gap, mask, entropy, top_frac=0.2)
    assert out["distill/entropy_mean"] == pytest.approx(0.6)  # 6 / 10
    assert out["distill/entropy_at_top_gap"] == pytest.approx(3.0)  # |gap| 3.0 and 2.5 -> entropies 4, 2
    assert gap_metrics(gap, mask, entropy, top_frac=0.1)["distill/entropy_at_top_gap"] == 4.0  # one token
    assert gap_metrics(gap, mask, entropy, top_frac=0.05)["distill/entropy_at_top_gap"] == 4.0  # at least one


def test_gap_metrics_without_tokens_and_bad_shapes():
    assert gap_metrics(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3)) == {}  # nothing measured
    with pytest.raises(ValueError, match="entropy"):
        gap_metrics(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="top_frac"):
        gap_metrics(torch.ones(2, 3), torch.ones(2, 3), None, top_frac=0.0)


# (mean_len, repetition_rate, truncated_frac) per step, steps 1..8; window 3, default thresholds
# step 5: len_rise 0.6 and repetition 0.25, but truncated 0.3 <= 0.5 and repetition <= 0.4 -> no alarm
# step 6: len_rise 1.0 > 0.5, repetition 0.3 > 0.2, truncated 0.6 > 0.5 -> the first alarm
COLLAPSE = [(100, 0.05, 0.0), (90, 0.05, 0.0), (110, 0.05, 0.0), (120, 0.1, 0.1),
            (160, 0.25, 0.3), (200, 0.3, 0.6), (250, 0.5, 0.9), (256, 0.6, 1.0)]
EXPECTED_RISE = [0.0, 90 / 95 - 1, 0.1, 0.2, 0.6, 1.0, 1.5, 1.56]  # baseline 100, mean(100, 90), then 100


def _run(guard: CollapseGuard, steps: list[tuple[float, float, float]], first_step: int = 1) -> list[dict]:
    return [guard.observe(first_step + i, *values) for i, values in enumerate(steps)]


def test_collapse_alarms_exactly_at_the_expected_step(capsys):
    out = _run(CollapseGuard(window_steps=3), COLLAPSE)
    assert [o["distill/collapse_alarm"] for o in out] == [0.0] * 5 + [1.0] * 3
    assert_close(torch.tensor([o["distill/len_rise"] for o in out]), torch.tensor(EXPECTED_RISE))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollwise: step 6: truncation collapse")
    assert "200.0" in lines[0] and "+100%" in lines[0] and "distill.coef" in lines[0]
    assert "algo.kl_coef" in lines[0] and "teacher.temperature" in lines[0]


def test_hard_repetition_alarms_without_truncation():
    out = _run(CollapseGuard(window_steps=2), [(100, 0.0, 0.0), (100, 0.0, 0.0), (200, 0.45, 0.0)])
    assert [o["distill/collapse_alarm"] for o in out] == [0.0, 0.0, 1.0]  # 0.45 > 2 * 0.2


def test_no_alarm_when_length_rises_without_repetition(capsys):
    rising = [(100 * 1.5 ** i, 0.05, min(1.0, 0.2 * i)) for i in range(10)]  # x38 longer, mostly truncated
    assert all(o["distill/collapse_alarm"] == 0.0 for o in _run(CollapseGuard(), rising))
    looping = [(100, 0.9, 1.0)] * 10  # repeats but never grows
    assert all(o["distill/collapse_alarm"] == 0.0 for o in _run(CollapseGuard(), looping))
    assert capsys.readouterr().out == ""


def test_no_alarm_before_window_steps_are_seen():
    out = _run(CollapseGuard(window_steps=3), [(100, 0.0, 0.0), (400, 0.9, 1.0)])
    assert out[1] == pytest.approx({"distill/collapse_alarm": 0.0, "distill/len_rise": 0.6})  # 400 / mean(100, 400) - 1


def test_stop_raises_collapse_error_with_the_line():
    guard = CollapseGuard(window_steps=3, stop=True)
    _run(guard, COLLAPSE[:5])
    with pytest.raises(CollapseError, match=r"^rollwise: step 6: truncation collapse") as caught:
        guard.observe(6, *COLLAPSE[5])
    assert isinstance(caught.value, RuntimeError)


@pytest.mark.parametrize("split", [2, 4, 7])
def test_resumed_guard_alarms_identically(split, capsys):
    straight = _run(CollapseGuard(window_steps=3), COLLAPSE)
    straight_out = capsys.readouterr().out
    first = CollapseGuard(window_steps=3)
    before = _run(first, COLLAPSE[:split])
    resumed = CollapseGuard(window_steps=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    after = _run(resumed, COLLAPSE[split:], first_step=split + 1)
    assert before + after == straight
    assert capsys.readouterr().out == straight_out  # one line in all, even when resumed after the alarm
    fresh = _run(CollapseGuard(window_steps=3), COLLAPSE[split:], first_step=split + 1)
    assert fresh != straight[split:]  # without the saved baseline the run would differ


def test_load_state_dict_names_the_missing_key():
    with pytest.raises(ValueError, match="baseline_lens"):
        CollapseGuard().load_state_dict({"steps_seen": 3, "alarmed": False})
