"""Render a resolved `Config` as TOML (the run directory's `config.toml`); `[[stage]]` tables come last.

A secret (`rollwise.config.Secret`: the API keys) is never written: a set one becomes a comment with `***` and
the environment variable to give it by, so a run read back from config.toml (`--resume`) takes it from there.
"""

from __future__ import annotations

import json
import re
from typing import Any


def to_toml(cfg) -> str:
    """Render the resolved config as TOML (written to `config.toml` in the run directory)."""
    from rollwise.config import SECRET_MASK, secret_keys

    out = []
    dumped = cfg.model_dump(mode="json")  # secrets are SECRET_MASK here already
    stages = dumped.pop("stage", [])
    secrets = secret_keys()
    for sec, body in dumped.items():
        for key in body:
            env = secrets.get(f"{sec}.{key}")
            if env is not None and body[key] is not None:
                body[key] = _Comment(f"{SECRET_MASK} (a secret, never written: give it as ${env} or "
                                     f"{sec}.{key}=...)")
        tables = {name: body.pop(name) for name in (getattr(cfg, sec).model_extra or {})}  # [rollout.duet]
        out += [f"[{sec}]", *_table(body), ""]
        for name, table in tables.items():
            for key in table:
                env = secrets.get(f"{sec}.{name}.{key}")
                if env is not None and table[key] is not None:
                    table[key] = _Comment(f"{SECRET_MASK} (a secret, never written: give it as ${env} or "
                                          f"{sec}.{name}.{key}=...)")
            out += [f"[{sec}.{_toml_key(name)}]", *_table(table), ""]
    for stage in stages:
        out += ["[[stage]]", *_table(stage), ""]
    return "\n".join(out)


class _Comment(str):
    """A value written as a comment (`# key = text`)."""


def _table(body: dict[str, Any]) -> list[str]:
    return [f"# {key} = (unset)" if value is None else f"# {key} = {value}" if isinstance(value, _Comment)
            else f"{key} = {_toml_value(value)}" for key, value in body.items()]


def _toml_key(key: str) -> str:
    """A TOML key: bare when it only has letters, digits, `_` and `-`, else quoted (`"pkg.mod:fn"`)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # inline table
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
