"""File datasets (JSONL, Parquet, HF directories) and prompt encoding with the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_tokenizer import DEFAULT_SYSTEM, tiny_tokenizer

from rollwise.validate import load
from rollwise.config import DataConfig
from rollwise.data import DatasetError, FileDataset, PromptEncoder, build_prompt_source, encode_prompt
from rollwise.session import encode_eval_prompts
from rollwise.types import Prompt


def write_jsonl(path, rows):
    """Rows are dicts (dumped) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n):
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "id": i} for i in range(n)]


def dataset(path, seed=0, **kw):
    return build_prompt_source(DataConfig(path=str(path), **kw), seed)


def train_texts(source, n):
    return [source.train_prompt(i).messages[-1]["content"] for i in range(n)]


# ------------------------------------------------------------------------------------------- JSONL


def test_jsonl_rows_become_prompts(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "data.jsonl",
        ["", json.dumps({"prompt": "What is 1 + 1?", "answer": 2, "level": "easy"}), "   ",
         json.dumps({"prompt": chat, "answer": "4"})] + [json.dumps(r) for r in rows(20)],
    )
    source = FileDataset(DataConfig(path=str(path), eval_size=1), seed=0)
    everything = {p.source: p for p in source.eval_prompts(1) + [source.train_prompt(i) for i in range(21)]}
    first, second = everything["data.jsonl:line 2"], everything["data.jsonl:line 4"]
    assert first.messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert first.answer == "2" and first.info == {"level": "easy"}
    assert second.messages == chat and second.answer == "4"
    assert len(everything) == 22 and source.default_reward == "math"


def test_custom_field_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "solution": i} for i in range(10)])
    source = dataset(path, prompt_field="question", answer_field="solution")
    held_out = source.eval_prompts(2)  # 10 // 4 = 2 rows held out
    assert {source.train_prompt(i).answer for i in range(8)} | {p.answer for p in held_out} == {
        str(i) for i in range(10)
    }


