"""Name -> implementation registries, and user plugins by dotted path (`pkg.module:fn`).

Every registry holds callables with one signature, checked by `tests/test_registry_contract.py`. An entry is
registered with the function itself (`@TASKS.register("arith")`), or lazily by its dotted path
(`TASKS.register_lazy("calc", "rollwise.envs.calc:calc_task")`): the module is imported on the first `get`, so
a registry can list entries that live in a higher layer without importing it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """A named collection of callables of one kind (advantages, losses, rewards, tasks...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._lazy: dict[str, str] = {}  # name -> 'pkg.module:attr', imported on first use

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            self._check_new(name)
            self._entries[name] = fn
            return fn

        return decorator

    def register_lazy(self, name: str, path: str) -> None:
        """Register `name` as the entry at `path` ('pkg.module:attr'), imported when it is first looked up."""
        self._check_new(name)
        self._lazy[name] = path

    def _check_new(self, name: str) -> None:
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def get(self, name: str) -> F:
        """Look up `name` (importing a lazy entry once), or import it when it is a dotted path `pkg.module:attr`."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            self._entries[name] = load_dotted(self._lazy[name])
            return self._entries[name]
        if ":" in name:
            return load_dotted(name)  # type: ignore[return-value]
        raise KeyError(
            f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())} "
            f"(or give a plugin as 'package.module:function')"
        )

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._lazy})

    def items(self) -> list[tuple[str, F]]:
        """Every entry with its function (lazy entries are imported here)."""
        return [(name, self.get(name)) for name in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._lazy or ":" in name


def load_dotted(path: str) -> Any:
    """Import `pkg.module:attr` and return the attribute, with a clear error when it is missing.

    The working directory is importable too (as with `python -m`), so a plugin module beside the recipe works."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"plugin path {path!r} must look like 'package.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # `rollwise` scripts: plugins next to the recipe
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for plugin {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (plugin {path!r})") from exc
