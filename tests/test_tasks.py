"""Built-in procedural tasks: determinism, fixed eval split, train/eval disjointness, correct answers."""

from __future__ import annotations

import re
import sys
import types

import pytest

from rollwise.config import DataConfig
from rollwise.data import TASKS, ArithTask, LettersTask, build_prompt_source, load_words
from rollwise.data.tasks import arith_phrasings, fact_score


def texts(prompts):
    return [p.messages[0]["content"] for p in prompts]


def train_texts(source, n, start=0):
    return [source.train_prompt(i).messages[0]["content"] for i in range(start, start + n)]


@pytest.fixture(scope="module")
def arith0():
    return build_prompt_source(DataConfig(), seed=0)


def test_registry_has_builtin_tasks():
    assert {"arith", "letters"} <= set(TASKS.names())


def test_tool_tasks_are_listed_without_importing_envs():
    """`data` never imports `envs`: the tool tasks are registered by dotted name and imported on first use."""
    import subprocess

    code = ("import sys; from rollwise.data import TASKS; from rollwise.rewards import REWARDS; "
            "assert 'rollwise.envs' not in sys.modules, 'data imported envs'; "
            "assert {'calc', 'lookup', 'pyexec'} <= set(TASKS.names()) and 'lookup' in REWARDS.names(); "
            "task = TASKS.get('lookup'); assert 'rollwise.envs.lookup' in sys.modules and task.__name__ == "
            "'lookup_task'; assert REWARDS.get('lookup').__name__ == 'lookup_reward'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_lazy_entry_is_one_name_like_any_other():
    from rollwise.registry import Registry

    registry = Registry("thing")
    registry.register_lazy("later", "rollwise.data.tasks:letters_task")
    assert "later" in registry and registry.names() == ["later"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register("later")(lambda: None)
    assert registry.get("later") is registry.get("later") and registry.items() == [("later", registry.get("later"))]
    assert isinstance(build_prompt_source(DataConfig(task="letters"), 0), LettersTask)


def test_arith_prompt_shape(arith0):
    prompt = arith0.train_prompt(0)
    assert len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
    assert prompt.source == "arith:train 0"
    assert arith0.default_reward == "arith" and arith0.name == "arith"
    assert prompt.answer is not None and prompt.answer.isdigit()


def test_same_seed_same_prompts_different_seed_different_order(arith0):
    again = build_prompt_source(DataConfig(), seed=0)
    other = build_prompt_source(DataConfig(), seed=1)
    first = train_texts(arith0, 50)
    assert first == train_texts(again, 50)
    assert [p.answer for p in map(arith0.train_prompt, range(50))] == [again.train_prompt(i).answer for i in range(50)]
    assert first != train_texts(other, 50)
    # position is random access: asking out of order gives the same prompt
    assert arith0.train_prompt(37).messages == again.train_prompt(37).messages


def test_eval_split_is_fixed_distinct_and_seed_independent(arith0):
    other = build_prompt_source(DataConfig(), seed=123)
    held_out = texts(arith0.eval_prompts(512))
    assert len(held_out) == len(set(held_out)) == 512
    assert held_out == texts(other.eval_prompts(512))
    assert texts(arith0.eval_prompts(10)) == held_out[:10]
    assert [p.source for p in arith0.eval_prompts(2)] == ["arith:eval 0", "arith:eval 1"]


def test_eval_request_larger_than_split_fails(arith0):
    with pytest.raises(ValueError, match="held-out split has 512"):
        arith0.eval_prompts(513)


def test_training_never_uses_an_eval_prompt(arith0):
    held_out = set(texts(arith0.eval_prompts(512)))
    seen = set(train_texts(arith0, 20_000))
    assert not seen & held_out
    # the training pool is the rest of the 155 problems x 8 phrasings = 1240 texts
    assert len(seen) == 155 * 8 - 512


def test_letters_training_never_uses_an_eval_prompt():
    source = build_prompt_source(DataConfig(task="letters", eval_size=600), seed=3)
    held_out = set(texts(source.eval_prompts(600)))
    assert len(held_out) == 600
    assert not set(train_texts(source, 5000)) & held_out


def test_same_problem_same_uid(arith0):
    by_text = {}
    for i in range(300):
        prompt = arith0.train_prompt(i)
        assert by_text.setdefault(prompt.messages[0]["content"], prompt.uid) == prompt.uid
    assert len(set(by_text.values())) == len(by_text)


def check_arith(prompt, digits):
    info = prompt.info
    a, b, op = info["a"], info["b"], info["op"]
    assert 0 <= a < 10**digits and 0 <= b < 10**digits
    assert int(prompt.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert int(prompt.answer) >= 0
    numbers = [int(x) for x in re.findall(r"\d+", prompt.messages[0]["content"])]
    assert sorted(numbers) == sorted([a, b])


def test_arith_answers_and_operand_ranges():
    source = build_prompt_source(DataConfig(digits=2, ops=["+", "-", "*"]), seed=5)
    prompts = [source.train_prompt(i) for i in range(600)] + source.eval_prompts(100)
    for prompt in prompts:
        check_arith(prompt, digits=2)
    assert {p.info["op"] for p in prompts} == {"+", "-", "*"}
    assert max(max(p.info["a"], p.info["b"]) for p in prompts) >= 90


def test_arith_uses_at_least_six_plain_phrasings(arith0):
    templates = {re.sub(r"\d+", "N", t) for t in train_texts(arith0, 400)}
    templates = {re.sub(r" [+-] ", " OP ", t) for t in templates}
    assert len(templates) >= 6
    for op in "+-*":
        for phrasing in arith_phrasings(op):
            assert "answer" not in phrasing.lower() and "only" not in phrasing.lower()


def test_arith_space_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match=r"only 440 distinct prompts.*data\.eval_size"):
        ArithTask(DataConfig(ops=["-"]), seed=0)
    assert len(ArithTask(DataConfig(ops=["-"], eval_size=100), seed=0).eval_prompts(100)) == 100


def test_word_list_is_packaged_and_clean():
    words = load_words()
    assert len(words) >= 2000
    assert all(w.isascii() and w.isalpha() and w.islower() for w in words)
    assert "children" in words


def test_letters_answers_match_the_word():
    source = build_prompt_source(DataConfig(task="letters"), seed=0)
    prompts = [source.train_prompt(i) for i in range(500)]
    kinds = {p.info["kind"] for p in prompts}
    assert kinds == {"count", "length"}
    for prompt in prompts:
        word, text = prompt.info["word"], prompt.messages[0]["content"]
        assert f"'{word}'" in text
        if prompt.info["kind"] == "count":
            assert f"'{prompt.info['letter']}'" in text
            assert prompt.answer == str(word.count(prompt.info["letter"]))
        else:
            assert prompt.answer == str(len(word))
    assert any(p.answer == "0" for p in prompts) and any(int(p.answer) >= 2 for p in prompts)
    assert source.default_reward == "letters"


def test_plugin_task_by_dotted_path(monkeypatch):
    plugin = types.ModuleType("fake_task_plugin")
    plugin.make = lambda cfg, seed: ArithTask(cfg, seed)
    plugin.broken = lambda cfg, seed: object()
    monkeypatch.setitem(sys.modules, "fake_task_plugin", plugin)
    source = build_prompt_source(DataConfig(task="fake_task_plugin:make"), seed=0)
    assert source.train_prompt(0).messages == build_prompt_source(DataConfig(), 0).train_prompt(0).messages
    with pytest.raises(TypeError, match="must return a PromptSource"):
        build_prompt_source(DataConfig(task="fake_task_plugin:broken"), seed=0)


def test_unknown_task_lists_registered():
    with pytest.raises(KeyError, match=r"registered: arith, calc, letters, lookup, pyexec"):
        build_prompt_source(DataConfig(task="nope"), seed=0)


def test_negative_position_rejected(arith0):
    with pytest.raises(ValueError, match="position"):
        arith0.train_prompt(-1)


# ------------------------------------------------------------------------------- arith split by fact


def fact(prompt):
    """The fact a prompt asks about, computed here from its info: + and * commute, - has a >= b."""
    a, b, op = prompt.info["a"], prompt.info["b"], prompt.info["op"]
    return (max(a, b), min(a, b), op)


@pytest.fixture(scope="module")
def by_fact():
    return build_prompt_source(DataConfig(split="fact"), seed=0)


def test_prompt_split_says_it_is_by_prompt_text(arith0):
    assert arith0.split_summary() == (
        "task arith (1-digit operands, ops + -) -> 512 held-out prompts, split by prompt text "
        '(data.split="prompt"; a held-out problem may be trained under another phrasing)'
    )
    # what "by prompt text" means: almost every held-out fact is also trained under another phrasing
    held_facts = {fact(p) for p in arith0.eval_prompts(512)}
    trained = {fact(arith0.train_prompt(i)) for i in range(5000)}
    assert len(held_facts & trained) >= 0.9 * len(held_facts)


def test_fact_split_one_digit_holds_out_a_fifth_of_each_operator(by_fact):
    held = by_fact.eval_prompts(by_fact.num_eval)
    facts = {fact(p) for p in held}
    # one-digit facts: 10 * 11 / 2 = 55 pairs a >= b per operator; round(0.2 * 55) = 11 held out of each
    assert sum(f[2] == "+" for f in facts) == 11 and sum(f[2] == "-" for f in facts) == 11
    assert len({fact(p) for p in held[:22]}) == 22  # one phrasing of every held-out fact comes first
    # the split holds every text of those facts: each phrasing, and both operand orders of a sum
    expected = {t.format(a=a, b=b, op=op) for a in range(10) for b in range(10) for op in "+-"
                for t in arith_phrasings(op) if (max(a, b), min(a, b), op) in facts and (op == "+" or a >= b)}
    assert set(texts(held)) == expected and len(held) == len(expected) == by_fact.num_eval
    for prompt in held:
        check_arith(prompt, digits=1)
    assert by_fact.split_summary() == (
        f"task arith (1-digit operands, ops + -) -> {len(expected)} held-out prompts, split by fact "
        '(data.split="fact": 22 of 110 facts held out, never trained under any phrasing or operand order)'
    )


def test_fact_split_training_never_sees_a_held_out_fact(by_fact):
    held_facts = {fact(p) for p in by_fact.eval_prompts(by_fact.num_eval)}
    train = [by_fact.train_prompt(i) for i in range(5000)]
    trained = {fact(p) for p in train}
    raw = {(p.info["a"], p.info["b"], p.info["op"]) for p in train}
    assert not trained & held_facts
    assert not raw & {(a, b, op) for a, b, op in held_facts} and not raw & {(b, a, op) for a, b, op in held_facts}
    assert len(trained) == 110 - 22  # every other fact is trained
    for prompt in train[:300]:
        check_arith(prompt, digits=1)


def test_fact_split_is_the_same_for_every_seed_and_every_ops(by_fact):
    other_seed = build_prompt_source(DataConfig(split="fact"), seed=7)
    assert texts(other_seed.eval_prompts(other_seed.num_eval)) == texts(by_fact.eval_prompts(by_fact.num_eval))
    assert train_texts(other_seed, 50) != train_texts(by_fact, 50)  # training order still follows the seed
    plus_only = build_prompt_source(DataConfig(split="fact", ops=["+"]), seed=0)
    plus_facts = {fact(p) for p in plus_only.eval_prompts(plus_only.num_eval)}
    assert plus_facts == {f for f in map(fact, by_fact.eval_prompts(by_fact.num_eval)) if f[2] == "+"}


def test_fact_split_two_digits():
    source = build_prompt_source(DataConfig(split="fact", digits=2, ops=["+", "-", "*"]), seed=3)
    held = source.eval_prompts(512)
    assert source.num_eval == 512 and len({fact(p) for p in held}) == 512  # 3 * 1010 held-out facts to pick from
    train = [source.train_prompt(i) for i in range(5000)]
    assert not {fact(p) for p in train} & {fact(p) for p in held}
    held_facts = source._held_facts  # all of them, not only the 512 in the eval split
    assert len(held_facts) == 3 * 1010  # two-digit facts: 100 * 101 / 2 = 5050 per operator, a fifth held out
    assert not {fact(p) for p in train} & held_facts
    for prompt in held[:100] + train[:100]:
        check_arith(prompt, digits=2)


def test_fact_split_many_digits_by_score():
    source = build_prompt_source(DataConfig(split="fact", digits=4, eval_size=64), seed=0)
    held = source.eval_prompts(64)
    assert len(set(texts(held))) == 64
    assert all(fact_score(fact(p)) < 0.2 for p in held)
    train = [source.train_prompt(i) for i in range(2000)]
    assert all(fact_score(fact(p)) >= 0.2 for p in train)
    for prompt in held + train[:100]:
        check_arith(prompt, digits=4)


def test_fact_split_only_for_arith(monkeypatch):
    with pytest.raises(ValueError) as err:
        build_prompt_source(DataConfig(task="letters", split="fact"), seed=0)
    assert str(err.value).startswith('data.split = "fact" is not available for task \'letters\' (it has: prompt)')
    plugin = types.ModuleType("fact_plugin")
    plugin.make = lambda cfg, seed: LettersTask(DataConfig(task="letters"), seed)  # ignores data.split
    monkeypatch.setitem(sys.modules, "fact_plugin", plugin)
    with pytest.raises(ValueError, match=r'data\.split = "fact" is not available for task \'fact_plugin:make\''):
        build_prompt_source(DataConfig(task="fact_plugin:make", split="fact"), seed=0)
    assert build_prompt_source(DataConfig(task="fact_plugin:make"), seed=0).name == "letters"


def test_fact_split_smaller_eval_size_takes_distinct_facts_first():
    source = build_prompt_source(DataConfig(split="fact", eval_size=10), seed=0)
    held = source.eval_prompts(10)
    assert source.num_eval == 10 and len({fact(p) for p in held}) == 10
    with pytest.raises(ValueError, match="held-out split has 10"):
        source.eval_prompts(11)