def test_eval_slice_is_fixed_and_held_out(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, b = dataset(path, seed=0), dataset(path, seed=7)
    held_out = [p.uid for p in a.eval_prompts(12)]  # min(512, 50 // 4) = 12
    assert held_out == [p.uid for p in b.eval_prompts(12)]
    with pytest.raises(ValueError, match="held-out split has 12"):
        a.eval_prompts(13)
    train_uids = {a.train_prompt(i).uid for i in range(38 * 3)}
    assert len(train_uids) == 38 and not train_uids & set(held_out)


def test_training_order_is_a_seeded_permutation_per_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, again, other = dataset(path, seed=0), dataset(path, seed=0), dataset(path, seed=1)
    epoch0, epoch1 = train_texts(a, 38), [a.train_prompt(38 + i).messages[0]["content"] for i in range(38)]
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 38
    assert epoch0 != epoch1
    assert train_texts(a, 76) == train_texts(again, 76)
    assert train_texts(a, 38) != train_texts(other, 38)
    assert a.train_prompt(200).uid == again.train_prompt(200).uid  # random access


def test_eval_path_and_overlap_removed(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(12))
    held = write_jsonl(tmp_path / "held.jsonl", rows(3))  # same prompts as the first 3 training rows
    source = dataset(train, eval_path=str(held))
    assert [p.source for p in source.eval_prompts(3)] == ["held.jsonl:line 1", "held.jsonl:line 2", "held.jsonl:line 3"]
    assert source.num_train == 9 and source.dropped_overlap == 3


@pytest.mark.parametrize(
    "lines, where, expected",
    [
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", answer: 2}'], "line 2", "not valid JSON"),
        (['{"prompt": "a", "answer": "1"}', "", '{"answer": "2"}'], "line 3", "missing field 'prompt'"),
        (['{"prompt": "a"}'], "line 1", "missing field 'answer'"),
        (['{"prompt": 5, "answer": "1"}'], "line 1", "field 'prompt' is int; expected a string or a non-empty list"),
        (['{"prompt": "a", "answer": [1]}'], "line 1", "field 'answer' is list; expected a string or a number"),
        (['{"prompt": "a", "answer": null}'], "line 1", "field 'answer' is null"),
        (
            ['{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}'],
            "line 1",
            "'prompt'[0].role is 'bot'; expected one of system, user, assistant",
        ),
        (
            ['{"prompt": [{"role": "user", "content": 3}], "answer": "1"}'],
            "line 1",
            "'prompt'[0].content is int; expected a string",
        ),
        (['{"prompt": ["hi"], "answer": "1"}'], "line 1", "'prompt'[0] is str; expected a message object"),
        (['{"prompt": [], "answer": "1"}'], "line 1", "non-empty list"),
        (["[1, 2]"], "line 1", "row is list; expected an object"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, lines, where, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError) as err:
        dataset(path)
    assert str(path) in str(err.value) and where in str(err.value) and expected in str(err.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="dataset not found: .*nope.jsonl"):
        dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match=r"bad\.csv: unsupported dataset format '\.csv'; expected one of \.jsonl"):
        (tmp_path / "bad.csv").write_text("prompt,answer\n")
        dataset(tmp_path / "bad.csv")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset is empty"):
        dataset(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin\.jsonl: not UTF-8"):
        dataset(tmp_path / "latin.jsonl")




# ------------------------------------------------------------------------------------ Parquet and HF


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_parquet_rows_and_errors(tmp_path):
    chat = [{"role": "user", "content": "3+3?"}]
    others = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(19)]
    records = [{"prompt": chat, "answer": "6"}, *others]
    source = dataset(write_parquet(tmp_path / "d.parquet", records))
    found = {p.source: p for p in source.eval_prompts(5) + [source.train_prompt(i) for i in range(15)]}
    assert found["d.parquet:row 0"].messages == chat and found["d.parquet:row 0"].answer == "6"
    bad = [{"prompt": "ok", "answer": "1"}, {"prompt": "ok", "answer": None}]
    expected = r"bad\.parquet, row 1: field 'answer' is null; expected a string or a number"
    with pytest.raises(DatasetError, match=expected):
        dataset(write_parquet(tmp_path / "bad.parquet", bad))
    expected = r"cols\.parquet, row 0: missing field 'prompt' \(row has: question, answer\)"
    with pytest.raises(DatasetError, match=expected):
        dataset(write_parquet(tmp_path / "cols.parquet", [{"question": "q", "answer": "1"}]))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet: cannot read Parquet"):
        dataset(tmp_path / "junk.parquet")


def test_hf_directory_rows_and_errors(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))  # a folder is read by load_dataset

    datasets.Dataset.from_list(rows(10)).save_to_disk(str(tmp_path / "hf"))
    source = dataset(tmp_path / "hf")
    assert source.eval_prompts(1)[0].source.startswith("hf:row ")
    assert source.num_train == 8 and source.num_eval == 2
    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]).save_to_disk(
        str(tmp_path / "hf_bad")
    )
    with pytest.raises(DatasetError, match=r"hf_bad, row 1: field 'prompt' is an empty string"):
        dataset(tmp_path / "hf_bad")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(8)), "test": datasets.Dataset.from_list(
        [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(3)])}).save_to_disk(str(tmp_path / "dd"))
    splits = dataset(tmp_path / "dd", eval_split_name="test")
    assert (splits.num_train, splits.num_eval) == (8, 3) and splits.eval_prompts(1)[0].source == "dd[test]:row 0"
    with pytest.raises(DatasetError, match=r"^data.split_name = 'dev' is not a split of the DatasetDict .*dd; "
                                           r"splits: train, test$"):
        dataset(tmp_path / "dd", split_name="dev")
    with pytest.raises(DatasetError, match=r"^data.eval_split_name = 'test': .*hf is a single datasets.Dataset"):
        dataset(tmp_path / "hf", eval_split_name="test")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DatasetError, match=r"plain_dir: no data files that datasets can read; expected a "
                                           r"datasets.save_to_disk directory or Parquet / JSONL / CSV files"):
        dataset(tmp_path / "plain_dir")


