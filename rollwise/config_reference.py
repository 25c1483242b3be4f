"""The config reference from the models themselves: `rollwise config [SECTION | KEY]` and docs/config.md.

Every key of every section (`rollwise.config.Config`) and of every method's table (`rollwise.config_methods`:
`[rollout.duet]`, `[algo.hargo]`, `[reward.cme]`...) with its type, default and description. The method tables
are found through the registries that name the methods (rollout strategies, methods, advantages, rewards), so
a new method's table shows here without a line of this file.

    rollwise config                      # every section, and which method tables each holds
    rollwise config rollout              # the keys of [rollout] and its method tables
    rollwise config rollout.duet         # the keys of [rollout.duet]
    rollwise config algo.kl_coef         # one key
    rollwise config --markdown > docs/config.md
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rollwise.config import Config, ConfigError
from rollwise.config_distill import StageConfig
from rollwise.config_methods import METHOD_SECTIONS, OPTION_MODELS, MethodOptions

HEADER = """# Config reference

Generated from the config models by `rollwise config --markdown > docs/config.md` (a test fails when this file
is stale); `rollwise config SECTION` or `rollwise config SECTION.KEY` prints the same on the command line. A
recipe is a TOML file of these sections; every key can also be given as `section.key=value` after the recipe
(`rollwise train recipes/grpo.toml train.steps=5`). A method's own options live in a table named after it under
its section (`[rollout.duet]`, `[algo.hargo]`, `[reward.cme]`), read only when the run selects that method;
on the command line they are `section.method.key=value` (`rollout.duet.budget_tokens=2048`).
"""


def discover() -> dict[tuple[str, str], type[MethodOptions]]:
    """Every method table: imports each registered method (lazily registered ones too) so its options model
    registers itself. An entry whose optional dependency is missing is skipped."""
    import rollwise.rewards.memreward  # noqa: F401  (reward wrappers)
    import rollwise.rewards.noise  # noqa: F401
    from rollwise import algo
    from rollwise.methods import METHODS
    from rollwise.rewards import REWARDS
    from rollwise.rollout_strategies import ROLLOUT_STRATEGIES

    for registry in (ROLLOUT_STRATEGIES, METHODS, algo.ADVANTAGES, algo.TOKEN_ADVANTAGES, REWARDS):
        for name in registry.names():
            try:
                registry.get(name)
            except Exception:  # noqa: BLE001  (an optional extra that is not installed)
                continue
    return dict(sorted(OPTION_MODELS.items()))


def section_model(sec: str) -> type[BaseModel]:
    if sec == "stage":
        return StageConfig
    return Config.model_fields[sec].annotation  # type: ignore[return-value]


def _type(annotation: Any) -> str:
    if "SecretStr" in str(annotation):  # an API key: never its serializer's repr (it holds an address)
        return "secret | None" if "None" in str(annotation) or "Optional" in str(annotation) else "secret"
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"\b(typing|pydantic\.types|rollwise\.config)\.", "", text)
    text = text.replace("NoneType", "None").replace("Optional[", "None | [")
    return text


def _default(info) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    return "None" if value is None else repr(value) if isinstance(value, str) else str(value).replace("'", '"') \
        if isinstance(value, (dict, list)) else str(value).lower() if isinstance(value, bool) else str(value)


def rows(model: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """`(key, type, default, description)` of every field of `model`."""
    return [(key, _type(info.annotation), _default(info), " ".join((info.description or "").split()))
            for key, info in model.model_fields.items()]


def _tables_of(sec: str, tables: dict) -> list[tuple[str, type[MethodOptions]]]:
    return [(name, model) for (s, name), model in tables.items() if s == sec]


def text(target: str | None = None) -> str:
    """What `rollwise config [TARGET]` prints."""
    tables = discover()
    sections = list(Config.model_fields)
    if target is None:
        out = []
        for sec in sections:
            names = [name for name, _ in _tables_of(sec, tables)]
            more = f"  (method tables: {', '.join(f'[{sec}.{n}]' for n in names)})" if names else ""
            out.append(f"[{sec}]  {len(section_model(sec).model_fields)} keys{more}")
        return "\n".join(out + ["", "rollwise config SECTION | SECTION.KEY | SECTION.METHOD for the keys"])
    parts = target.split(".")
    sec = parts[0]
    if sec not in sections:
        raise ConfigError(f"unknown section {sec!r}; valid sections: {', '.join(sections)}")
    model = section_model(sec)
    if len(parts) == 1:
        out = [f"[{sec}]", *_lines(rows(model))]
        for name, table in _tables_of(sec, tables):
            out += ["", f"[{sec}.{name}]  ({_selected_by(table)})", *_lines(rows(table))]
        return "\n".join(out)
    if parts[1] in model.model_fields and len(parts) == 2:
        return "\n".join(_lines([r for r in rows(model) if r[0] == parts[1]]))
    table = tables.get((sec, parts[1]))
    if table is None:
        names = [*model.model_fields, *(f"{sec}.{n}" for n, _ in _tables_of(sec, tables))]
        raise ConfigError(f"unknown key or table {target!r}; valid in [{sec}]: {', '.join(names)}")
    if len(parts) == 2:
        doc = _doc(table)
        return "\n".join([f"[{sec}.{parts[1]}]  ({_selected_by(table)})", *([doc] if doc else []),
                          *_lines(rows(table))])
    found = [r for r in rows(table) if r[0] == parts[2]]
    if len(parts) != 3 or not found:
        raise ConfigError(f"unknown key {target!r}; valid keys in [{sec}.{parts[1]}]: "
                          f"{', '.join(table.model_fields)}")
    return "\n".join(_lines(found))


def _doc(model: type[BaseModel]) -> str:
    """The model's docstring on one line, without its leading `[section.name]` (the heading says it)."""
    doc = " ".join((model.__doc__ or "").split())
    doc = re.sub(r"^`\[[\w.]+\]`(: | )", "", doc)
    return re.sub(r"^\(with [^)]*\): ", "", doc)


def _selected_by(table: type[MethodOptions]) -> str:
    if table.always:
        return "read whenever the table is set"
    selector = {"rollout": "rollout.strategy", "algo": "algo.method / algo.advantage", "reward": "reward.fn"}
    return f"read when {selector[table.section]} = {table.name!r}"


def _lines(found: list[tuple[str, str, str, str]]) -> list[str]:
    return [f"  {key} : {kind} = {default}\n      {desc}" if desc else f"  {key} : {kind} = {default}"
            for key, kind, default, desc in found]


def markdown() -> str:
    """docs/config.md: every section, then every method table, as Markdown tables."""
    tables = discover()
    out = [HEADER]
    for sec in Config.model_fields:
        title = "[[stage]]" if sec == "stage" else f"[{sec}]"
        out += [f"## {title}", ""]
        doc = _doc(section_model(sec))
        if doc:
            out += [doc, ""]
        out += _md_table(rows(section_model(sec)))
        if sec in METHOD_SECTIONS:
            for name, table in _tables_of(sec, tables):
                doc = _doc(table)
                out += [f"### [{sec}.{name}]", "", f"{doc} R{_selected_by(table)[1:]}; "
                        f"defined in `{table.__module__}`.", ""]
                out += _md_table(rows(table))
    return "\n".join(out).rstrip() + "\n"


def _md_table(found: list[tuple[str, str, str, str]]) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    return ["| key | type | default | description |", "|---|---|---|---|",
            *[f"| `{key}` | `{cell(kind)}` | `{cell(default)}` | {cell(desc)} |" for key, kind, default, desc in found],
            ""]
