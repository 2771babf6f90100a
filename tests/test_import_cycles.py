"""No file-level import cycles: no module of the project imports, directly or through others, a module that imports it
back. The scan is the layering test's (lazy imports inside functions and ``TYPE_CHECKING`` blocks included), so a
cycle hidden behind a function-level import or a type annotation counts as one: each is a pair of files that cannot be
read, moved or tested apart.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import REPO, all_imports, is_module, module_name


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's name stands for its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for imp in all_imports(root):
        source = module_name(root / imp.path, root)
        graph.setdefault(source, set())
        if imp.module != source and is_module(imp.module, root):
            graph[source].add(imp.module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            target = next(edges, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 100, "too few modules: is REPO the repository root?"
    found = cycles(graph)
    assert not found, (
        "file-level import cycles (break each: move what both need to a module of its own):\n"
        + "\n".join(" <-> ".join(component) for component in found)
    )


def test_the_scan_finds_a_cycle_through_a_lazy_import_and_one_through_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "specd_api"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from specd_api.b import g\n    return g\n")
    (package / "b.py").write_text("from specd_api.c import h\n\ndef g():\n    return h\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specd_api import a\n\ndef h(): ...\n"
    )
    (package / "d.py").write_text("from specd_api.e import x\n")
    (package / "e.py").write_text("from specd_api import d as y\nx = 1\n")
    (package / "leaf.py").write_text("from specd_api.a import f\n")
    found = cycles(import_graph(tmp_path))
    assert sorted(found) == [["specd_api.a", "specd_api.b", "specd_api.c"], ["specd_api.d", "specd_api.e"]]