# ---------------------------------------------------------------------------------- prompt encoding


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def user(text, uid="u1"):
    return Prompt(uid=uid, messages=[{"role": "user", "content": text}], answer="1", source="test")


def decode(tokenizer, ids):
    return tokenizer.decode(ids)


def test_encode_uses_template_default_system_when_none(tokenizer):
    ids = encode_prompt(user("What is 7 + 3?"), tokenizer, system_prompt=None)
    assert all(isinstance(i, int) for i in ids)
    assert decode(tokenizer, ids) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 7 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_encode_prepends_system_prompt_unless_chat_has_one(tokenizer):
    ids = encode_prompt(user("hi"), tokenizer, system_prompt="Answer with a number.")
    expected = "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nhi"
    assert decode(tokenizer, ids).startswith(expected)
    own = Prompt(uid="s", messages=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}])
    kept = decode(tokenizer, encode_prompt(own, tokenizer, "Answer with a number."))
    assert kept.startswith("<|im_start|>system\nMine.")
    assert own.messages[0]["content"] == "Mine." and len(own.messages) == 2  # not mutated


def test_encoder_drops_long_prompts_and_counts(tokenizer):
    short, long = user("What is 7 + 3?", "short"), user("the and that " * 40, "long")
    limit = len(encode_prompt(short, tokenizer, None))
    encoder = PromptEncoder(tokenizer, system_prompt=None, max_prompt_tokens=limit)
    assert encoder.encode(short) == encode_prompt(short, tokenizer, None)
    assert encoder.encode(long) is None and encoder.encode(long) is None
    assert encoder.dropped == 2 and encoder.metrics() == {"data/prompts_dropped_too_long": 2.0}
    assert PromptEncoder(tokenizer, max_prompt_tokens=limit - 1).encode(short) is None


def test_encoder_caches_by_uid_and_returns_fresh_lists(tokenizer):
    encoder = PromptEncoder(tokenizer, system_prompt="S", max_prompt_tokens=256, cache_size=2)
    first = encoder.encode(user("What is 1 + 1?", "a"))
    first.append(-1)
    assert encoder.encode(user("What is 1 + 1?", "a")) == first[:-1]
    assert encoder.encode(user("different text, same uid", "a")) == first[:-1]  # cached by uid
    for uid in "bcd":
        encoder.encode(user(f"q {uid}", uid))
    assert len(encoder._cache) == 2


