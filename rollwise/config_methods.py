"""Where a method's settings live: one table per method under its section, declared by the method itself.

A rollout strategy (`rollout.strategy = "duet"`), an `algo.method` / `[[stage]] kind` or `algo.advantage`
(`algo.method = "hargo"`), and a reward method (`reward.fn = "cme"`, or a reward wrapper such as verifier noise)
reads its options from a nested table named after it:

    [rollout]
    strategy = "duet"
    [rollout.duet]
    budget_tokens = 4096            # command line: rollout.duet.budget_tokens=4096

The method's module declares the table as one `MethodOptions` subclass, which registers it here:

    class DuetOptions(MethodOptions, section="rollout", name="duet"):
        budget_tokens: int = Field(0, ge=0, description="...")

and reads it with `DuetOptions.of(cfg)` (a typed, validated instance; the defaults when the table is absent).
`rollwise.validate` checks the table of every selected method (and that no table is set for a method the run
does not select) before any work; `rollwise config rollout.duet` prints it (docs/config.md is generated from
these models). The config sections themselves never import a method: they keep each table as written.

`MOVED` names the new place of every flat key of the methods that entered before the tables
(`rollout.duet_budget_tokens` -> `[rollout.duet] budget_tokens`); such a key fails at load in one line.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rollwise.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message says which key and what is valid (re-exported by
    rollwise.config, where every caller imports it from)."""


# the sections with method tables, and the key(s) that select a table there (docs: `rollwise config rollout`)
METHOD_SECTIONS = {"rollout": "rollout.strategy", "algo": "algo.method ([[stage]] kind) or algo.advantage",
                   "reward": "reward.fn"}

OPTION_MODELS: dict[tuple[str, str], type["MethodOptions"]] = {}


class MethodOptions(BaseModel):
    """The options of one method: `[section.name]`. Subclass with `section=` and `name=` (registers it).

    `errors(cfg)` returns what cannot run across sections (e.g. more samples than the group has), checked by
    `rollwise.validate` for a selected method; `always = True` marks a wrapper whose table is read whatever
    the section's selector names (verifier noise, MemReward: their table turns them on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    section: ClassVar[str] = ""
    name: ClassVar[str] = ""
    always: ClassVar[bool] = False

    def __init_subclass__(cls, section: str = "", name: str = "", always: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if section:
            if section not in METHOD_SECTIONS:
                raise ValueError(f"MethodOptions section {section!r} is not one of {', '.join(METHOD_SECTIONS)}")
            cls.section, cls.name, cls.always = section, name, always
            OPTION_MODELS[(section, name)] = cls

    @model_validator(mode="before")
    @classmethod
    def _numbers_as_text(cls, data: Any) -> Any:
        """`rollout.duet.marker=2024` on the command line is the text "2024" (as `run.name=2024` is)."""
        if isinstance(data, dict):
            data = {key: str(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                    and key in cls.model_fields and cls.model_fields[key].annotation in (str, str | None)
                    else value for key, value in data.items()}
        return data

    @classmethod
    def table(cls, cfg) -> dict[str, Any]:
        """The table as written (`{}` when absent)."""
        section = getattr(cfg, cls.section, cfg)  # a Config, or the section itself (rewards get `cfg.reward`)
        return dict((section.model_extra or {}).get(cls.name) or {})

    @classmethod
    def of(cls, cfg) -> "MethodOptions":
        """The validated options of this method in `cfg` (a `Config`); ConfigError in one line when invalid."""
        try:
            return cls.model_validate(cls.table(cfg))
        except ValidationError as exc:
            raise ConfigError(options_error(cls, exc)) from exc

    def errors(self, cfg) -> list[str]:
        return []


def options_error(cls: type[MethodOptions], exc: ValidationError) -> str:
    """One line for the first problem of a method table."""
    err = exc.errors()[0]
    where = f"{cls.section}.{cls.name}"
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return (f"unknown key '{where}.{key}'; valid keys in [{where}]: {', '.join(cls.model_fields)}")
    if not key:
        return f"[{where}]: {err['msg'].removeprefix('Value error, ')}"
    field = cls.model_fields.get(str(err["loc"][0]))
    secret = field is not None and isinstance(field.json_schema_extra, dict) and "env" in field.json_schema_extra
    return f"{where}.{key}: {err['msg']}; got {'***' if secret else repr(err.get('input'))}"


class TablesSection(BaseModel):
    """A config section that holds method tables besides its own keys (`[rollout.duet]`): kept as written (a
    dict per method, `section.model_extra`), checked by the method's `MethodOptions` at validation."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _tables_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            section = _SECTION_OF.get(cls.__name__, cls.__name__)
            for key, value in data.items():
                if key in cls.model_fields or isinstance(value, dict):
                    continue
                raise ValueError(moved_message(section, key) or f"unknown key '{section}.{key}'; valid keys in "
                                 f"[{section}]: {', '.join(cls.model_fields)} (and a table per method)")
        return data


_SECTION_OF = {"RolloutConfig": "rollout", "AlgoConfig": "algo", "RewardConfig": "reward"}


