"""The layout's rules (docs/architecture.md), read from the source: who may import whom, and no import cycle.

Every import counts — top level, inside a function, under `TYPE_CHECKING` — since a cycle hidden in a function
is still a cycle. The graph is the project's modules (the package and the command line); an import of a name
that is a module points at that module, any other at the module it is taken from (a package's `__init__` only
when the name lives there).
"""

from __future__ import annotations

import ast
import json
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "agentspec_sim"
ENGINE_API = f"{PACKAGE}.engine.drafting"
FAMILIES_PACKAGE = f"{PACKAGE}.drafters"
SHARED = (f"{FAMILIES_PACKAGE}.common", f"{FAMILIES_PACKAGE}.registry")
# What a drafter family may import besides the engine's drafter API, the drafters' shared modules and the
# families it builds on: the layers below the engine.
BELOW_ENGINE = ("host", "io", "trace", "cost")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted((ROOT / "cli").glob("*.py")):  # installed as agentspec_sim.cli
        found[f"{PACKAGE}.cli" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Project module → the project modules it imports (every import statement, wherever it is)."""
    modules = modules or _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == PACKAGE and (found := resolve(target)) and found != module:
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def _family_of(module: str) -> str | None:
    if not module.startswith(FAMILIES_PACKAGE + "."):
        return None
    name = module.split(".")[2]
    return None if f"{FAMILIES_PACKAGE}.{name}" in SHARED else name


def _builds_on(family: str) -> set[str]:
    """The families a family declares it builds on (`BUILDS_ON` in its `__init__.py`)."""
    tree = ast.parse((ROOT / PACKAGE / "drafters" / family / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "BUILDS_ON" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


GRAPH = import_graph()


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks():
    # A reader that missed these would pass the rules below on a tree that breaks them.
    assert f"{PACKAGE}.engine.request" in GRAPH[f"{PACKAGE}.engine.drafting"]
    assert f"{PACKAGE}.cost.base" in GRAPH[f"{PACKAGE}.engine.drafting"]  # under TYPE_CHECKING there
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(GRAPH) == []


def test_the_engine_imports_no_drafter_module_nor_anything_above_it():
    above = (f"{PACKAGE}.drafters", f"{PACKAGE}.run", f"{PACKAGE}.sweep", f"{PACKAGE}.report", f"{PACKAGE}.cli",
             f"{PACKAGE}.capacity", f"{PACKAGE}.metrics", f"{PACKAGE}.slo", f"{PACKAGE}.capture")
    bad = {(m, t) for m, targets in GRAPH.items() if m.startswith(f"{PACKAGE}.engine")
           for t in targets if t.startswith(above)}
    assert not bad


def test_the_layers_below_the_engine_import_nothing_above_them():
    lower = tuple(f"{PACKAGE}.{layer}" for layer in BELOW_ENGINE)
    bad = {(m, t) for m, targets in GRAPH.items() if m.startswith(lower) for t in targets
           if not t.startswith(lower)}
    assert not bad


def test_a_family_imports_only_the_engines_drafter_api_shared_modules_and_what_it_builds_on():
    allowed_below = tuple(f"{PACKAGE}.{layer}" for layer in BELOW_ENGINE)
    bad = set()
    for module, targets in GRAPH.items():
        family = _family_of(module)
        if family is None:
            continue
        own = {family} | _builds_on(family)
        for target in targets:
            ok = (target == ENGINE_API or target.startswith(allowed_below) or target.startswith(SHARED)
                  or _family_of(target) in own)
            if not ok:
                bad.add((module, target))
    assert not bad


def test_families_build_on_each_other_without_a_cycle():
    families = sorted(p.name for p in (ROOT / PACKAGE / "drafters").iterdir()
                      if (p / "__init__.py").exists() and f"{FAMILIES_PACKAGE}.{p.name}" not in SHARED)
    assert {"normal", "ngram", "suffix", "agentspec", "model", "agspec"} <= set(families)
    assert cycles({f: _builds_on(f) for f in families}) == []
    shared = [m for m in GRAPH if m.startswith(SHARED)]
    assert not {(m, t) for m in shared for t in GRAPH[m] if _family_of(t) is not None}  # shared is below families


if __name__ == "__main__":  # the figures docs/architecture.md quotes
    graph = import_graph()
    print(json.dumps({"modules": len(_modules()), "cycles": cycles(graph)}, indent=1))
    pytest.main([__file__, "-q"])