def test_encode_without_chat_template_is_the_plain_text(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None  # a base model: the messages one per line (tests/test_chat_templates.py)
    assert decode(bare, encode_prompt(user("hi"), bare, "Answer with a number.")) == "Answer with a number.\nhi\n"


# ------------------------------------------------------------------ held-out sizing and the data line

QUICKSTART = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.toml"


def quickstart_data(path, *overrides):
    """The default recipe with `data.path` set: its eval settings (eval.n = 200, data.eval_size = 512)."""
    return load(QUICKSTART, [f'data.path="{path}"', *overrides])


def eval_set(cfg, tokenizer, to_stdout=True):
    source = build_prompt_source(cfg.data, cfg.train.seed)
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    return source, encode_eval_prompts(source, encoder, cfg.eval.n, to_stdout=to_stdout)


def test_64_row_file_with_the_default_recipe_just_works(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "my.jsonl", rows(64))
    cfg = quickstart_data(path)
    assert cfg.eval.n == 200 and cfg.data.eval_size == 512  # what a user of the default recipe gets
    source, held_out = eval_set(cfg, tokenizer)
    # min(eval_size 512, 64 // 4) = 16 held out, the other 48 train; eval.n = 200 is capped at the 16
    assert capsys.readouterr().out.splitlines() == [
        "rollwise: data: 64 rows in my.jsonl -> 48 train, 16 held-out "
        "(data.eval_size=512 capped at a quarter of the rows); eval.n=200 -> 16"
    ]
    held_uids = [p.uid for p, _ in held_out]
    train_uids = {source.train_prompt(i).uid for i in range(48)}  # one epoch
    assert len(set(held_uids)) == 16 and len(train_uids) == 48
    assert not train_uids & set(held_uids)
    assert train_uids | set(held_uids) == {f"{path}#{n}" for n in range(1, 65)}  # every row used once
    assert {source.train_prompt(i).uid for i in range(48, 96)} == train_uids  # epoch 2: same rows


def test_data_line_goes_to_stderr_by_default_and_names_the_cap(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "big.jsonl", rows(2400))
    _, held_out = eval_set(quickstart_data(path, "eval.n=600"), tokenizer, to_stdout=False)
    out, err = capsys.readouterr()
    assert out == "" and len(held_out) == 512
    assert err == "rollwise: data: 2400 rows in big.jsonl -> 1888 train, 512 held-out (data.eval_size); " \
                  "eval.n=600 -> 512\n"


def test_eval_path_is_used_whole_and_training_is_the_whole_file(tmp_path, tokenizer, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", rows(64))
    others = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(30)]
    held = write_jsonl(tmp_path / "held.jsonl", others)
    cfg = quickstart_data(train, f'data.eval_path="{held}"', "data.eval_size=10")  # eval_size does not apply
    source, held_out = eval_set(cfg, tokenizer)
    assert [p.source for p, _ in held_out] == [f"held.jsonl:line {n}" for n in range(1, 31)]
    assert source.num_train == 64 and {source.train_prompt(i).uid for i in range(64)} == {
        f"{train}#{n}" for n in range(1, 65)
    }
    assert capsys.readouterr().out == (
        "rollwise: data: 64 rows in train.jsonl -> 64 train, 30 held-out = all of held.jsonl (data.eval_path); "
        "eval.n=200 -> 30\n"
    )
    cfg.eval.n = 20
    eval_set(cfg, tokenizer)
    assert capsys.readouterr().out.endswith("(data.eval_path); eval.n=20\n")  # not capped: no arrow


@pytest.mark.parametrize("n_rows", [1, 3])
def test_under_four_rows_trains_on_all_and_needs_eval_off(tmp_path, tokenizer, capsys, n_rows):
    path = write_jsonl(tmp_path / "tiny.jsonl", rows(n_rows))
    cfg = quickstart_data(path)
    source = build_prompt_source(cfg.data, cfg.train.seed)
    assert source.num_train == n_rows and source.num_eval == 0
    assert {source.train_prompt(i).uid for i in range(3 * n_rows)} == {f"{path}#{n}" for n in range(1, n_rows + 1)}
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    with pytest.raises(ValueError) as err:
        encode_eval_prompts(source, encoder, cfg.eval.n)
    message = str(err.value)
    assert "\n" not in message and str(path.name) in message and f"{n_rows} train, 0 held-out" in message
    assert "eval.n=200 needs held-out prompts" in message and "data.eval_path" in message and "eval.n = 0" in message
    assert encode_eval_prompts(source, encoder, 0, to_stdout=True) == []
    assert capsys.readouterr().out == (
        f"rollwise: data: {n_rows} rows in tiny.jsonl -> {n_rows} train, 0 held-out (under 4 rows: none held out; "
        "give data.eval_path to evaluate); eval.n=0: evaluation off\n"
    )


def test_four_rows_hold_out_one(tmp_path):
    source = dataset(write_jsonl(tmp_path / "four.jsonl", rows(4)))
    assert source.num_eval == 1 and source.num_train == 3


def test_empty_file_and_bad_rows_fail_before_the_split(tmp_path):
    with pytest.raises(DatasetError) as err:
        dataset(write_jsonl(tmp_path / "empty.jsonl", []))
    assert str(err.value) == f"{tmp_path / 'empty.jsonl'}: dataset is empty (no rows)"
    lines = [json.dumps(r) for r in rows(63)] + ['{"prompt": "What is 1 + 1?"}']
    with pytest.raises(DatasetError) as err:
        dataset(write_jsonl(tmp_path / "my.jsonl", lines))
    assert str(err.value).startswith(f"{tmp_path / 'my.jsonl'}, line 64: missing field 'answer' (row has: prompt)")


def test_eval_prompts_over_the_prompt_limit_are_counted_or_fail(tmp_path, tokenizer, capsys):
    short = rows(60)
    long = [{"prompt": "the and that " * 40 + f"{i}", "answer": "1"} for i in range(4)]
    path = write_jsonl(tmp_path / "mixed.jsonl", short + long)
    cfg = quickstart_data(path)
    source = build_prompt_source(cfg.data, 0)
    n_long_held = sum("the and that" in p.messages[0]["content"] for p in source.eval_prompts(16))
    assert n_long_held == 2  # the fixed eval seed holds out two of the four long rows
    limit = max(len(encode_prompt(p, tokenizer, cfg.data.system_prompt)) for p in source.eval_prompts(16)
                if "the and that" not in p.messages[0]["content"])
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, max_prompt_tokens=limit)
    held_out = encode_eval_prompts(source, encoder, 200, to_stdout=True)
    assert len(held_out) == 16 - n_long_held and encoder.dropped == 0  # eval drops do not count as training drops
    assert capsys.readouterr().out.endswith(
        f"eval.n=200 -> 16 (2 over data.max_prompt_tokens={limit} left out: 14 used)\n")
    with pytest.raises(ValueError, match=r"all 16 held-out prompts are longer than data\.max_prompt_tokens=1; raise"):
        encode_eval_prompts(source, PromptEncoder(tokenizer, None, max_prompt_tokens=1), 200)


