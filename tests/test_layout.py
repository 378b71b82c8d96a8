"""The folders of snip_ds import one way: each folder only imports folders below it and the modules left directly
in snip_ds/, and the graph of folders and top-level modules has no circle (type-only and lazy imports included).

Read from the source with the graph of tests/test_imports.py (nothing imported). A node is a folder of snip_ds
(``snip_ds/engine/``) or a module directly in it (``snip_ds/plan.py``); an edge runs from a node to one it imports.
"""
from test_imports import cycles, import_graph

# bottom to top: a folder may import the folders before it, never one after it
FOLDERS = ['runtime', 'backend', 'layouts', 'experts', 'stats', 'planner', 'config', 'report', 'engine', 'run', 'hf', 'export', 'families', 'experiments']
# at most this many modules directly in snip_ds/ (__init__ and cli included)
MAX_TOP_LEVEL = 15


def node_graph():
    graph, _ = import_graph()
    nodes = {}
    for module, targets in graph.items():
        a = module.split(".")[1] if "." in module else "__init__"
        for t in targets:
            b = t.split(".")[1] if "." in t else "__init__"
            if a != b and a != "__init__" and b != "__init__":
                nodes.setdefault(a, set()).add(b)
        nodes.setdefault(a, set())
    return nodes


def test_no_circle_between_folders_and_top_level_modules():
    graph = node_graph()
    assert not cycles(graph), f"circle(s) between folders / top-level modules: {cycles(graph)}"


def test_folders_import_one_way():
    graph = node_graph()
    rank = {f: i for i, f in enumerate(FOLDERS)}
    wrong = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                   if a in rank and b in rank and rank[b] > rank[a])
    assert not wrong, "folder(s) importing a folder above them: " + "; ".join(wrong)


def test_every_folder_is_placed():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "snip_ds"
    folders = {p.parent.name for p in root.glob("*/__init__.py")}
    assert folders <= set(FOLDERS), f"folders missing from FOLDERS: {sorted(folders - set(FOLDERS))}"


def test_few_modules_directly_in_the_package():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "snip_ds"
    top = sorted(p.stem for p in root.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly in snip_ds/ (at most {MAX_TOP_LEVEL}): {top}"