def _moves(section: str, table: str, keys: str, prefix: str | None = None) -> dict[str, tuple[str, str]]:
    prefix = table if prefix is None else prefix
    return {f"{section}.{prefix}_{key}" if prefix else f"{section}.{key}": (f"{section}.{table}", key)
            for key in keys.split()}


# old flat key -> (its table, its key there): every method key before the tables (issue 33)
MOVED: dict[str, tuple[str, str]] = {
    **_moves("rollout", "rethink", "trigger fraction max_new_tokens"),
    **_moves("rollout", "adhint", "max_ratio samples weight momentum"),
    **_moves("rollout", "duet", "budget_tokens min_samples abort_tokens marker momentum"),
    **_moves("rollout", "tandem", "junior segment_tokens junior_prob"),
    **_moves("rollout", "eepo", "unlearn_steps unlearn_lr"),
    **_moves("rollout", "tree", "simulations branches step_tokens c_puct"),
    **_moves("reward", "cme", "model verifier batch_size"),
    **_moves("reward", "noise", "fp fn seed"),
    **_moves("reward", "judge", "url model api_key template max_tokens concurrency retries score_max threshold"),
    "reward.label_fraction": ("reward.memreward", "label_fraction"),
    "reward.label_seed": ("reward.memreward", "seed"),
    "algo.discrepancy_measure": ("algo.acrl] or [algo.dcmdp", "measure"),
    "algo.discrepancy_target": ("algo.acrl] or [algo.dcmdp", "target"),
    **_moves("algo", "dcmdp", "dual_lr dual_max", prefix=""),
    **_moves("algo", "acrl", "gain threshold_max threshold_min"),
    **_moves("algo", "hargo", "alpha gamma temperature"),
    **_moves("algo", "echorl", "coef clip_frac"),
    **_moves("algo", "tree", "value_coef"),
    **_moves("algo", "progress", "coef step_tokens"),
    **_moves("algo", "rorecomp", "compensation_size max_age"),
    **_moves("algo", "hrr", "weight max_per_group"),
    **_moves("algo", "moa", "weights"),
    **_moves("algo", "sgrpo", "coef ngram sets"),
    **_moves("algo", "mipu", "tolerance kl_coef max_rejects_in_row"),
    **_moves("algo", "slas", "power"),
}


def moved_message(section: str, key: str) -> str | None:
    """`rollout.duet.budget_tokens moved: write [rollout.duet] budget_tokens` for an old flat key, else None."""
    new = MOVED.get(f"{section}.{key}")
    if new is None:
        return None
    table, name = new
    return f"{section}.{key} moved: write [{table}] {name} (or {table.split(']')[0]}.{name}=... on the command line)"


# wrappers read whenever their table is set: an old run used one only when these flat keys left their defaults
_OLD_WRAPPER_ON = {"reward.noise": lambda old: old.get("noise_fp", 0.0) or old.get("noise_fn", 0.0),
                   "reward.memreward": lambda old: old.get("label_fraction", 1.0) < 1.0}


def migrate_flat_keys(data: dict[str, Any]) -> list[str]:
    """A run directory's own config.toml written before the method tables (every flat method key, most at their
    defaults), read in the new form, in place: the keys of the method the run selected move into its table, the
    keys of methods it did not select (which had no effect on it) are dropped. Returns the note lines (none when
    there was nothing to move). Only for the file a run wrote; a recipe with a flat key fails (`moved_message`)."""
    moved, dropped = [], 0
    for section in METHOD_SECTIONS:
        body = data.get(section)
        if not isinstance(body, dict):
            continue
        old = {key: body[key] for key in list(body) if f"{section}.{key}" in MOVED}
        for key, value in old.items():
            del body[key]
            table, name = MOVED[f"{section}.{key}"]
            table = _selected_table(table, body, old)
            if table is None:
                dropped += 1
                continue
            body.setdefault(table.split(".", 1)[1], {})[name] = value
            moved.append(f"{section}.{key} -> [{table}] {name}")
    if not moved and not dropped:
        return []
    return [f"rollwise: this run's config.toml predates method tables: {len(moved)} key(s) read in their table"
            f"{' (' + ', '.join(moved) + ')' if moved else ''}, {dropped} of methods the run did not use left out"]


def _selected_table(table: str, body: dict[str, Any], old: dict[str, Any]) -> str | None:
    """`table` ("rollout.duet") when the old run used that method (its selector named it, or a wrapper's keys
    turned it on), else None; the shared acrl/dcmdp keys go to whichever of the two `algo.method` names."""
    section = table.split(".", 1)[0]
    if "] or [" in table:  # algo.discrepancy_*: [algo.acrl] or [algo.dcmdp]
        method = body.get("method")
        return f"algo.{method}" if method in ("acrl", "dcmdp") else None
    if table in _OLD_WRAPPER_ON:
        return table if _OLD_WRAPPER_ON[table](old) else None
    name = table.split(".", 1)[1]
    selectors = {"rollout": [body.get("strategy", "plain")], "algo": [body.get("method"), body.get("advantage")],
                 "reward": [body.get("fn")]}[section]
    return table if name in selectors else None