def test_fact_split_with_a_file_fails_naming_data_split(tmp_path):
    path = write_jsonl(tmp_path / "my.jsonl", rows(64))
    with pytest.raises(DatasetError) as err:
        dataset(path, split="fact")
    message = str(err.value)
    assert message.startswith('data.split = "fact" applies only to the built-in arith task')
    assert str(path) in message and "\n" not in message


@pytest.mark.slow
def test_cli_trains_a_64_row_file_with_the_default_recipe(tmp_path, tiny_model_dir):
    """The issue's report, end to end: `rollwise train recipes/quickstart.toml data.path=my.jsonl` (eval.n = 200)
    on a 64-row file ran into "asked for 200 eval prompts but the held-out split has 6"; now it trains and
    evaluates on the 16 held-out rows. A real subprocess on the tiny model."""
    import subprocess

    from conftest import ROLLWISE, read_rows, subprocess_env, tiny_overrides

    path = write_jsonl(tmp_path / "my.jsonl", rows(64))
    overrides = tiny_overrides(tiny_model_dir, **{"eval.n": None, "data.eval_size": None, "data.path": str(path),
                                                   "train.steps": 1, "reward.fn": "toy_plugins:digit_fraction"})
    run_dir = tmp_path / "run"
    proc = subprocess.run([ROLLWISE, "train", str(QUICKSTART), "--run-dir", str(run_dir), *overrides],
                          capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data_lines = [line for line in proc.stdout.splitlines() if line.startswith("rollwise: data:")]
    assert data_lines == ["rollwise: data: 64 rows in my.jsonl -> 48 train, 16 held-out "
                          "(data.eval_size=512 capped at a quarter of the rows); eval.n=200 -> 16"]
    eval_rows = [r for r in read_rows(run_dir) if r["kind"] == "eval"]
    assert [r["eval/n"] for r in eval_rows] == [16.0, 16.0]  # at the start and at the end
