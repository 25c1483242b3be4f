"""Tree-search rollouts (`rollout.strategy = "tree"`, rStar-Math / MedS3): UCT selection, expansion, roll-out
and backup by hand on a scripted engine; behaviour log-probs on the real torch engine; a real tiny run whose
groups are paths of one tree; the recipe; the errors at --dry-run."""

from __future__ import annotations

import contextlib
import io
import math
from itertools import count
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import read_rows, tiny_config, tiny_overrides
from rollwise.cli import app
from rollwise.generate.groups import new_groups
from rollwise.generate.torch_engine import TorchEngine
from rollwise.loop import train
from rollwise.rollout_strategies import ROLLOUT_STRATEGIES
from rollwise.rollout_strategies.tree import Node, TreeStrategy, backup, uct_child
from rollwise.types import Prompt, RewardResult, SamplingParams, Status
from rollwise.validate import load
from test_rollout_strategies import EOS, ScriptedEngine

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "seed" / "tree.toml"
NEWLINE = 10  # EOS = 2, as in test_rollout_strategies


def _has_seven(sample) -> RewardResult:
    return RewardResult(value=float(7 in sample.response_ids))


def test_uct_picks_an_unvisited_child_first_then_the_largest_bound_by_hand():
    parent = Node([], [], [], visits=10, value_sum=5.0)
    a = Node([1], [0.0], [0.0], parent, visits=5, value_sum=4.0)  # Q 0.8
    b = Node([2], [0.0], [0.0], parent, visits=2, value_sum=1.0)  # Q 0.5
    parent.children = [a, b]
    # c = 1: 0.8 + sqrt(ln 10 / 5) = 1.4786 < 0.5 + sqrt(ln 10 / 2) = 1.5730
    assert uct_child(parent, 1.0) is b
    # c = 0.5: 0.8 + 0.3393 = 1.1393 > 0.5 + 0.5365 = 1.0365
    assert uct_child(parent, 0.5) is a
    assert math.isclose(a.q + 0.5 * math.sqrt(math.log(10) / 5), 1.1393, abs_tol=1e-4)
    c = Node([3], [0.0], [0.0], parent)
    parent.children.append(c)
    assert uct_child(parent, 0.0) is c  # unvisited first, whatever the bounds
    backup(c, 1.0)
    assert (c.visits, c.value_sum, parent.visits, parent.value_sum) == (1, 1.0, 11, 6.0)


def test_three_simulations_select_expand_roll_out_and_back_up_by_hand():
    prompt = Prompt("p0", [{"role": "user", "content": "x"}], answer="7")
    groups = new_groups([(prompt, [9, 9])], 2, 0)
    engine = ScriptedEngine([
        [[5, NEWLINE], [6, 3]],      # sim 1: expand the root: A = [5 \n], B = [6 3]
        [[7, EOS]],                  # sim 1: roll out A -> [5 \n 7 EOS], reward 1
        [[4, EOS], [8, 8]],          # sim 2: B unvisited; expand B: B1 = [4 EOS] (terminal), B2 = [8 8]
        [[7, NEWLINE, 9], [EOS]],    # sim 3: UCT A (1 + sqrt(ln 2)) over B (0 + sqrt(ln 2)); A1 = [7 \n] (9 dropped)
        [[EOS]],                     # sim 3: roll out A1 -> [5 \n 7 \n EOS], reward 1
    ])
    tree = TreeStrategy(_has_seven, lambda t: t == NEWLINE, step_tokens=2, branches=2, simulations=3, c_puct=1.0,
                        samples_per_prompt=2)
    tree.run(engine, groups, SamplingParams(max_new_tokens=6), count())
    assert len(engine.calls) == 5  # sim 2 picked a terminal step: nothing to roll out
    assert [r.response_ids for r in engine.calls[3]] == [[5, NEWLINE], [5, NEWLINE]]
    assert engine.calls[4][0].response_ids == [5, NEWLINE, 7, NEWLINE]
    assert all(r.params.max_new_tokens == 4 for r in engine.calls[3])  # the step budget after a 2-token prefix
    first, second = groups[0].samples  # the last two simulations
    assert first.response_ids == [6, 3, 4, EOS] and first.status == Status.COMPLETED
    assert second.response_ids == [5, NEWLINE, 7, NEWLINE, EOS]
    assert second.behaviour_logprobs == pytest.approx([-0.5, -1.0, -0.7, -1.0, -0.2])
    assert second.loss_mask == [1] * 5 and second.full_logprobs == pytest.approx(second.behaviour_logprobs)
    # Q: A = 2/2, A1 = 1/1, the tail [EOS] its own reward 1; B = 0/1, B1 = 0/1; root = 2/3
    assert second.info["step_values"] == [(0, 2, 1.0), (2, 4, 1.0), (4, 5, 1.0)]
    assert first.info["step_values"] == [(0, 2, 0.0), (2, 4, 0.0)]
    assert first.info["root_value"] == pytest.approx(2 / 3)
    m = tree.metrics()
    assert m["tree/q_mean"] == pytest.approx(2 / 3) and m["tree/nodes"] == 6.0
    assert m["tree/simulations"] == 3.0 and m["tree/depth_mean"] == 2.0 and m["tree/leaf_reward_failures"] == 0.0


