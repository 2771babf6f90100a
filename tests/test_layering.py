"""The import graph, in one table: which module group may import which (DESIGN.md contract 8). An AST scan of every
module of the project's packages, lazy imports inside functions and ``TYPE_CHECKING`` blocks included, fails
naming the file, line and import of any edge the table does not allow.

To add an edge, add it to ``ALLOWED`` and say why in the commit; a new entry in ``KNOWN_VIOLATIONS`` needs an issue.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Module groups, most specific prefix first: a module belongs to the first group whose prefix it has.
GROUPS: tuple[tuple[str, str], ...] = (
    ("specd_api", "specd_api"),  # the leaf: wire contract (generated stubs), shared types and errors, lifecycle
    ("specd_client", "client"),  # the torch-free client library a worker links to talk to the controller
    ("controller", "controller"),  # the controller daemon and its commands
    ("decoder.worker", "worker"),  # the HTTP decode worker
    ("decoder", "engine"),  # the engine: models, drafters, the decode loop
    ("distill", "distill"),  # training a draft from its target (`specd distill`), and the trainers' LR schedule
    ("specd", "cli"),  # the `specd` command, the demo, the launcher: on top, nothing imports it
    ("workloads", "workloads"),  # the segment workloads (data); build.py regenerates them from the reference corpus
    ("refmodels", "refmodels"),  # training the reference pair (tooling)
)

# THE TABLE: group -> the groups it may import (its own is always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "specd_api": frozenset(),
    "client": frozenset({"specd_api"}),
    "controller": frozenset({"specd_api"}),
    "engine": frozenset({"specd_api"}),
    "worker": frozenset({"engine", "client", "specd_api"}),
    "distill": frozenset({"engine", "specd_api"}),
    "refmodels": frozenset({"distill"}),  # the LR schedule only (distill.schedules); not the engine
    "workloads": frozenset({"refmodels"}),
    "cli": frozenset({"specd_api", "client", "controller", "engine", "worker", "workloads", "refmodels", "distill"}),
}

# Third-party packages a group must not import: the base install (specd_api, the client, the controller) has
# neither the worker extra nor the demo's; the engine and the worker do not need the demo's.
WORKER_EXTRA = frozenset({"torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "starlette"})
DEMO_EXTRA = frozenset({"rich", "matplotlib", "httpx"})
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "specd_api": WORKER_EXTRA | DEMO_EXTRA,
    "client": WORKER_EXTRA | DEMO_EXTRA,
    "controller": WORKER_EXTRA | DEMO_EXTRA,
    "engine": DEMO_EXTRA,
    "worker": DEMO_EXTRA,
    "distill": DEMO_EXTRA,
}

# Imports the table forbids that the code still has, each (file, imported module) with its issue; none today. An entry
# that is no longer needed fails test_known_violations_are_still_there, so this list only shrinks.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}

PROJECT = tuple(prefix for prefix, _ in GROUPS if "." not in prefix)


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository, e.g. "decoder/engine.py"
    line: int
    module: str  # the imported module, e.g. "controller.tracing"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module}"


def group_of(module: str) -> str | None:
    for prefix, group in GROUPS:
        if module == prefix or module.startswith(prefix + "."):
            return group
    return None


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every module ``path`` imports, wherever the statement is. ``from a import b`` imports ``a.b`` when that is a
    module, else ``a``; relative imports are resolved; ``importlib.import_module("x")`` counts too."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    relative = str(path.relative_to(root))
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(relative, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield Import(relative, node.lineno, sub if is_module(sub, root) else base)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(relative, node.lineno, node.args[0].value)


def project_modules(root: Path) -> list[Path]:
    return sorted(path for package in PROJECT for path in (root / package).rglob("*.py"))


def all_imports(root: Path) -> list[Import]:
    return [imp for path in project_modules(root) for imp in imports_of(path, root)]


def forbidden_edges(root: Path) -> list[str]:
    """Each import the table does not allow, as 'file:line: module (group -> group; group may import: ...)'."""
    found = []
    for imp in all_imports(root):
        source = group_of(module_name(root / imp.path, root))
        target = group_of(imp.module)
        assert source is not None, f"{imp.path} is in no group: add its package to GROUPS"
        if target is None or target == source or target in ALLOWED[source]:
            continue
        if (imp.path, imp.module) in KNOWN_VIOLATIONS:
            continue
        allowed = ", ".join(sorted(ALLOWED[source])) or "nothing of the project"
        found.append(f"{imp} ({source} -> {target}; {source} may import: {allowed})")
    return list(dict.fromkeys(found))  # `from a import b, c` is one line


def test_every_import_is_an_edge_the_table_allows():
    assert project_modules(REPO), "no modules found: is REPO the repository root?"
    offending = forbidden_edges(REPO)
    assert not offending, "imports the layering table (tests/test_layering.py) forbids:\n" + "\n".join(offending)


def test_specd_api_imports_nothing_of_the_project():
    own = [imp for imp in all_imports(REPO) if imp.path.startswith("specd_api/")]
    assert own, "specd_api has no imports at all? the scan is broken"
    outside = [str(imp) for imp in own if group_of(imp.module) not in (None, "specd_api")]
    assert not outside, "specd_api is the leaf; it imports:\n" + "\n".join(outside)


def test_nothing_imports_the_cli_and_the_table_has_no_cycles():
    assert not [group for group, allowed in ALLOWED.items() if "cli" in allowed]
    assert set(ALLOWED) == {group for _, group in GROUPS}
    state: dict[str, str] = {}

    def visit(group: str, path: tuple[str, ...]) -> None:
        assert state.get(group) != "open", f"the table has a cycle: {' -> '.join((*path, group))}"
        if state.get(group) == "done":
            return
        state[group] = "open"
        for target in ALLOWED[group]:
            visit(target, (*path, group))
        state[group] = "done"

    for group in ALLOWED:
        visit(group, ())


def test_the_base_install_groups_import_no_package_of_the_extras():
    offending = []
    for imp in all_imports(REPO):
        source = group_of(module_name(REPO / imp.path, REPO))
        if source is not None and imp.module.partition(".")[0] in FORBIDDEN_THIRD_PARTY.get(source, frozenset()):
            offending.append(f"{imp} ({source} may not import it)")
    assert not offending, "\n".join(offending)


def test_known_violations_are_still_there():
    imports = {(imp.path, imp.module) for imp in all_imports(REPO)}
    fixed = [f"{path}: {module}" for path, module in KNOWN_VIOLATIONS if (path, module) not in imports]
    assert not fixed, "fixed, so remove from KNOWN_VIOLATIONS in tests/test_layering.py:\n" + "\n".join(fixed)


@pytest.mark.parametrize(
    ("module", "group"),
    [
        ("specd_api.v1.controller_pb2", "specd_api"),
        ("specd_api.position_tally", "specd_api"),  # the one tally: the engine and the client both count with it
        ("specd_api.round_policy", "specd_api"),  # the one "K for this round": torch-free, any worker runs it
        (
            "controller.storage.redis_schema",
            "controller",
        ),  # the daemon's own: neither the client nor the engine names fields
        ("specd", "cli"),  # a prefix match on "specd" must not take specd_api's modules
        ("specd.demo.run", "cli"),
        ("specd_client.client", "client"),
        ("specd_clients", None),  # a dotted prefix, not a string one: no group of ours
        ("controller", "controller"),
        ("decoder.worker.service", "worker"),
        ("decoder", "engine"),
        ("distill.trainer", "distill"),  # training sits beside refmodels, outside the engine
        ("distill.schedules", "distill"),  # refmodels' one import of it
        ("decoder.runners.select", "engine"),  # the forward passes are the engine's: no edge of their own
        ("torch", None),
    ],
)
def test_modules_fall_in_the_right_group(module: str, group: str | None):
    assert group_of(module) == group


def test_a_lazy_relative_or_dynamic_import_is_seen(tmp_path: Path):
    (tmp_path / "decoder" / "worker").mkdir(parents=True)
    for name in ("decoder/__init__.py", "decoder/worker/__init__.py", "decoder/worker/app.py", "decoder/sampling.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "decoder" / "engine.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sampling\n"
        "from .worker import app\n"
        "if TYPE_CHECKING:\n    import specd\n"
        "def later():\n    import specd_client\n    __import__('refmodels')\n"
    )
    found = [str(imp) for imp in imports_of(tmp_path / "decoder" / "engine.py", tmp_path)]
    assert sorted(found) == [
        "decoder/engine.py:1: __future__",
        "decoder/engine.py:2: typing",
        "decoder/engine.py:3: decoder.sampling",
        "decoder/engine.py:4: decoder.worker.app",
        "decoder/engine.py:6: specd",
        "decoder/engine.py:8: specd_client",
        "decoder/engine.py:9: refmodels",
    ]
