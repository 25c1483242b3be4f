"""The Sync stage's probe check on the real loop: any non-finite gap stops the run, wherever it falls."""

from __future__ import annotations

import contextlib
import io

import pytest

from conftest import read_rows, tiny_config
from rollwise.generate.torch_engine import TorchEngine
from rollwise.loop import train
from rollwise.sync import SyncError


def test_a_nan_after_the_first_probe_token_stops_the_run(tmp_path, tiny_model_dir, monkeypatch):
    """The engine's probe answer holds one NaN, at token 4 of 32 (NaN weights anywhere in a dense model spread
    to every position, so the NaN is put into the answer). Python's `max` over the gaps returns a finite gap
    when the NaN is not first (NaN never compares greater): that passed the check before; now the run stops at
    the first sync and no training row is written."""
    original = TorchEngine.probe_logprobs

    def one_nan(self, token_ids):
        logps = original(self, token_ids)
        logps[3] = float("nan")
        return logps

    monkeypatch.setattr(TorchEngine, "probe_logprobs", one_nan)
    cfg = tiny_config(tiny_model_dir, **{"eval.n": 0, "train.steps": 2, "reward.fn": "toy_plugins:digit_fraction"})
    with pytest.raises(SyncError, match=r"weight sync to version 1: the engine's log-prob of probe token 4 of "
                                        r"32 is nan \(1 non-finite in all\)"):
        with contextlib.redirect_stdout(io.StringIO()):
            train(cfg, tmp_path / "run")
    rows = read_rows(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert not [r for r in rows if r["kind"] == "train"]


def test_a_probe_answer_of_the_wrong_length_stops_the_run(tmp_path, tiny_model_dir, monkeypatch):
    """An engine that answers for fewer probe tokens than were sent (an empty answer included) is not a pass."""
    monkeypatch.setattr(TorchEngine, "probe_logprobs", lambda self, token_ids: [])
    cfg = tiny_config(tiny_model_dir, **{"eval.n": 0, "train.steps": 1, "reward.fn": "toy_plugins:digit_fraction"})
    with pytest.raises(SyncError, match=r"the engine returned 0 probe log-probs for 32 probe tokens"):
        with contextlib.redirect_stdout(io.StringIO()):
            train(cfg, tmp_path / "run")