def test_a_reward_that_fails_on_every_leaf_stops_the_search_with_its_error():
    def broken(sample):
        raise ValueError("no answer field")

    groups = new_groups([(Prompt("p0", [{"role": "user", "content": "x"}]), [9])], 1, 0)
    engine = ScriptedEngine([[[5, EOS], [6, EOS]]])
    tree = TreeStrategy(broken, lambda t: False, 2, 2, 1, 1.0, 1)
    with pytest.raises(RuntimeError, match="reward failed on every leaf.*no answer field"):
        tree.run(engine, groups, SamplingParams(max_new_tokens=4), count())


def test_on_the_torch_engine_behaviour_logprobs_equal_the_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = TorchEngine(model, tok, seed=1)
    tree = TreeStrategy(lambda s: RewardResult(value=len(s.response_ids) / 10), lambda t: "\n" in tok.decode([t]),
                        step_tokens=3, branches=2, simulations=5, c_puct=1.0, samples_per_prompt=4)
    groups = new_groups([(Prompt("p0", [{"role": "user", "content": "x"}]), tok.encode("What is 3 + 4?"))], 4, 0)
    tree.run(engine, groups, SamplingParams(max_new_tokens=9), count())
    firsts = [tuple(s.response_ids[:3]) for s in groups[0].samples]
    assert len(set(firsts)) < len(firsts)  # 4 paths under 2 root steps: two share their first step
    for s in groups[0].samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        trainer = logp[len(s.prompt_ids) - 1:].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.behaviour_logprobs), trainer, atol=1e-4)


