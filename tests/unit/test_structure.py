"""The package's shape: imports inside ``hf_tp/`` point one way (no cycle, lazy imports included),
and no function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_tp"
MAX_FUNCTION_LINES = 70


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``hf_tp`` modules it imports anywhere in its source (``from pkg import sub``
    counts as importing the submodule ``pkg.sub``; a name from a package counts as the package)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[module] |= {t for n in names if (t := owner(n)) and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_inside_hf_tp() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_lazy_cycle() -> None:
    # the check itself: a cycle closed by an import inside a function is still a cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "hf_tp.adapters.inspect_model" in graph["hf_tp.adapters.generic"]
    assert "hf_tp.cli.plan" in graph["hf_tp.cli.main"]  # `from hf_tp.cli import plan`


def test_functions_stay_short() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)


DOCS = PACKAGE.parent / "docs" / "development.md"
FLOORS_MARK = "<!-- floors: read by tests/unit/test_structure.py -->"


def floors() -> dict[str, int]:
    """Package (or top-level module) name -> its floor, from docs/development.md's floors block."""
    text = DOCS.read_text()
    block = text[text.index(FLOORS_MARK) :].split("```")[1]
    out: dict[str, int] = {}
    for line in block.splitlines()[1:]:
        if line.strip():
            number, rest = line.split(maxsplit=1)
            names = rest.split("  ")[0].split()  # the packages, then two spaces and what they hold
            out |= {name: int(number) for name in names}
    return out


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_imports_stand_on_lower_floors() -> None:
    """Each package imports only packages on lower floors (docs/development.md); a ``__main__`` is a
    program and the ``hf_tp`` namespace only names its public objects lazily."""
    floor, graph = floors(), import_graph()
    unlisted = {_package(m) for m in graph} - set(floor) - {""}
    assert not unlisted, f"packages without a floor in docs/development.md: {sorted(unlisted)}"
    climbs = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _package(module) and not module.endswith("__main__")
        for target in targets
        if _package(target) and _package(target) != _package(module)
        and floor[_package(target)] >= floor[_package(module)]
    ]  # fmt: skip
    assert not climbs, "imports that do not go down a floor: " + "; ".join(sorted(climbs))


def test_the_floor_check_reads_the_block() -> None:
    got = floors()
    assert got["compat"] == 1 and got["cli"] == max(got.values()) and got["train"] == got["estimate"]


def test_no_two_modules_share_a_name() -> None:
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"module names used twice: {shared}"


def test_no_two_classes_share_a_name() -> None:
    # a class name says what the thing is: two of one name (two `Routing`s, ...) make a reader guess
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    shared = {name: where for name, where in seen.items() if len(where) > 1}
    assert not shared, f"class names used twice: {shared}"
