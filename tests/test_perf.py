"""FLOP accounting and the cached matmul peak."""

import json

from rollwise import perf


def test_flop_counter_hand_computed():
    info = {"vocab_size": 10, "hidden_size": 4, "params_matmul": 140, "layers": 2}
    c = perf.FlopCounter(info)
    # head = 10 * 4 = 40, body = 140 - 40 = 100, attention per context position = 4 * 2 * 4 = 32
    assert c.head == 40 and c.body == 100 and c.attn_per_ctx == 32
    # 3 tokens at context 5 with logits on 2: 2*100*3 + 32*5*3 + 2*40*2 = 600 + 480 + 160
    assert c.forward(3, 5, 2) == 1240
    # training = 3x forward (forward + backward), per pass, over the mean context / 2
    assert c.train(3, 2, 10, passes=2) == 6 * c.forward(3, 5, 2)


def test_matmul_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(perf, "measure_matmul_gflops", lambda dtype: calls.append(dtype) or 123.0)
    assert perf.matmul_peak_gflops() == 123.0
    assert perf.matmul_peak_gflops() == 123.0
    assert len(calls) == 1
    stored = json.loads((tmp_path / perf.PEAK_FILE).read_text())
    assert list(stored.values()) == [123.0]


def test_measure_matmul_gflops_is_positive():
    assert perf.measure_matmul_gflops(size=128, repeats=2) > 0