@pytest.mark.slow
def test_a_tree_run_trains_on_paths_of_one_tree_with_matching_logprobs(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    run = TreeStrategy.run

    def spy(self, engine, groups, *args, **kwargs):
        out = run(self, engine, groups, *args, **kwargs)
        seen.extend(groups)
        return out

    monkeypatch.setattr(TreeStrategy, "run", spy)
    cfg = tiny_config(tiny_model_dir, **{"rollout.strategy": "tree", "rollout.tree.simulations": 6,
                                         "rollout.tree.step_tokens": 3, "reward.fn": "toy_plugins:digit_fraction",
                                         "eval.n": 0, "run.report": False})
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "tree")
    rows = [r for r in read_rows(tmp_path / "tree") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tree/simulations"] == 6.0 and r["tree/nodes"] >= 4.0 for r in rows)
    assert all(0.0 <= r["tree/q_mean"] <= 1.0 and r["tree/depth_mean"] >= 1.0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-3 for r in rows)  # the engine's log-probs, every token
    assert len(seen) == 8 and "train/loss" in rows[-1]
    for group in seen:  # the group is 4 paths of one tree with 2 root steps: two share their first step
        firsts = [tuple(s.response_ids[:s.info["step_values"][0][1]]) for s in group.samples]
        assert len(set(firsts)) < len(firsts)
        for s in group.samples:
            assert s.reward is not None and s.info["step_values"][-1][1] == len(s.response_ids)


def test_the_strategy_is_registered():
    assert "tree" in ROLLOUT_STRATEGIES.names()


# --- algo.method = "tree": the step values as token advantages ----------------------------------------------

def _with_steps(steps, root):
    sample = new_groups([(Prompt("p0", [{"role": "user", "content": "x"}]), [9])], 1, 0)[0].samples[0]
    if steps is not None:
        sample.info.update(step_values=steps, root_value=root)
    return sample


def test_step_advantages_are_q_minus_the_previous_steps_q_mixed_with_the_outcome_by_hand():
    from types import SimpleNamespace

    from rollwise.methods.tree import TreeTerms, step_advantages

    valued = _with_steps([(0, 2, 1.0), (2, 4, 0.5), (4, 5, 0.0)], 0.6)
    plain = _with_steps(None, None)
    steps, has = step_advantages([valued, plain], 6)
    assert steps[0].tolist() == pytest.approx([0.4, 0.4, -0.5, -0.5, -0.5, 0.0])  # Q(k) - Q(k-1), Q(-1) = root
    assert steps[1].tolist() == [0.0] * 6 and has.tolist() == [True, False]
    mask = torch.tensor([[1.0] * 5 + [0.0], [1.0] * 6])
    mb = SimpleNamespace(samples=[valued, plain], loss_mask=mask, advantages=torch.tensor([-1.0, 2.0]))
    terms = TreeTerms(coef=0.5)
    terms.start()
    adv = terms.advantages(torch.zeros(2, 6), mb, None)
    # 0.5 x (-1) + 0.5 x step; the sample without step values keeps its outcome advantage
    assert adv[0].tolist() == pytest.approx([-0.3, -0.3, -0.75, -0.75, -0.75, -0.5])
    assert adv[1].tolist() == [2.0] * 6
    terms.advantages(torch.zeros(2, 6), mb, None)  # a second epoch over the same micro-batch: counted once
    m = terms.metrics()
    assert m["tree/step_adv_abs_mean"] == pytest.approx((0.4 * 2 + 0.5 * 3) / 5)
    assert m["tree/samples_without_values"] == 1.0


@pytest.mark.slow
def test_a_tree_method_run_trains_tokens_of_one_response_on_different_step_advantages(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    from rollwise.methods.tree import TreeTerms

    given = []
    advantages = TreeTerms.advantages

    def spy(self, own_logp, mb, entropy):
        out = advantages(self, own_logp, mb, entropy)
        given.append((out.detach().clone(), mb.loss_mask.clone()))
        return out

    monkeypatch.setattr(TreeTerms, "advantages", spy)
    cfg = tiny_config(tiny_model_dir, **{"rollout.strategy": "tree", "algo.method": "tree",
                                         "rollout.tree.simulations": 6, "rollout.tree.step_tokens": 2,
                                         "reward.fn": "toy_plugins:digit_fraction", "eval.n": 0, "run.report": False})
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "tree-method")
    rows = [r for r in read_rows(tmp_path / "tree-method") if r["kind"] == "train"]
    assert len(rows) == 2 and all(r["tree/step_adv_abs_mean"] > 0 and r["tree/samples_without_values"] == 0 for r in rows)
    varied = [row[mask > 0].unique().numel() > 1 for adv, mask in given for row, mask in zip(adv, mask)]
    assert any(varied)  # tokens of one response got different advantages: the step values reach the update


@pytest.mark.slow
def test_the_recipe_runs_two_steps_on_the_tiny_model(tiny_model_dir, tmp_path):
    cfg = load(RECIPE, tiny_overrides(tiny_model_dir, **{
        "reward.fn": "toy_plugins:digit_fraction", "eval.n": 4, "run.report": False, "run.name": None,
        "rollout.max_new_tokens": 8}))
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg, tmp_path / "tree")
    rows = [r for r in read_rows(tmp_path / "tree") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2] and all(r["tree/simulations"] > 0 for r in rows)
    assert all("tree/step_adv_abs_mean" in r for r in rows)  # the recipe trains on the step values


def test_the_recipe_passes_dry_run():
    result = CliRunner().invoke(app, ["train", str(RECIPE), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert 'strategy = "tree"' in result.output


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.strategy": "tree", "rollout.tree.simulations": 2}, "set rollout.tree.simulations >= 4"),
    ({"rollout.strategy": "tree", "rollout.tree.branches": 0}, "rollout.tree.branches"),
    ({"rollout.strategy": "tree", "rollout.tree.step_tokens": 0}, "rollout.tree.step_tokens"),
    ({"rollout.strategy": "tree", "rollout.tree.c_puct": -1.0}, "rollout.tree.c_puct"),
    ({"rollout.strategy": "tree", "control.mode": "async"}, "set control.mode = 'sync'"),
    ({"algo.method": "tree"}, "algo.method = 'tree' trains on the step values of tree-search rollouts: set "
                              "rollout.strategy = 'tree'"),
    ({"rollout.strategy": "tree", "algo.method": "tree", "algo.tree.value_coef": 1.5}, "algo.tree.value_coef"),
])
def test_bad_settings_fail_at_dry_run_with_one_line(tiny_model_dir, overrides, message):
    result = CliRunner().invoke(app, ["train", "--dry-run", *tiny_overrides(tiny_model_dir, **overrides)])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
