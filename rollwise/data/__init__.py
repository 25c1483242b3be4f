"""Prompt sources (built-in tasks and datasets: files, dataset folders, hub dataset ids) and prompt encoding.

    source = build_prompt_source(cfg.data, seed)     # PromptSource
    prompt = source.train_prompt(position)           # deterministic in (seed, position)
    held_out = source.eval_prompts(n)                # fixed split, same for every training seed
    ids = PromptEncoder(tokenizer, system_prompt, max_prompt_tokens).encode(prompt)   # None = dropped
"""

from rollwise.data.files import DatasetError, FileDataset, load_prompts
from rollwise.data.prompts import PromptEncoder, encode_prompt, render_prompt
from rollwise.data.sources import build_prompt_source
from rollwise.data.tasks import TASKS, ArithTask, LettersTask, ProceduralTask, PromptSource, load_words

__all__ = [
    "TASKS",
    "ArithTask",
    "DatasetError",
    "FileDataset",
    "LettersTask",
    "ProceduralTask",
    "PromptEncoder",
    "PromptSource",
    "build_prompt_source",
    "encode_prompt",
    "load_prompts",
    "load_words",
    "render_prompt",
]
