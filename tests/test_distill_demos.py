"""SFT demonstrations: reading files (and every bad-row message), demo Samples and the seeded DemoSource order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_tokenizer import CHAT_TEMPLATE, tiny_tokenizer

from rollwise.config import DataConfig
from rollwise.data import DatasetError, PromptEncoder
from rollwise.distill.demos import DemoSource, Demonstration, demo_sample, load_demonstrations
from rollwise.types import Prompt, Status

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def write_jsonl(path, rows):
    """Rows are dicts (dumped) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def demo(response="The answer is 10.", content="What is 7 + 3?"):
    return Demonstration(Prompt(uid=content, messages=[{"role": "user", "content": content}]), response)


def test_jsonl_rows_become_demonstrations(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "What is 1 + 1?", "response": "2", "answer": 2, "level": "easy"}),
        "",
        json.dumps({"prompt": CHAT, "response": "4"}),
    ])
    first, second = load_demonstrations(path)
    assert first.prompt.messages == [{"role": "user", "content": "What is 1 + 1?"}] and first.response == "2"
    assert first.prompt.answer == "2" and first.prompt.info == {"level": "easy"}
    assert first.prompt.source == "d.jsonl:line 1" and second.prompt.source == "d.jsonl:line 3"
    assert second.prompt.messages == CHAT and second.prompt.answer is None


def test_parquet_rows_with_custom_field_names(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["q0", "q1"], "solution": ["s0", "s1"]}), path)
    demos = load_demonstrations(path, prompt_field="question", response_field="solution", cfg=DataConfig())
    assert [(d.prompt.messages[0]["content"], d.response, d.prompt.source) for d in demos] == [
        ("q0", "s0", "d.parquet:row 0"), ("q1", "s1", "d.parquet:row 1")
    ]


@pytest.mark.parametrize("row, key, words", [
    ({"prompt": "hi"}, "'response'", "missing field"),
    ({"response": "hi"}, "'prompt'", "missing field"),
    ({"prompt": "hi", "response": 3}, "'response'", "is int"),
    ({"prompt": "hi", "response": "  "}, "'response'", "is empty"),
    ({"prompt": 5, "response": "ok"}, "'prompt'", "is int"),
    ({"prompt": [{"role": "bot", "content": "x"}], "response": "ok"}, "'prompt'[0].role", "expected one of"),
])
def test_bad_row_names_file_line_and_key(tmp_path, row, key, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "response": "fine"}, row])
    with pytest.raises(DatasetError) as err:
        load_demonstrations(path)
    message = str(err.value)
    assert "bad.jsonl, line 2" in message and key in message and words in message and "\n" not in message


def test_bad_parquet_row_names_row_index(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["ok", ""]}), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet, row 1: field 'response' is empty"):
        load_demonstrations(path)


def test_empty_unreadable_and_missing_files(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match=r"empty\.jsonl: demonstrations file is empty"):
        load_demonstrations(empty)
    broken = write_jsonl(tmp_path / "broken.jsonl", ['{"prompt": "a", "response": "b"}', "{not json"])
    with pytest.raises(DatasetError, match=r"broken\.jsonl, line 2: not valid JSON"):
        load_demonstrations(broken)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DatasetError, match=r"junk\.parquet: cannot read Parquet"):
        load_demonstrations(tmp_path / "junk.parquet")
    with pytest.raises(DatasetError, match=r"not found: .*nothing\.jsonl"):
        load_demonstrations(tmp_path / "nothing.jsonl")
    (tmp_path / "d.csv").write_text("prompt,response\n")
    with pytest.raises(DatasetError, match=r"d\.csv: unsupported demonstrations format '\.csv'"):
        load_demonstrations(tmp_path / "d.csv")


def test_response_ids_are_the_assistant_turn_with_its_end_of_turn():
    tok = tiny_tokenizer()
    encoder = PromptEncoder(tok, system_prompt="Be brief.")
    sample = demo_sample(demo(), encoder, tok, max_response_tokens=64, group_id=7)
    assert tok.decode(sample.prompt_ids).endswith("Be brief.<|im_end|>\n<|im_start|>user\nWhat is 7 + 3?"
                                                  "<|im_end|>\n<|im_start|>assistant\n")
    # the turn ends at its end-of-turn token (what the template writes after it is never generated, nor trained)
    assert tok.decode(sample.response_ids) == "The answer is 10.<|im_end|>"
    assert sample.response_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    n = len(sample.response_ids)
    assert sample.status == Status.COMPLETED and sample.group_id == 7 and sample.reward is None
    assert sample.loss_mask == [1] * n and sample.behaviour_logprobs == sample.full_logprobs == [0.0] * n
    assert sample.info == {"demo": True} and sample.response_text == "The answer is 10."


def test_long_response_is_truncated_and_long_prompt_dropped():
    tok = tiny_tokenizer()
    full = demo_sample(demo(), PromptEncoder(tok), tok, max_response_tokens=64, group_id=0).response_ids
    cut = demo_sample(demo(), PromptEncoder(tok), tok, max_response_tokens=3, group_id=0)
    assert cut.response_ids == full[:3] and cut.status == Status.TRUNCATED and len(cut.loss_mask) == 3
    exact = demo_sample(demo(), PromptEncoder(tok), tok, max_response_tokens=len(full), group_id=0)
    assert exact.status == Status.COMPLETED and exact.response_ids == full
    encoder = PromptEncoder(tok, max_prompt_tokens=4)
    assert demo_sample(demo(), encoder, tok, 64, 0) is None and encoder.dropped == 1


def test_template_that_renders_the_prompt_differently_is_refused():
    tok = tiny_tokenizer()
    # the generation header says "assistant" but a written assistant turn says "bot": no common prefix
    tok.chat_template = CHAT_TEMPLATE.replace(
        "'<|im_start|>' + message['role']",
        "'<|im_start|>' + ('bot' if message['role'] == 'assistant' else message['role'])",
    )
    with pytest.raises(ValueError, match=r"'q:1'.*does not start with the prompt's ids.*fix the template"):
        demo_sample(Demonstration(Prompt("u", [{"role": "user", "content": "hi"}], source="q:1"), "ok"),
                    PromptEncoder(tok), tok, 64, 0)


def test_demo_source_order_is_seeded_resumable_and_wraps_epochs():
    demos = [demo(response=f"r{i}") for i in range(5)]
    a, again, other = DemoSource(demos, seed=0), DemoSource(demos, seed=0), DemoSource(demos, seed=1)
    epoch0, epoch1 = [d.response for d in a.batch(0, 5)], [d.response for d in a.batch(5, 5)]
    assert sorted(epoch0) == sorted(epoch1) == [f"r{i}" for i in range(5)]
    assert [d.response for d in a.batch(0, 40)] != [d.response for d in other.batch(0, 40)]
    assert [d.response for d in a.batch(0, 40)][5:] != [d.response for d in a.batch(0, 40)][:35]  # not one cycle
    straddle = [d.response for d in again.batch(3, 4)]  # a fresh source resumed mid-epoch, across the wrap
    assert straddle == epoch0[3:] + epoch1[:2]
    assert again.batch(2, 0) == []
    with pytest.raises(ValueError, match="position must be >= 0"):
        a.batch(-1, 2)
    with pytest.raises(ValueError, match="at least one demonstration"):
        DemoSource([], seed=0)
