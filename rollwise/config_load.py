"""Loading a run configuration: a TOML recipe plus `section.key=value` overrides into a `Config`, with every unknown
key or bad value reported in one message that names the key and lists what is valid (rollwise.config holds the
sections themselves)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollwise.config import SECRET_MASK, Config, ConfigError, StageConfig, secret_keys
from rollwise.config_methods import METHOD_SECTIONS, migrate_flat_keys, moved_message
from rollwise.config_tasks import merge_overrides, switch_task


def valid_keys(section: str | None = None) -> list[str]:
    """`section.key` names accepted by `Config` (all sections, or one)."""
    keys = []
    for sec_name in Config.model_fields:
        if section is None or section == sec_name:
            keys += [f"{sec_name}.{k}" for k in _section_fields(sec_name)]
    return keys


def _section_fields(sec: str) -> dict[str, Any]:
    """The fields of section `sec` (of one `[[stage]]` table for `stage`)."""
    return StageConfig.model_fields if sec == "stage" else Config.model_fields[sec].annotation.model_fields  # type: ignore[union-attr]


def _parse_value(raw: str) -> Any:
    """Parse an override value as a TOML value; bare words stay strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _is_text_field(sec: str, key: str) -> bool:
    annotation = Config.model_fields[sec].annotation.model_fields[key].annotation  # type: ignore[union-attr]
    return annotation is str or annotation == (str | None) or f"{sec}.{key}" in secret_keys()


def _check_keys(data: dict[str, Any], where: str) -> None:
    for sec, body in data.items():
        if sec not in Config.model_fields:
            raise ConfigError(f"{where}: unknown section {sec!r}; valid sections: {', '.join(Config.model_fields)}")
        if sec == "stage":
            if not isinstance(body, list) or not all(isinstance(t, dict) for t in body):
                raise ConfigError(f"{where}: 'stage' must be a list of [[stage]] tables (kind, steps)")
            tables = body
        elif not isinstance(body, dict):
            raise ConfigError(f"{where}: section {sec!r} must be a table of keys")
        else:
            tables = [body]
        fields = _section_fields(sec)
        for number, table in enumerate(tables, 1):
            for key in table:
                if key not in fields and sec in METHOD_SECTIONS:
                    moved = moved_message(sec, key)
                    if moved:
                        raise ConfigError(f"{where}: {moved}")
                    if isinstance(table[key], dict):
                        continue  # a method's table, [rollout.duet]: checked by the method at validation
                if key not in fields:
                    label = f"[[stage]] number {number}" if sec == "stage" else f"[{sec}]"
                    raise ConfigError(f"{where}: unknown key '{sec}.{key}'; valid keys in {label}: {', '.join(fields)}")


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `section.key=value` to a nested dict, in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    dotted, _, raw = override.partition("=")
    parts = dotted.strip().split(".")
    if len(parts) == 3 and parts[0] in METHOD_SECTIONS and parts[1] not in _section_fields(parts[0]):
        sec, table, key = parts  # a method's table: rollout.duet.budget_tokens=3 (checked at validation)
        data.setdefault(sec, {}).setdefault(table, {})[key] = _parse_value(raw.strip())
        return
    if len(parts) != 2:
        raise ConfigError(f"override {override!r}: key must be 'section.key' (or 'section.method.key' for a "
                          f"method's table); valid keys: {', '.join(valid_keys())}")
    sec, key = parts
    if sec == "stage":
        raise ConfigError(f"override {override!r}: [[stage]] tables are set in the recipe file, not on the "
                          "command line")
    moved = moved_message(sec, key) if sec in METHOD_SECTIONS else None
    if moved:  # the value is left out: it may be a secret (reward.judge_api_key=...)
        raise ConfigError(f"override {sec}.{key}=...: {moved}")
    _check_keys({sec: {key: None}}, f"override {override!r}")
    value = _parse_value(raw.strip())
    if _is_text_field(sec, key) and not isinstance(value, str):
        value = raw.strip()  # run.name=2024 stays the text "2024"
    data.setdefault(sec, {})[key] = value


def _format_validation(exc: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid config"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        ctx = err.get("ctx", {})
        expected = f" (expected {ctx['expected']})" if "expected" in ctx else ""
        if not key:  # a rule across keys: its message names them
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
            continue
        got = SECRET_MASK if key in secret_keys() else repr(err.get("input"))  # a secret is never echoed
        lines.append(f"  {key}: {err['msg']}{expected}; got {got}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Parse a TOML recipe (optional) and `section.key=value` overrides into a `Config`: keys, types and ranges
    only. Checks across keys and of registry names are a step above (`rollwise.validate.validate`), which every
    command runs before any work."""
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"recipe file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"recipe {path}: cannot read it as a TOML file ({exc})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        migrated = migrate_flat_keys(data) if is_run_config(Path(path)) else []
        _check_keys(data, where)
    given: dict[str, Any] = {}
    for override in overrides or []:
        apply_override(given, override)
    # a task other than the recipe's: the recipe's task-bound keys stay behind (rollwise.config_tasks)
    data, notes = switch_task(data, given) if path is not None else (merge_overrides(data, given), [])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, where)) from exc
    cfg._load_notes = migrated + notes if path is not None else notes
    return cfg


def is_run_config(path: Path) -> bool:
    """Whether `path` is the config.toml a run wrote into its run directory (beside its metrics or checkpoints)."""
    return path.name == "config.toml" and any((path.parent / f).exists() for f in ("metrics.jsonl", "checkpoints"))
