"""Imports inside snip_ds run one way and never reach for another module's private names.

Read from the source with ``ast`` (nothing is imported), for every module under ``snip_ds/`` (research code in
``snip_ds/experiments/`` included). What counts:

* **An import** is every ``import`` / ``from ... import`` statement of a module, wherever it stands: at the top,
  inside a function (a lazy import), or under ``if TYPE_CHECKING:`` (a type-only import). Relative imports are
  resolved against the module's package. ``import snip_ds.a.b`` and ``from snip_ds.a import b`` (``b`` a module
  of ``snip_ds/a/``) are an edge to ``snip_ds.a.b``; ``from snip_ds.a import name`` (``name`` not a module) an
  edge to ``snip_ds.a``. A package's ``__init__`` that a submodule import runs on the way is not an edge of the
  importing module (Python's packages import their parents regardless of direction), and names a package
  loads through ``importlib.import_module`` strings (the lazy ``__getattr__`` of ``snip_ds`` and
  ``snip_ds.planner``) are not statements, so not edges.
* **An import circle** is a cycle in that graph: modules that import each other, directly or through others.
* **A private name** is one with a leading underscore that is not a dunder (``_helper``, not ``__version__``),
  taken from another snip_ds module: ``from snip_ds.x import _name``, or ``alias._name`` where ``alias`` is bound
  by an import of a snip_ds module (``from snip_ds.engine import checkpoint as ckpt; ckpt._helper()``). A
  module's own private names are its own business; tests may use private names.

:data:`ALLOWED_CYCLES` and :data:`ALLOWED_PRIVATE` list what is known and owned by a change under way in the
modules it names; each entry says why, and goes when that change lands.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "snip_ds"

# Cycles (as the sorted tuple of the modules on them) allowed for now.
ALLOWED_CYCLES: Set[Tuple[str, ...]] = set()

# (importing module, providing module, private name) allowed for now.
ALLOWED_PRIVATE: Set[Tuple[str, str, str]] = set()


def module_files(root: Path = ROOT, package: str = PACKAGE) -> Dict[str, Path]:
    """``{dotted name: path}`` of every module of ``package`` under ``root`` (a package by its ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str, path: Path, modules: Dict[str, Path], package: str = PACKAGE
            ) -> Iterator[Tuple[str, int, str | None]]:
    """``(imported module, line, private name or None)`` for each snip_ds module ``name`` imports (see the
    module docstring), plus one entry per private name it takes from another snip_ds module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases: Dict[str, str] = {}  # a local name bound to a snip_ds module -> that module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == package or a.name.startswith(package + "."):
                    yield a.name, node.lineno, None
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against this module's package
                anchor = _package_of(name, path).split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base != package and not base.startswith(package + "."):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    yield sub, node.lineno, None
                    aliases[a.asname or a.name] = sub
                else:
                    yield base, node.lineno, a.name if _private(a.name) else None
    for node in ast.walk(tree):  # alias._name, alias bound to a snip_ds module
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            yield aliases[node.value.id], node.lineno, node.attr


def import_graph(root: Path = ROOT, package: str = PACKAGE
                 ) -> Tuple[Dict[str, Set[str]], List[Tuple[str, str, str, int]]]:
    """The graph ``{module: modules it imports}`` (see the module docstring) and the private names taken across
    modules as ``(importer, provider, name, line)``."""
    modules = module_files(root, package)
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, line, priv in imports(name, path, modules, package):
            if target != name and target in modules:
                graph[name].add(target)
            if priv is not None and target != name:
                private.append((name, target, priv, line))
    return graph, private


def cycles(graph: Dict[str, Set[str]]) -> List[Tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple, plus modules
    that import themselves."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[Tuple[str, ...]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (about 100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _cycle_path(graph: Dict[str, Set[str]], comp: Tuple[str, ...]) -> str:
    """One cycle through the component's first module, for the failure message: ``a -> b -> a``."""
    members, start = set(comp), comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return " -> ".join(list(reversed(path)) + [start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " -> ".join(comp)


# ------------------------------------------------------------------ the checks on snip_ds


def test_no_import_circle_inside_snip_ds():
    graph, _ = import_graph()
    found = cycles(graph)
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "import circle(s) inside snip_ds: " + "; ".join(_cycle_path(graph, c) for c in new)
    stale = ALLOWED_CYCLES - set(found)
    assert not stale, f"ALLOWED_CYCLES lists circle(s) that no longer exist; remove them: {sorted(stale)}"


def test_no_private_name_taken_from_another_snip_ds_module():
    _, private = import_graph()
    new = sorted({f"{a}:{line} takes {b}.{n}" for a, b, n, line in private if (a, b, n) not in ALLOWED_PRIVATE})
    assert not new, ("private name(s) used across modules (make them public where they belong): "
                     + "; ".join(new))
    stale = ALLOWED_PRIVATE - {(a, b, n) for a, b, n, _ in private}
    assert not stale, f"ALLOWED_PRIVATE lists use(s) that no longer exist; remove them: {sorted(stale)}"


# ------------------------------------------------------------------ the checks themselves can fail


def _package(tmp_path: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "snip_ds" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_walk_sees_every_module():
    names = set(module_files())
    assert {"snip_ds", "snip_ds.planner", "snip_ds.planner.ilp", "snip_ds.engine.core", "snip_ds.stats.collector",
            "snip_ds.experiments"} <= names


def test_circles_through_type_only_function_level_and_relative_imports_are_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from snip_ds.b import B\n",
        "b.py": "def f():\n    from . import c\n",
        "c.py": "import snip_ds.a as a\n",
        "d.py": "from snip_ds import a\n",   # imports the circle, is not on it
        "e.py": "from snip_ds.e import x\n",  # a module importing itself is not a circle
        "pkg/__init__.py": "from snip_ds.pkg import f\n",
        "pkg/f.py": "from snip_ds.pkg import g\n",  # g is not a module: an edge to the package, which imports f
    })
    graph, _ = import_graph(root)
    assert graph["snip_ds.a"] == {"snip_ds.b"} and graph["snip_ds.b"] == {"snip_ds.c"}
    assert graph["snip_ds.d"] == {"snip_ds.a"} and graph["snip_ds.e"] == set()
    assert cycles(graph) == [("snip_ds.a", "snip_ds.b", "snip_ds.c"), ("snip_ds.pkg", "snip_ds.pkg.f")]
    assert _cycle_path(graph, ("snip_ds.a", "snip_ds.b", "snip_ds.c")) == \
        "snip_ds.a -> snip_ds.b -> snip_ds.c -> snip_ds.a"


def test_private_names_across_modules_are_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "__version__ = '1'\n",
        "a.py": "def _helper(): pass\n_CONST = 1\n",
        "b.py": "from snip_ds.a import _helper\n",                      # imported
        "c.py": "def f():\n    from snip_ds import a as m\n    return m._CONST\n",  # through a module alias
        "d.py": "import snip_ds.a\nx = snip_ds.a\nfrom snip_ds import __version__\n",  # dunder: public
        "e.py": "from .a import _CONST\n",                              # relative
    })
    _, private = import_graph(root)
    assert sorted((a, b, n) for a, b, n, _ in private) == [
        ("snip_ds.b", "snip_ds.a", "_helper"), ("snip_ds.c", "snip_ds.a", "_CONST"),
        ("snip_ds.e", "snip_ds.a", "_CONST")]
