"""The package's import rules, read from the source with ``ast`` (no import runs).

* ``raysync/`` never imports the actors package (``actors/``, installed as
  ``raysync.actors``), not even inside a function: the library finds actor classes by
  role through entry points (:mod:`raysync.actor_classes`).
* No module imports another module's private (``_``-prefixed) names.
* The import graph of ``raysync`` modules has no cycle, counting function-level imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "raysync"
ACTORS = ROOT / "actors"


def _module_name(path: Path) -> str:
    if path.is_relative_to(ACTORS):
        parts = ("raysync", "actors", *path.relative_to(ACTORS).with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module imported, names taken from it) for every import statement in ``path``
    that runs (those under ``if TYPE_CHECKING:`` only inform the type checker)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


SOURCES = sorted([*LIBRARY.rglob("*.py"), *ACTORS.rglob("*.py")])


@pytest.mark.parametrize("path", sorted(LIBRARY.rglob("*.py")), ids=lambda p: p.name)
def test_the_library_never_imports_the_actors_package(path):
    for module, names in _imports(path):
        imported = [module, *(f"{module}.{n}" for n in names)]
        offending = [m for m in imported if m.split(".")[0] == "actors" or "raysync.actors" in m]
        assert not offending, f"{path.relative_to(ROOT)} imports {offending}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_private_names_of_another(path):
    for module, names in _imports(path):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{path.relative_to(ROOT)} imports {private} from {module}"


TESTS = sorted((ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", TESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_never_import_other_test_modules_or_conftest(path):
    """Shared test code lives in tests/helpers.py and tests/receivers.py."""
    for module, _ in _imports(path):
        leaf = module.split(".")[-1]
        assert not (
            module.startswith("tests.") and (leaf.startswith("test_") or leaf == "conftest")
        ), f"{path.relative_to(ROOT)} imports {module}: move what it shares to tests/helpers.py"


def test_the_library_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for path in LIBRARY.rglob("*.py"):
        name = _module_name(path)
        edges = graph.setdefault(name, set())
        for module, names in _imports(path):
            for target in (module, *(f"{module}.{n}" for n in names)):
                if target.startswith("raysync") and target != name:
                    edges.add(target)
    modules = set(graph)
    graph = {m: {t for t in targets if t in modules} for m, targets in graph.items()}
    # Importing a submodule runs its package's __init__ first: parent edges are implied.
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(module: str, path: list[str]) -> bool:
        state[module] = 1
        for target in sorted(graph[module]):
            if target.startswith(module + "."):
                continue  # a package importing its own submodule is not a circle back
            if state.get(target) == 1:
                cycle.extend([*path, module, target])
                return True
            if state.get(target) is None and visit(target, [*path, module]):
                return True
        state[module] = 2
        return False

    for module in sorted(graph):
        if state.get(module) is None and visit(module, []):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_every_package_is_listed_for_installation():
    """A package missing from pyproject's list would be left out of a wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in LIBRARY.rglob("__init__.py")}
    assert found | {"raysync.actors"} == listed, (sorted(found), sorted(listed))
