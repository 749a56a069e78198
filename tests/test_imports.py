"""The dsattn package's module structure: its import graph has no cycle (imports deferred into
functions or under TYPE_CHECKING count: they only hide a circle), and docs/design.md's module
map has a line for every module (docs/layout.md's list as well)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dsattn"


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of dsattn (a package by its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return name in mods and mods[name].name == "__init__.py"


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The dsattn modules `name` imports anywhere in its file (top level, in functions, under
    TYPE_CHECKING): `import a.b` and `from a import b` name a.b when that is a module, else a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = name.split(".") if _is_package(name, mods) else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # `import dsattn.x.y` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None (depth-first search, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "dsattn.config" in graph["dsattn"]  # the package's own __init__
    assert "dsattn.errors" in graph["dsattn.data"]
    assert all(t in graph for targets in graph.values() for t in targets)


def test_the_dsattn_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i:text.index(end, i)]


def test_the_design_module_map_names_every_module():
    """docs/design.md's module map (a table row per module) names every dsattn/**/*.py file,
    and no file that does not exist; docs/layout.md's list names every one too."""
    files = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    design = _section((ROOT / "docs" / "design.md").read_text(), "## Module map", "\n## ")
    rows = re.findall(r"^\| `(dsattn/[\w/]+\.py)` \|", design, re.M)
    assert len(rows) == len(set(rows)), "docs/design.md's module map names a module twice"
    missing, stale = sorted(files - set(rows)), sorted(set(rows) - files)
    assert not missing, f"docs/design.md's module map has no row for: {', '.join(missing)}"
    assert not stale, f"docs/design.md's module map names missing files: {', '.join(stale)}"
    layout = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"^(dsattn/[\w/]+\.py)\s", layout, re.M))
    missing, stale = sorted(files - named), sorted(named - files)
    assert not missing, f"docs/layout.md has no line for: {', '.join(missing)}"
    assert not stale, f"docs/layout.md names missing files: {', '.join(stale)}"


def test_bench_does_not_import_ablate():
    """Layering: the benchmarks (dsattn.bench) sit below the ablation sweeps (dsattn.ablate,
    which may use them), so no bench module imports an ablate one, even deferred."""
    graph = import_graph()
    bench = sorted(m for m in graph if m == "dsattn.bench" or m.startswith("dsattn.bench."))
    assert "dsattn.bench.seeds" in bench  # the graph sees the bench package
    upward = {m: sorted(t for t in graph[m] if t == "dsattn.ablate"
                        or t.startswith("dsattn.ablate.")) for m in bench}
    upward = {m: ts for m, ts in upward.items() if ts}
    assert not upward, f"bench modules import ablate: {upward}"
