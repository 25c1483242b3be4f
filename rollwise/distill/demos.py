"""SFT demonstrations: (prompt, response) rows from a JSONL / Parquet file or HF directory, as trainable Samples.

    demos = load_demonstrations("demos.jsonl", cfg=cfg.data)      # list[Demonstration]; DatasetError on a bad row
    source = DemoSource(demos, seed)                              # seeded order per epoch, resumable from position
    sample = demo_sample(demo, encoder, tokenizer, max_response_tokens=256, group_id=0)   # None = prompt too long

The rows are read by `rollwise.data.files` (the same readers, row numbering and error style as prompt files).
The response ids are what the chat template writes for an assistant turn after the prompt, end-of-turn
token(s) included, so supervised fine-tuning (the NLL of the demonstration, as in InstructGPT's SFT stage,
Ouyang et al. 2022) teaches the model to stop where the template stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollwise.config import DataConfig
from rollwise.data.files import (SUFFIXES, DatasetError, EpochOrder, _jsonl_rows, _table_rows, _type_name, to_answer,
                                 to_messages)
from rollwise.data.prompts import PromptEncoder, render_chat, with_system
from rollwise.types import Prompt, Sample, Status


@dataclass
class Demonstration:
    """One demonstration: the prompt (a chat, like a data file's) and the response text to imitate."""

    prompt: Prompt
    response: str


def _rows(path: Path) -> tuple[Any, str]:
    """(iterable of (row number, row), unit word) through the prompt-file readers."""
    if not path.exists():
        raise DatasetError(f"demonstrations file not found: {path}; check the path")
    if path.is_dir() or path.suffix == ".parquet":
        return enumerate(_table_rows(path)), "row"
    if path.suffix == ".jsonl":
        return _jsonl_rows(path), "line"
    raise DatasetError(
        f"{path}: unsupported demonstrations format {path.suffix!r}; expected one of {', '.join(SUFFIXES)} "
        f"or a datasets.save_to_disk directory"
    )


def _row_to_demo(row: Any, where: str, n: int, path: Path, unit: str, fields: tuple[str, str], cfg: DataConfig):
    """One row -> Demonstration; `cfg.answer_field`, when present, becomes the prompt's answer."""
    prompt_field, response_field = fields
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: row is {_type_name(row)}; expected an object with fields")
    for key in fields:
        if key not in row:
            raise DatasetError(
                f"{where}: missing field {key!r} (row has: {', '.join(map(str, row)) or 'no fields'}); "
                f"set prompt_field / response_field to the right names"
            )
    response = row[response_field]
    if not isinstance(response, str):
        raise DatasetError(f"{where}: field {response_field!r} is {_type_name(response)}; expected the response text")
    if not response.strip():
        raise DatasetError(f"{where}: field {response_field!r} is empty; give a non-empty response or drop the row")
    messages = to_messages(row[prompt_field], where, prompt_field)
    answer = to_answer(row[cfg.answer_field], where, cfg.answer_field) if cfg.answer_field in row else None
    info = {k: v for k, v in row.items() if k not in (*fields, cfg.answer_field)}
    prompt = Prompt(uid=f"{path}#{n}", messages=messages, answer=answer, source=f"{path.name}:{unit} {n}", info=info)
    return Demonstration(prompt=prompt, response=response)


def load_demonstrations(
    path: str | Path, prompt_field: str = "prompt", response_field: str = "response", *, cfg: DataConfig | None = None
) -> list[Demonstration]:
    """All rows of a demonstrations file; DatasetError (file, line/row, field, fix) on the first bad one."""
    path, cfg = Path(path), cfg or DataConfig()
    rows, unit = _rows(path)
    fields = (prompt_field, response_field)
    demos = [_row_to_demo(row, f"{path}, {unit} {n}", n, path, unit, fields, cfg) for n, row in rows]
    if not demos:
        raise DatasetError(f"{path}: demonstrations file is empty (no rows); add prompt/response rows")
    return demos


def _response_ids(demo: Demonstration, prompt_ids: list[int], encoder: PromptEncoder, tokenizer: Any) -> list[int]:
    """Ids the template writes for the assistant turn: tokenize(prompt + assistant message) minus the prompt ids."""
    chat = [*with_system(demo.prompt.messages, encoder.system_prompt), {"role": "assistant", "content": demo.response}]
    text = render_chat(tokenizer, chat, generation_prompt=False)
    full_ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        at = next((i for i, (a, b) in enumerate(zip(full_ids, prompt_ids)) if a != b), len(full_ids))
        raise ValueError(
            f"demonstration {demo.prompt.source!r}: the chat with the assistant turn does not start with the "
            f"prompt's ids (they differ at token {at} of {len(prompt_ids)}); the chat template renders the "
            f"prompt differently when an assistant turn follows, so fix the template or the response's start"
        )
    return full_ids[len(prompt_ids):]


def demo_sample(
    demo: Demonstration, encoder: PromptEncoder, tokenizer: Any, max_response_tokens: int, group_id: int
) -> Sample | None:
    """The demonstration as a Sample to train on (loss mask all 1), or None when the prompt is too long.

    Response length R <= max_response_tokens; longer responses are cut (Status.TRUNCATED). The log-prob
    lists are zeros of length R: SFT computes its loss from the trainer's log-probs alone.
    """
    if max_response_tokens <= 0:
        raise ValueError(f"max_response_tokens must be > 0, got {max_response_tokens}")
    prompt_ids = encoder.encode(demo.prompt)
    if prompt_ids is None:
        return None
    ids = _response_ids(demo, prompt_ids, encoder, tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos in ids:  # what the template writes after end-of-turn is never generated: not trained either
        ids = ids[:ids.index(eos) + 1]
    status = Status.TRUNCATED if len(ids) > max_response_tokens else Status.COMPLETED
    ids = ids[:max_response_tokens]
    return Sample(
        prompt=demo.prompt,
        prompt_ids=prompt_ids,
        response_ids=ids,
        behaviour_logprobs=[0.0] * len(ids),
        full_logprobs=[0.0] * len(ids),
        loss_mask=[1] * len(ids),
        status=status,
        group_id=group_id,
        response_text=demo.response,
        reward=None,
        info={"demo": True},
    )


class DemoSource:
    """Demonstrations in a seeded permutation per epoch; `batch(position, n)` depends on (seed, position) alone."""

    def __init__(self, demos: list[Demonstration], seed: int) -> None:
        if not demos:
            raise ValueError("DemoSource needs at least one demonstration; load_demonstrations returned none")
        self.demos = list(demos)
        self.seed = seed
        self._order = EpochOrder(len(self.demos), f"demos-{self.seed}")

    def at(self, position: int) -> Demonstration:
        """Demonstration at `position` of the concatenated per-epoch permutations."""
        if position < 0:
            raise ValueError(f"demonstration position must be >= 0, got {position}")
        return self.demos[self._order.index(position)]

    def batch(self, position: int, n: int) -> list[Demonstration]:
        """Demonstrations at positions position .. position + n - 1 (an epoch boundary may fall inside)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        return [self.at(position + i) for i in range(n)]
