"""Task-aware defaults: a recipe's task-bound keys stay with the recipe's task (issue 31).

A recipe is tuned for one task: its system prompt asks for that task's answer format, its stop strings end that
task's replies, its `data.options` configure that task's generator. When the command line names another task (a
`data.task` other than the recipe's, or a `data.path` over a recipe that trains a built-in or plugin task; a
recipe's data file swapped for another file is the same kind of data and is read as written), those keys no
longer describe the task being trained:

1. every `TASK_BOUND_KEYS` entry the recipe set and the command line did not is dropped;
2. the new task's own defaults fill their place (`task_defaults`: the built-in tasks' answer-format prompts;
   a reasoning-gym task brings reasoning-gym's system prompt, see docs/tasks.md);
3. the settings the recipe tuned for its own task's learning (`NEW_TASK_SETTINGS`: learning rate, KL) are set to
   values that resist collapse onto the new task's most common answer, again unless the command line sets them;
4. the run says which keys were replaced (`rollwise train` prints one line, `--dry-run` too).

A key given on the command line always wins, and a recipe whose own task is the one trained is read as written.

    data, notes = switch_task(recipe_data, override_data)
"""

from __future__ import annotations

import copy
from typing import Any

ARITH_SYSTEM = "Solve the arithmetic problem. End your reply with: The answer is N."
LETTERS_SYSTEM = "Answer the question about the word. End your reply with: The answer is N."

# (section, key) pairs that describe one task: its prompt, its answer format, its generator, its data fields
TASK_BOUND_KEYS = (
    ("data", "system_prompt"), ("data", "options"), ("data", "digits"), ("data", "ops"), ("data", "split"),
    ("data", "prompt_field"), ("data", "answer_field"), ("data", "eval_path"), ("data", "config"),
    ("data", "split_name"), ("data", "eval_split_name"), ("data", "mix"), ("rollout", "stop"), ("reward", "fn"),
    ("eval", "max_new_tokens"),
)

# The built-in tasks' own defaults (a task not named here has none: the config's defaults apply)
TASK_DEFAULTS: dict[str, dict[tuple[str, str], Any]] = {
    "arith": {("data", "system_prompt"): ARITH_SYSTEM},
    "letters": {("data", "system_prompt"): LETTERS_SYSTEM},
}

# Learning settings a recipe tunes for its own task, and what a task new to the recipe starts from instead:
# half the demo's learning rate and a KL pull to the starting model, which hold the policy near the model it
# started from while the reward teaches it (BENCHMARKS.md "A new task learns": the development set)
NEW_TASK_SETTINGS: dict[tuple[str, str], Any] = {
    ("train", "lr"): 1e-5,
    ("algo", "kl_coef"): 0.02,
}

DEFAULT_TASK = "arith"  # DataConfig.task's default


def task_identity(data: dict[str, Any]) -> str:
    """What a config dict trains on: its `data.path` when set, else its `data.task` (default arith)."""
    section = data.get("data") or {}
    return str(section.get("path") or section.get("task") or DEFAULT_TASK)


def task_defaults(task: str) -> dict[tuple[str, str], Any]:
    """The own defaults of task `task` (a built-in name; {} for any other task or a file)."""
    return dict(TASK_DEFAULTS.get(task, {}))


def switch_task(recipe: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The recipe dict with the command line's `overrides` applied, task-aware (module docstring), and the
    notes on what was replaced (empty when the task is the recipe's). Neither argument is changed."""
    merged = merge_overrides(recipe, overrides)
    before, after = task_identity(recipe), task_identity(merged)
    if before == after or not _names_task(recipe, overrides):
        return merged, []
    given = {(sec, key) for sec, body in overrides.items() if isinstance(body, dict) for key in body}
    dropped = []
    for sec, key in TASK_BOUND_KEYS:
        if (sec, key) not in given and key in (recipe.get(sec) or {}):
            del merged[sec][key]
            dropped.append(f"{sec}.{key}")
            selected = recipe[sec][key]  # reward.fn = "cme": its [reward.cme] table is bound to the task too
            if isinstance(selected, str) and isinstance((recipe.get(sec) or {}).get(selected), dict) \
                    and (sec, selected) not in given:
                del merged[sec][selected]
                dropped.append(f"[{sec}.{selected}]")
    if "path" in (overrides.get("data") or {}) and "task" in (recipe.get("data") or {}) and ("data", "task") not in given:
        del merged["data"]["task"]  # a file named on the command line is not the recipe's task
    own = {k: v for k, v in task_defaults(after).items() if k not in given}
    for (sec, key), value in own.items():
        merged.setdefault(sec, {})[key] = copy.deepcopy(value)
    tuned = {k: v for k, v in NEW_TASK_SETTINGS.items() if k not in given}
    for (sec, key), value in tuned.items():
        merged.setdefault(sec, {})[key] = value
    return merged, _notes(before, after, dropped, own, tuned)


def _names_task(recipe: dict[str, Any], overrides: dict[str, Any]) -> bool:
    """The command line names another task: a `data.task`, or a `data.path` over a recipe that trains a task
    (another copy of the recipe's own data file is the same task: its fields and reward stay)."""
    section = overrides.get("data") or {}
    return "task" in section or ("path" in section and not (recipe.get("data") or {}).get("path"))


def merge_overrides(recipe: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `recipe` with the `overrides` tables laid over it, key by key; a method's table
    (`rollout.duet.budget_tokens=3`) key by key too, over the recipe's `[rollout.duet]`."""
    merged = copy.deepcopy(recipe)
    for sec, body in overrides.items():
        if isinstance(body, dict):
            section = merged.setdefault(sec, {})
            for key, value in body.items():
                if _is_method_table(sec, key) and isinstance(value, dict) and isinstance(section.get(key), dict):
                    section[key] = {**section[key], **copy.deepcopy(value)}
                else:
                    section[key] = copy.deepcopy(value)
        else:
            merged[sec] = copy.deepcopy(body)
    return merged


def _is_method_table(sec: str, key: str) -> bool:
    """`[sec.key]` is a method's table (rollwise.config_methods), not a key of the section itself."""
    from rollwise.config import Config
    from rollwise.config_methods import METHOD_SECTIONS

    return sec in METHOD_SECTIONS and key not in Config.model_fields[sec].annotation.model_fields


def _notes(before: str, after: str, dropped: list[str], own: dict, tuned: dict) -> list[str]:
    """One line: what the switch from `before` to `after` replaced."""
    parts = []
    if dropped:
        parts.append(f"the recipe's {', '.join(dropped)} stay with its task")
    if own:
        parts.append("the task's own " + ", ".join(f"{s}.{k} = {v!r}" for (s, k), v in own.items()))
    if tuned:
        parts.append("a new task's settings against collapse onto its most common answer: "
                     + ", ".join(f"{s}.{k} = {v!r}" for (s, k), v in tuned.items()))
    if not parts:  # every task-bound and learning key came from the command line: nothing was replaced
        return []
    return [f"data.task {after!r} is not the recipe's task ({before!r}): " + "; ".join(parts)
            + " (a key set on the command line is kept)"]
