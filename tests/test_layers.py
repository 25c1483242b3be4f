"""The import graph of `rollwise/`: no cycle between units, every arrow pointing down or sideways.

A unit is a top-level module (`rollwise.loop`), a subpackage (`rollwise.train`), or a module the layer map
names on its own (`rollwise.serve.client`); `rollwise/__init__.py` is the unit `rollwise`. Every `import` and
`from ... import` counts, at module level or inside a function (relative imports resolved); a plugin named by
a dotted string (`"rollwise.envs.calc:calc_task"`) is not an import, which is how built-in entries stay lazy.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rollwise"

# Lower number = lower layer. A unit may import units of its own layer or below.
LAYERS: dict[int, tuple[str, ...]] = {
    0: ("rollwise", "types", "errors", "registry", "config", "config_distill", "config_methods", "config_toml",
        "config_load", "config_tasks", "hardware"),
    1: ("algo",),
    2: ("models", "sandbox", "metrics", "perf", "perf_datasheet"),
    3: ("data", "rewards", "generate", "train", "envs", "filter"),
    4: ("sync", "cluster", "rollout", "distill", "methods", "serve.client", "agents"),
    5: ("control", "replay", "evaluate", "advantages", "early_stop", "rollout_strategies", "relex", "decode"),
    6: ("build", "session", "validate", "names", "record"),
    7: ("loop", "cli", "evaluate_cli", "interrupt", "serve", "trajval", "config_reference"),
}
LAYER = {unit: layer for layer, units in LAYERS.items() for unit in units}
# Modules that are units of their own, apart from the package that holds them.
OWN_UNITS = {"serve.client"}
# Cycles between two modules of one unit allowed (none).
KNOWN_MODULE_CYCLES: set[frozenset[str]] = set()
# `rollwise/__init__.py` runs on every import of the package: it may import only these.
LIGHT_FOR_INIT = {"__future__", "importlib", "typing"}


@dataclass(frozen=True)
class Arrow:
    """One import: `source` module imports `target` module at `path:line`."""

    source: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path = ROOT) -> str:
    """`rollwise/train/fsdp.py` -> `rollwise.train.fsdp`; a package's `__init__.py` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """`rollwise.train.fsdp` -> `train`; `rollwise.loop` -> `loop`; `rollwise` -> `rollwise`."""
    parts = module.split(".")[1:]
    if not parts:
        return "rollwise"
    for size in range(len(parts), 1, -1):
        if ".".join(parts[:size]) in OWN_UNITS:
            return ".".join(parts[:size])
    return parts[0]


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name a `from ... import` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> list[tuple[str, int]]:
    """Every (imported module, line) in one file, at any depth. `from pkg import sub` counts as `pkg.sub` when it
    is a module (as `import pkg.sub` does: the package's `__init__` runs for both, and is counted for neither)."""
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, module, path.name == "__init__.py")
            submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
            if len(submodules) < len(node.names):  # some names are attributes of `source` itself
                found.append((source, node.lineno))
            found += [(name, node.lineno) for name in submodules]
    return found


@lru_cache(maxsize=1)
def graph() -> tuple[dict[str, Path], tuple[Arrow, ...]]:
    """All rollwise modules (name -> file) and every import arrow between two rollwise modules."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    arrows = []
    for module, path in files.items():
        for target, line in imports_of(path, set(files)):
            if target == "rollwise" or target.startswith("rollwise."):
                arrows.append(Arrow(module, target, str(path.relative_to(ROOT)), line))
    return files, tuple(arrows)


def unit_arrows() -> list[Arrow]:
    """The arrows that cross from one unit to another."""
    return [a for a in graph()[1] if unit_of(a.source) != unit_of(a.target)]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (iterative, no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def describe(arrow: Arrow) -> str:
    """`file:line: unit(Lx) -> unit(Ly)`."""
    source, target = unit_of(arrow.source), unit_of(arrow.target)
    return f"{arrow.where()}: {source}(L{LAYER.get(source, '?')}) -> {target}(L{LAYER.get(target, '?')})"


def shortest_cycle(start: str, edges: dict[str, set[str]], inside: set[str]) -> list[str]:
    """The shortest path start -> ... -> start within `inside` (breadth first), as its list of nodes."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child not in inside or child in parent:
                    continue
                parent[child] = node
                if child == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(parent[path[-1]])
                    return path[::-1]
                following.append(child)
        frontier = following
    return []


