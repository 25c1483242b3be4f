"""Which prompt source a run reads: a mixture of `[[data.mix]]` sources, the dataset of `data.path` (a file, a
dataset folder or a hub dataset id), else the task `data.task` (built-in, 'reasoning_gym:<dataset>' or a plugin).

    source = build_prompt_source(cfg.data, seed)   # MixtureSource, FileDataset or the task's PromptSource

Above both kinds: `rollwise.data.files` and `rollwise.data.tasks` do not import each other's sources.
"""

from __future__ import annotations

from rollwise.config import DataConfig
from rollwise.data.files import FileDataset
from rollwise.data.mix import MixtureSource
from rollwise.data.tasks import PromptSource, check_split, task_factory


def build_prompt_source(cfg: DataConfig, seed: int) -> PromptSource:
    """The mixture of `cfg.mix` when it has tables (each built by this function), else the file dataset at
    `cfg.path` when set, else the task `cfg.task` (built-in, 'reasoning_gym:<dataset>' or 'pkg.mod:factory').

    `data.split` other than "prompt" needs a source that declares it in `splits` (the built-in arith task; a
    plugin task that implements it sets `splits = ("prompt", "fact")`); any other fails here with a line
    naming `data.split`. Optional source attributes used by the run: `num_eval` (held-out split size, to cap
    `eval.n`) and `split_summary()` (the start-of-run data line).
    """
    if cfg.mix:
        return MixtureSource(cfg, seed, build_prompt_source)
    if cfg.path is not None:
        return FileDataset(cfg, seed)
    factory = task_factory(cfg.task)
    source = factory(cfg, seed)
    missing = [a for a in ("name", "default_reward", "train_prompt", "eval_prompts") if not hasattr(source, a)]
    if missing:
        raise TypeError(
            f"task {cfg.task!r} returned {type(source).__name__}, which lacks {', '.join(missing)}; "
            f"a task factory must return a PromptSource (name, default_reward, train_prompt, eval_prompts)"
        )
    check_split(cfg.split, cfg.task, tuple(getattr(source, "splits", ("prompt",))))
    return source
