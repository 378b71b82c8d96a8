"""The training package never imports the research code in snip_ds/experiments/ (the reverse is allowed)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "snip_ds"
EXPERIMENTS = "snip_ds.experiments"


def _product_modules() -> dict:
    """``{module name: path}`` of every module of snip_ds outside snip_ds/experiments/, found on disk (no import)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(parts)
        if name != EXPERIMENTS and not name.startswith(EXPERIMENTS + "."):
            out[name] = path
    return out


def _experiments_references(name: str, path: Path) -> list:
    """The lines of ``path`` that import snip_ds.experiments or name it in a string (e.g. a lazy import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets = [node.value] if EXPERIMENTS in node.value else []
        if any(EXPERIMENTS in t for t in targets):
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_the_walk_sees_the_product_and_not_the_experiments():
    names = set(_product_modules())
    assert {"snip_ds", "snip_ds.planner", "snip_ds.cli", "snip_ds.engine.core", "snip_ds.run.trainer"} <= names
    assert not any(n.startswith(EXPERIMENTS) for n in names)


def test_the_walk_finds_an_import_of_the_experiments(tmp_path):
    # the check itself can fail: absolute, relative and string (lazy) references are all caught
    pkg = tmp_path / "snip_ds"
    pkg.mkdir()
    cases = {"a.py": "from snip_ds.experiments.paired import mean_se\n",
             "b.py": "from .experiments import runs\n",
             "c.py": "import importlib\nimportlib.import_module('snip_ds.experiments.grid')\n",
             "d.py": "import snip_ds.experiments\n"}
    for file, text in cases.items():
        (pkg / file).write_text(text)
        assert _experiments_references(f"snip_ds.{file[:-3]}", pkg / file), file
    (pkg / "e.py").write_text("from .planner import solve_plan\nimport snip_ds.plan\n")
    assert not _experiments_references("snip_ds.e", pkg / "e.py")


def test_no_product_module_refers_to_the_experiments():
    hits = [f"{name} ({h})" for name, path in _product_modules().items()
            for h in _experiments_references(name, path)]
    assert not hits, f"the training package refers to snip_ds.experiments at {hits}"


@pytest.mark.slow
def test_importing_the_whole_product_loads_no_experiments_module():
    names = sorted(_product_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m == {EXPERIMENTS!r} or m.startswith({EXPERIMENTS + '.'!r})))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
