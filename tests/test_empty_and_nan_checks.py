"""Checks that must not pass on nothing, and maxima that must not lose a NaN."""

from __future__ import annotations

import json
import math

from rollwise.train.checkpoint import COMPLETE, latest_checkpoint
from rollwise.train.trainer import _Accumulator


def test_a_checkpoint_whose_marker_lists_no_file_is_not_resumed_from(tmp_path):
    """`COMPLETE` with an empty file list (a marker written before anything else, or emptied) is not a complete
    checkpoint: `--resume` takes the older complete one."""
    root = tmp_path / "checkpoints"
    good, empty = root / "step-1", root / "step-2"
    good.mkdir(parents=True)
    (good / "model.safetensors").write_bytes(b"x" * 10)
    (good / COMPLETE).write_text(json.dumps({"files": {"model.safetensors": 10}}))
    empty.mkdir()
    (empty / COMPLETE).write_text(json.dumps({"files": {}}))
    assert latest_checkpoint(tmp_path) == good


def test_a_nan_maximum_across_micro_batches_stays_nan():
    """`mismatch/logprob_abs_diff_max` is the max over micro-batches; a NaN in a later micro-batch used to be
    dropped by Python's `max` (NaN never compares greater), reporting the finite earlier value."""
    acc = _Accumulator()
    acc.add("mismatch/logprob_abs_diff_max", 0.25, 0.0)
    acc.add("mismatch/logprob_abs_diff_max", math.nan, 0.0)
    acc.add("mismatch/logprob_abs_diff_max", 0.5, 0.0)
    assert math.isnan(acc.means()["mismatch/logprob_abs_diff_max"])
    finite = _Accumulator()
    for value in (0.25, 0.75, 0.5):
        finite.add("m", value, 0.0)
    assert finite.means()["m"] == 0.75
