"""The layout shows the architecture, and imports run one way (the house style's habit 10).

Packages, lowest first: ``pallas_kernels`` (arrays in, arrays out) <- ``paged_jax`` <- ``models`` <-
``server`` <- ``experiments``. Inside ``paged_jax`` the rooms run the same way: the shared helpers at
the top level <- ``paging`` <- ``attention`` <- ``speculative`` <- ``tiers`` <- ``engine`` <- ``distributed``
<- ``simulator``. Experiment scripts import
``experiments.lib`` and never one another. Function-local imports count: an arrow hidden inside a
function is still an arrow.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "paged_jax", "models", "server", "experiments")
"""Lowest first: a module may import its own package or one to its left, never one to its right."""
PAGED_JAX_ROOMS = ("paging", "attention", "speculative", "tiers", "engine", "distributed", "simulator")
"""``paged_jax``'s sub-packages, lowest first; its top-level modules (checks, memory, ...) sit below them all."""
SCRIPT_TOPICS = ("memory", "serving", "kernels", "simulator")
MAX_MODULES_PER_FOLDER = 15


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The project modules ``name`` imports, anywhere in its body; ``from pkg import mod`` names the module."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _rank(module: str) -> tuple[int, int]:
    parts = module.split(".")
    room = 0
    if parts[0] == "paged_jax" and len(parts) > 1 and parts[1] in PAGED_JAX_ROOMS:
        room = 1 + PAGED_JAX_ROOMS.index(parts[1])
    return PACKAGES.index(parts[0]), room


def _is_script(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "experiments" and (
        (len(parts) == 3 and parts[1] in SCRIPT_TOPICS) or (len(parts) == 2 and parts[1] not in (*SCRIPT_TOPICS, "lib")))


def test_graph_sees_the_project():
    # The checks below would pass on an empty graph: make sure the walk found the modules and their arrows.
    assert len(MODULES) > 100
    assert "paged_jax.paging.page_state" in GRAPH["paged_jax.engine.kv_manager"]
    assert "paged_jax.attention.paged" in GRAPH["models.llama"]  # ``from paged_jax.attention import paged``
    assert "experiments.lib.online" in GRAPH["experiments.serving.serving_figures"]
    assert _is_script("experiments.serving.serve_sharegpt") and _is_script("experiments.train_tiny")
    assert not _is_script("experiments.lib.cli") and not _is_script("experiments.serving")


def test_imports_run_one_way():
    upward = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps if _rank(b) > _rank(a))
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_import_cycles():
    # Tarjan's strongly connected components over the module graph; a package's __init__ re-exporting its own
    # modules is not a cycle of concepts, so edges into a package from its own members are left out.
    def member_of(a: str, b: str) -> bool:
        return MODULES[b].name == "__init__.py" and a.startswith(b + ".")

    edges = {a: {b for b in deps if not member_of(a, b)} for a, deps in GRAPH.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_scripts_import_the_library_not_each_other():
    bad = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
                 if a.startswith("experiments.") and _is_script(b) and (_is_script(a) or a.startswith("experiments.lib")))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", sorted({str(p.parent.relative_to(ROOT)) for p in MODULES.values()
                                           if p.parts[len(ROOT.parts)] in ("paged_jax", "experiments")}))
def test_folders_stay_small(folder):
    modules = [p for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder} holds {len(modules)} modules: split it by concept"


def test_old_public_paths_still_import():
    # What researchers imported before the rooms existed keeps working through the packages' re-exports.
    from paged_jax.attention import paged_attention, xla_paged_attention  # noqa: F401
    from paged_jax.engine import Engine, EngineConfig, Request, SamplingParams  # noqa: F401


@pytest.mark.parametrize("line", ["tests/test_layout.py::test_x", "abc tests/test_layout.py::test_x",
                                  "12 not-a-node-id", "12 tests/a.py::b extra"])
def test_a_malformed_slow_list_line_is_named(tmp_path, monkeypatch, line):
    """tests/slow.txt (read by tests/conftest.py): a line that is not
    ``<seconds> <node id>`` stops the run naming the file and line; ``#``
    comments may end a line."""
    from tests import conftest

    path = tmp_path / "slow.txt"
    path.write_text(f"# header\n12 tests/a.py::b  # a comment\n   # indented comment\n{line}\n")
    monkeypatch.setattr(conftest, "SLOW_LIST", str(path))
    with pytest.raises(pytest.UsageError, match="slow.txt:4: expected '<seconds> <node id>'"):
        conftest._slow_nodes()
    path.write_text("12 tests/a.py::b  # a comment\n")
    assert conftest._slow_nodes() == {"tests/a.py::b": 12.0}