def cycle_report(arrows: list[Arrow], key) -> list[str]:
    """For every strongly connected component of more than one node: its members, then a shortest cycle
    through each member (distinct ones only), every step with the file:line of its imports."""
    edges: dict[str, set[str]] = {}
    sites: dict[tuple[str, str], list[Arrow]] = {}
    for arrow in arrows:
        pair = (key(arrow.source), key(arrow.target))
        if pair[0] != pair[1]:
            edges.setdefault(pair[0], set()).add(pair[1])
            sites.setdefault(pair, []).append(arrow)
    lines = []
    for component in strongly_connected(edges):
        if len(component) < 2:
            continue
        lines.append(f"{len(component)} in one cycle: {', '.join(component)}")
        seen = set()
        for node in component:
            cycle = shortest_cycle(node, edges, set(component))
            steps = frozenset(zip(cycle, cycle[1:]))
            if steps in seen:
                continue
            seen.add(steps)
            lines.append("  cycle " + " -> ".join(cycle))
            for pair in zip(cycle, cycle[1:]):
                lines += [f"    {a.where()}: {a.source} -> {a.target}" for a in sites[pair]]
    return lines


def test_every_unit_has_a_layer():
    files, _ = graph()
    unknown = sorted({unit_of(m) for m in files} - set(LAYER))
    assert not unknown, (
        f"units without a layer: {unknown}; add each to LAYERS in tests/test_layers.py "
        "(and to the Layers line of the design doc) at the lowest layer its imports allow"
    )


def test_no_cycle_between_units():
    report = cycle_report(unit_arrows(), unit_of)
    assert not report, "import cycles between units:\n" + "\n".join(report)


def test_no_cycle_between_modules_of_a_unit():
    """Within a unit too, modules depend one way (a cycle there is a helper that belongs in a lower module)."""
    inner = [a for a in graph()[1] if unit_of(a.source) == unit_of(a.target)]
    inner = [a for a in inner if frozenset((a.source, a.target)) not in KNOWN_MODULE_CYCLES]
    report = cycle_report(inner, lambda module: module)
    assert not report, "import cycles between modules of one unit:\n" + "\n".join(report)


def test_arrows_point_down_or_sideways():
    upward = [
        describe(a)
        for a in unit_arrows()
        if unit_of(a.source) in LAYER
        and unit_of(a.target) in LAYER
        and LAYER[unit_of(a.target)] > LAYER[unit_of(a.source)]
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_package_init_is_light():
    path = PACKAGE / "__init__.py"
    heavy = [
        f"rollwise/__init__.py:{line}: imports {name}"
        for name, line in imports_of(path, set())
        if name.split(".")[0] not in LIGHT_FOR_INIT
    ]
    assert not heavy, "\n".join(heavy)


def test_the_walker_sees_function_level_and_relative_imports(tmp_path):
    """The graph is only as good as its parser: nested, relative and package-relative imports are all found."""
    package = tmp_path / "rollwise" / "sub"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .other import thing\n")
    (package / "other.py").write_text("")
    source = package / "mod.py"
    source.write_text("def f():\n    from ..loop import run\n    from . import other\n    import rollwise.types\n")
    modules = {"rollwise.sub", "rollwise.sub.other", "rollwise.sub.mod"}
    found = imports_of(source, modules, root=tmp_path)
    assert found == [("rollwise.loop", 2), ("rollwise.sub.other", 3), ("rollwise.types", 4)]
    assert imports_of(package / "__init__.py", modules, root=tmp_path) == [("rollwise.sub.other", 1)]
    assert unit_of("rollwise.serve.client") == "serve.client" and unit_of("rollwise.serve.jobs") == "serve"
