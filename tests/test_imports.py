"""The import graph of ``src/moestream``: no cycles, and no module importing one above it in the one-way order
parsing/format -> experts -> the models' shared parts -> runtime -> the families -> engine/server -> CLI (DESIGN.md's
order, with the step runner between the building blocks it calls and the families that are built on it).

The graph is read from the source with the standard library's ``ast`` (nothing is imported): absolute and relative
``import`` / ``from ... import`` statements, at module level AND inside functions (a function-level import is
still an edge: it runs whenever the function does, and a cycle through one only waits for the first call).
Imports under ``if TYPE_CHECKING:`` are left out: they never run. ``importlib.import_module`` calls (models/base.py
loads the family modules that way) are not statements and are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "moestream"

#: Each module's rank in the one-way order; a module may import its own rank or a lower one. A module is matched
#: by its longest listed prefix (``moestream.experts`` covers ``moestream.experts.pool``). A new module must be
#: placed here: the test names it otherwise.
RANKS: dict[str, int] = {
    # 0 parsing/format: the file, the numerics, output files, memory arithmetic -- imports nothing above it
    "moestream": 0, "moestream.errors": 0, "moestream.gguf": 0, "moestream.quant": 0, "moestream.kernels": 0,
    "moestream.ops": 0, "moestream.gpu": 0, "moestream.memcap": 0, "moestream.telemetry": 0,
    "moestream.tokenizer": 0, "moestream.output": 0, "moestream.budget": 0, "moestream.limits": 0,
    # 1 experts: layout, slot pools, policies, reader, the grouped MoE call, routing traces
    "moestream.experts": 1,
    # the options' values and their one check (LoadOptions, SamplingParams): the experts' checks below them
    "moestream.params": 1,
    # 2 the models' shared parts: weights, norms, RoPE, attention, KV caches, routing functions
    "moestream.models.layers": 2, "moestream.models.routing": 2,
    # 3 runtime: the step runner (steps over batches of sequences, CUDA graphs); calls the families' methods
    "moestream.runtime": 3,
    # 4 models: MoEModel (which owns a runner) and the families
    "moestream.models": 4,
    # 5 engine/server: generation, chat, the server and its batch scheduler, verify, the run trace, replay, report
    "moestream.engine": 5, "moestream.textgen": 5, "moestream.chat": 5, "moestream.server": 5, "moestream.batching": 5,
    "moestream.verify": 5, "moestream.runtrace": 5, "moestream.replay": 5, "moestream.report": 5,
    # constrained sampling (llguidance) and the tool-call syntaxes: used by the server and run
    "moestream.structured": 5, "moestream.toolcalls": 5,
    # 6 CLI: the commands and what they share
    "moestream.options": 6, "moestream.llamaflags": 6, "moestream.chat_templates": 6,
    "moestream.bench": 6, "moestream.cli": 6, "moestream.__main__": 6,
}


def module_name(path: Path, src: Path = SRC) -> str:
    """``src/moestream/experts/pool.py`` -> ``moestream.experts.pool``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import statement in ``tree`` (module ``name``)."""
    found: list[tuple[str, int]] = []

    def add(target: str, line: int) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            found.append((target, line))

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:  # ``from pkg import sub``: the submodule is what is imported
                sub = f"{mod}.{alias.name}"
                add(sub if sub in modules else mod, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line} over every ``.py`` under ``src/moestream``."""
    files = sorted((src / PACKAGE).rglob("*.py"))
    modules = {module_name(f, src) for f in files}
    graph: dict[str, dict[str, int]] = {}
    for f in files:
        name = module_name(f, src)
        edges: dict[str, int] = {}
        for target, line in imports_of(ast.parse(f.read_text(), str(f)), name, f.name == "__init__.py", modules):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search, modules in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def rank(module: str) -> int | None:
    """The rank of ``module`` in :data:`RANKS` (its longest listed prefix), or None when it is not placed."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        r = RANKS.get(".".join(parts[:n]))
        if r is not None:
            return r
    return None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """``"a (rank 1) imports b (rank 2) at line N"`` for every import of a module ranked above the importer."""
    bad = []
    for mod, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            if rank(target) is not None and rank(mod) is not None and rank(target) > rank(mod):
                bad.append(f"{mod} (rank {rank(mod)}) imports {target} (rank {rank(target)}) at line {line}")
    return bad


def describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``"a (line N) -> b (line M) -> a"``: each module of ``cycle`` with the line of its import of the next."""
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([*steps, cycle[-1]])


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "moestream.models.base" in graph["moestream.engine"]  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + describe_cycle(graph, cycle)


def test_every_module_is_ranked():
    unplaced = [m for m in import_graph() if rank(m) is None]
    assert not unplaced, f"modules missing from test_imports.RANKS (place each in the one-way order): {unplaced}"


def test_no_module_imports_one_above_it():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the one-way order of DESIGN.md:\n" + "\n".join(bad)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("importer", ["from ..a import f\n", "def g():\n    from .. import a\n",
                                      "def g():\n    import moestream.a\n"])
def test_the_checks_can_fail(tmp_path, importer):
    """A cycle through a function-level or module-level, relative or absolute import is found and named; so is an
    import of a higher rank."""
    src = _write(tmp_path, {"__init__.py": "", "a.py": "from .experts.b import x\n",
                            "experts/__init__.py": "", "experts/b.py": importer})
    graph = import_graph(src)
    line = 1 if importer.startswith("from") else 2
    assert graph["moestream.experts.b"] == {"moestream.a": line}
    cycle = find_cycle(graph)
    assert describe_cycle(graph, cycle) == f"moestream.a (line 1) -> moestream.experts.b (line {line}) -> moestream.a"
    saved = dict(RANKS)
    try:
        RANKS["moestream.a"] = 4
        assert upward_imports(graph) == [f"moestream.experts.b (rank 1) imports moestream.a (rank 4) at line {line}"]
    finally:
        RANKS.clear()
        RANKS.update(saved)


def test_type_checking_imports_are_not_edges(tmp_path):
    src = _write(tmp_path, {"__init__.py": "", "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from .b import x\n", "b.py": "from .a import y\n"})
    assert find_cycle(import_graph(src)) is None
