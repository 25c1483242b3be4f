"""File datasets (JSONL, Parquet, HF directories) and prompt encoding with the chat template."""

from __future__ import annotations

import json

import pytest
from helpers_tokenizer import DEFAULT_SYSTEM, tiny_tokenizer

from rollwise.config import DataConfig
from rollwise.data import DatasetError, FileDataset, PromptEncoder, build_prompt_source, encode_prompt
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
    assert {source.train_prompt(i).answer for i in range(9)} | {source.eval_prompts(1)[0].answer} == {
        str(i) for i in range(10)
    }


def test_eval_slice_is_fixed_and_held_out(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, b = dataset(path, seed=0), dataset(path, seed=7)
    held_out = [p.uid for p in a.eval_prompts(5)]  # min(512, 50 // 10) = 5
    assert held_out == [p.uid for p in b.eval_prompts(5)]
    with pytest.raises(ValueError, match="held-out split has 5"):
        a.eval_prompts(6)
    train_uids = {a.train_prompt(i).uid for i in range(45 * 3)}
    assert len(train_uids) == 45 and not train_uids & set(held_out)


def test_training_order_is_a_seeded_permutation_per_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(50))
    a, again, other = dataset(path, seed=0), dataset(path, seed=0), dataset(path, seed=1)
    epoch0, epoch1 = train_texts(a, 45), [a.train_prompt(45 + i).messages[0]["content"] for i in range(45)]
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 45
    assert epoch0 != epoch1
    assert train_texts(a, 90) == train_texts(again, 90)
    assert train_texts(a, 45) != train_texts(other, 45)
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
    with pytest.raises(DatasetError, match=r"one\.jsonl: 1 row; need at least 2"):
        dataset(write_jsonl(tmp_path / "one.jsonl", rows(1)))
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin\.jsonl: not UTF-8"):
        dataset(tmp_path / "latin.jsonl")


def test_two_rows_hold_out_one(tmp_path):
    source = dataset(write_jsonl(tmp_path / "two.jsonl", rows(2)))
    assert len(source.eval_prompts(1)) == 1 and source.num_train == 1


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
    found = {p.source: p for p in source.eval_prompts(2) + [source.train_prompt(i) for i in range(18)]}
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


def test_hf_directory_rows_and_errors(tmp_path):
    import datasets

    datasets.Dataset.from_list(rows(10)).save_to_disk(str(tmp_path / "hf"))
    source = dataset(tmp_path / "hf")
    assert source.eval_prompts(1)[0].source.startswith("hf:row ")
    assert source.num_train == 9
    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]).save_to_disk(
        str(tmp_path / "hf_bad")
    )
    with pytest.raises(DatasetError, match=r"hf_bad, row 1: field 'prompt' is an empty string"):
        dataset(tmp_path / "hf_bad")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DatasetError, match=r"plain_dir: not a datasets.save_to_disk directory"):
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


def test_encode_without_chat_template_fails_clearly(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(user("hi"), bare, None)
