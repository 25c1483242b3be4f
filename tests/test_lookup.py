"""The `lookup` task, environment and reward (rollwise/envs/lookup.py): determinism, the split by record, the
per-prompt tool through `LookupEnv.step`, and the reward."""

import pickle

import pytest

from rollwise.config import DataConfig, EnvConfig
from rollwise.data.sources import build_prompt_source
from rollwise.envs import build_env
from rollwise.envs.lookup import (
    ATTRIBUTES,
    EXAMPLE_RECORD,
    LookupEnv,
    LookupTask,
    find_record,
    lookup_reward,
    record_line,
)
from rollwise.rewards import REWARDS
from rollwise.types import Prompt, Sample, Status

CFG = DataConfig(task="lookup", eval_size=64)


def names(prompts: list[Prompt]) -> set[str]:
    return {r["name"] for p in prompts for r in p.info["records"]}


def sample(prompt: Prompt, text: str) -> Sample:
    return Sample(prompt=prompt, prompt_ids=[1], response_ids=[2], behaviour_logprobs=[0.0], loss_mask=[1],
                  status=Status.COMPLETED, group_id=0,
                  response_text=text)


@pytest.fixture(scope="module")
def task() -> LookupTask:
    return build_prompt_source(CFG, seed=3)


def test_registered_with_its_env_and_reward(task: LookupTask) -> None:
    assert isinstance(task, LookupTask) and task.default_env == "lookup" and task.default_reward == "lookup"
    assert REWARDS.get("lookup") is lookup_reward
    env = build_env(EnvConfig(), task.default_env)
    assert isinstance(env, LookupEnv) and env.stop == ("</lookup>",)


def test_prompts_are_deterministic_and_the_eval_split_ignores_the_seed(task: LookupTask) -> None:
    again = LookupTask(CFG, seed=3)
    other = LookupTask(CFG, seed=4)
    first = [task.train_prompt(i) for i in range(20)]
    assert [(p.uid, p.messages, p.answer, p.info) for p in first] == \
        [(p.uid, p.messages, p.answer, p.info) for p in (again.train_prompt(i) for i in range(20))]
    assert [p.messages for p in first] != [other.train_prompt(i).messages for i in range(20)]
    assert [(p.uid, p.info) for p in task.eval_prompts(64)] == [(p.uid, p.info) for p in other.eval_prompts(64)]
    assert task.world == other.world  # the world does not depend on the training seed either


def test_question_answer_and_records(task: LookupTask) -> None:
    prompt = task.train_prompt(0)
    info = prompt.info
    target = next(r for r in info["records"] if r["name"] == info["name"])
    assert prompt.answer == str(target[info["attribute"]]) and info["attribute"] in ATTRIBUTES
    assert len(info["records"]) == 4 and len(names([prompt])) == 4
    roles = [m["role"] for m in prompt.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]  # the worked example
    assert info["name"] in prompt.messages[-1]["content"]
    assert prompt.answer not in prompt.messages[-1]["content"]  # only the tool knows it
    plain = LookupTask(CFG, seed=3, example=False).train_prompt(0)
    assert [m["role"] for m in plain.messages] == ["system", "user"] and plain.uid != prompt.uid
    assert plain.messages[-1] == prompt.messages[-1] and plain.info == prompt.info


def test_split_by_record_no_record_in_both(task: LookupTask) -> None:
    held, trained = {r["name"] for r in task.held_out}, {r["name"] for r in task.training}
    assert not held & trained and len(held) + len(trained) == len(task.world) == 2000
    assert len(held) == 400
    eval_names = names(task.eval_prompts(64))
    train_names = names([task.train_prompt(i) for i in range(300)])
    assert eval_names <= held and train_names <= trained and not eval_names & train_names
    assert len({p.messages[-1]["content"] for p in task.eval_prompts(64)}) == 64  # distinct questions


def test_the_tool_reads_only_the_prompts_records(task: LookupTask) -> None:
    env = build_env(EnvConfig(), "lookup")
    prompt = task.train_prompt(5)
    target = next(r for r in prompt.info["records"] if r["name"] == prompt.info["name"])
    state = env.reset(prompt)
    step = env.step(state, f"<lookup>  {target['name'].upper()} </lookup>")  # case and spaces do not matter
    assert not step.done and step.messages == [{"role": "tool", "content": record_line(target)}]
    assert step.reward_parts == {"tool_calls": 1.0, "tool_errors": 0.0, "parse_failures": 0.0}
    assert step.tool_calls[0].args == {"name": target["name"].upper()} and step.tool_calls[0].error is None

    stranger = next(r["name"] for r in task.training if r["name"] not in names([prompt]))
    miss = env.step(state, f"<lookup>{stranger}</lookup>")  # in the world, but not in this prompt's records
    assert miss.reward_parts["tool_errors"] == 1.0 and f"no record named {stranger!r}" in miss.messages[0]["content"]

    broken = env.step(state, "<lookup>Orrin")
    assert broken.parse_failures == 1 and not broken.tool_calls
    final = env.step(state, str(target["pet"]))
    assert final.done and final.reward_parts["tool_calls"] == 0.0
    assert state["turn"] == 4
    pickle.loads(pickle.dumps(state))  # partial rollouts carry the state across steps


def test_hermes_calls_and_a_prompt_without_records() -> None:
    env = build_env(EnvConfig(parser="hermes"), "lookup")
    prompt = Prompt(uid="p", messages=[{"role": "user", "content": "?"}], answer="x",
                    info={"records": [dict(EXAMPLE_RECORD)]})
    step = env.step(env.reset(prompt), '<tool_call>{"name": "lookup", "arguments": {"name": "orrin vail"}}</tool_call>')
    assert step.messages[0]["content"] == record_line(EXAMPLE_RECORD)
    bare = Prompt(uid="q", messages=[{"role": "user", "content": "?"}], answer="x", source="rows.jsonl:3")
    with pytest.raises(ValueError, match=r"rows.jsonl:3.*info\['records'\]"):
        env.step(env.reset(bare), "<lookup>Orrin Vail</lookup>")
    with pytest.raises(ValueError, match="empty name"):
        find_record([EXAMPLE_RECORD], "  ")


@pytest.mark.parametrize(("text", "correct", "found"), [
    ("mason", True, True), ("Mason.", True, True), ("The answer is mason", True, True), ("answer: MASON!", True, True),
    ("  'mason' ", True, True), ("stonemason", False, True), ("mason, I think", False, True), ("", False, False),
])
def test_reward_is_exact_match_after_normalising(text: str, correct: bool, found: bool) -> None:
    prompt = Prompt(uid="p", messages=[], answer="Mason", source="lookup:test")
    s = sample(prompt, text)
    result = lookup_reward(s)
    assert result.value == (1.0 if correct else 0.0) and result.correct is correct
    assert s.correct is None  # a reward does not write to the sample; scoring applies its result
    assert result.parts == {"correct": result.value, "format": 1.0 if found else 0.0}


def test_reward_on_a_year_and_without_a_reference() -> None:
    assert lookup_reward(sample(Prompt(uid="p", messages=[], answer="1873"), "1873")).value == 1.0
    assert lookup_reward(sample(Prompt(uid="p", messages=[], answer="1873"), "1874")).value == 0.0
    with pytest.raises(ValueError, match="no reference answer"):
        lookup_reward(sample(Prompt(uid="p", messages=[], answer=None, source="lookup:x"), "1873"))
