"""The package's layers, bottom up, as docs/architecture.md lists them: every module imports only from its own
layer or below (imports inside functions and under TYPE_CHECKING included), and no two modules import each other
through any chain."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS: list[tuple[str, ...]] = [
    ("afd.env", "afd.config", "afd.topology", "afd.buckets", "afd.routing"),  # values and arithmetic
    ("afd.transport", "afd.distributed", "afd.profiling"),
    ("afd.kernels",),
    ("afd.connectors",),
    ("afd.model",),
    ("afd.engine",),
    ("afd.runtime",),
    ("afd.serve",),
    ("afd.bench",),
    ("afd.planning",),
    ("afd.cli", "afd.vllm_plugin", "afd.__main__"),
]


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `src` (a package is its __init__)."""
    modules = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports, wherever in the file the import stands."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name and t != "afd"}
    return edges


def layer_of(module: str) -> int | None:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    assert [m for m in module_files(SRC) if m != "afd" and layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_above_it() -> None:
    edges = import_graph(module_files(SRC))
    upward = [f"{m} -> {t}" for m, ts in sorted(edges.items()) for t in sorted(ts) if layer_of(t) > layer_of(m)]
    assert upward == []


def test_no_import_circles() -> None:
    assert circles(import_graph(module_files(SRC))) == []


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "afd"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("from afd.model import b\n")
    (pkg / "model" / "b.py").write_text("def f():\n    from afd.model.a import x\n    from afd.cli import main\n")
    (pkg / "cli.py").write_text("")
    edges = import_graph(module_files(tmp_path))
    assert circles(edges) == [["afd.model.a", "afd.model.b"]]
    assert "afd.cli" in edges["afd.model.b"] and layer_of("afd.cli") > layer_of("afd.model.b")


MAX_LINES = 500  # a module past this is asking to be split along a seam


def test_no_source_file_is_over_the_line_limit() -> None:
    long = {f"{p.relative_to(SRC)}": n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
