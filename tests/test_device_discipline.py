"""Every tensor a training step creates names its device.

The step runs with `torch.set_default_device("meta")` while the models live on the CPU: a tensor made without an
explicit device lands on `meta` and fails the moment it meets a CPU tensor (or is read back). On a GPU the same
tensor would land on the CPU and meet CUDA weights, so this CPU test catches, in CI, what would break a GPU run:
rollout (the torch engine), scoring, the reference and critic passes, the teacher's scoring, every loss term
(PPO clip with the importance correction, KL, entropy, GAE's value loss, OPD, GKD, SFT), the sync probe and a
checkpoint.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from conftest import tiny_config
from rollwise.build import open_run
from rollwise.loop import rl_step, run_eval
from rollwise.session import save_run

CASES = {
    "grpo, reference, correction, entropy": {"algo.kl_coef": 0.05, "algo.entropy_coef": 0.01,
                                             "algo.is_correction": "tis_token", "replay.kind": "hard_case",
                                             "replay.hard_reward_threshold": 2.0},
    "gae critic, two epochs": {"algo.advantage": "gae", "train.ppo_epochs": 2, "train.minibatches_per_epoch": 2},
    "kl in reward, behaviour old log-probs": {"algo.kl_coef": 0.05, "algo.kl_in_reward": True,
                                              "train.old_logprobs": "behaviour"},
    "opd teacher with routing and sft": {"teacher.weights": "base", "teacher.context": "hint",
                                         "distill.routing": "self_routing", "distill.sft_coef": 0.1},
    "gkd teacher": {"teacher.weights": "base", "distill.objective": "gkd", "teacher.top_k": 4},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_and_a_checkpoint_create_no_tensor_without_a_device(case, tmp_path, tiny_model_dir):
    overrides = {"reward.fn": "toy_plugins:digit_fraction", "eval.n": 4, "train.steps": 2,
                 "algo.filter_zero_variance": False, **CASES[case]}
    run = open_run(tiny_config(tiny_model_dir, **overrides), tmp_path / "run")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(2):  # the second step replays, and the teacher scores a policy that moved
                with torch.device("meta"):
                    row, _ = rl_step(run)
                assert row["train/tokens"] and row["train/tokens"] > 0
            with torch.device("meta"):
                save_run(run)
                evaluation = run_eval(run)  # seeded sampled and greedy decoding
    finally:
        run.close()
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors").is_file()
    assert evaluation["eval/n"] == 4.0
    assert all(p.device.type == "cpu" for p in run.model.parameters())


def test_the_check_does_catch_a_tensor_made_without_a_device():
    """The mechanism itself: under the meta default, a tensor without a device cannot meet a CPU one."""
    weights = torch.ones(3, device="cpu")
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        (torch.zeros(3) + weights).tolist()
