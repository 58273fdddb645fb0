"""The house keeps its shape (docs/architecture.md): imports follow the layers, no import circle, no module over 800 lines,
and the architecture page's picture names the modules that exist.

Each training backend is a package of its own (``trainers/backends/<name>/``): one room, whose ``__init__`` imports
nothing (naming a backend loads none of its stack), reached by the stages only through the registry.

Imports are read from the source (``ast``), function-level ones and a module's ``if __name__ == "__main__":`` block
included: a lazy import is still a dependency, a circle of lazy imports is still a circle (it only moves the failure
from import time to call time), and a script block that imports a module importing its own module back is the circle
the stages' ``python -m`` entry and ``trainers/cli.py`` were (issue 54 item 7; the boundary they share,
``nemo_factuality.cli``, reaches each command by name).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from nemo_factuality.config import REPO_ROOT

PACKAGE = REPO_ROOT / "nemo_factuality"
MAX_LINES = 800
#: The stages and the building blocks they are made of: they talk to a backend only through the interfaces
#: (``trainers/interfaces.py``) and the registry (``trainers.backends``), never to one backend's module.
STAGE_SIDE = ("nemo_factuality.trainers.grpo", "nemo_factuality.trainers.ppo", "nemo_factuality.trainers.kto",
              "nemo_factuality.trainers.runtime", "nemo_factuality.trainers.parallel", "nemo_factuality.trainers.scoring",
              "nemo_factuality.trainers.interfaces", "nemo_factuality.trainers.data", "nemo_factuality.trainers.reference",
              "nemo_factuality.trainers.rollouts_ahead")
BACKENDS_DIR = PACKAGE / "trainers" / "backends"
REGISTRY = "nemo_factuality.trainers.backends"
#: One package per backend (its room); the modules beside them in ``backends/`` are shared.
BACKEND_PACKAGES = ("aligner", "hf", "megatron")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (functions and ``if __name__ == "__main__":`` blocks included)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def module_files(root: Path, prefix: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` under ``root`` (a package's ``__init__`` is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([prefix, *parts]) if prefix else ".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the modules of ``modules`` it imports}``; ``from pkg import name`` counts ``pkg.name`` when that is a
    module, else ``pkg``; relative imports resolved."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def test_the_cycle_finder_finds_a_circle_of_lazy_imports_and_of_script_blocks(tmp_path):
    """The negative control: a circle made only of imports inside functions (as the stages ↔ CLI one was) is found, and
    so is one closed by a script entry block (as the stages' ``python -m`` blocks ↔ ``trainers/cli.py`` one was, which
    the finder did not see while it left those blocks out); an entry block that goes through a dispatcher importing
    nothing of its own is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("def main():\n    from pkg.cli import run\n    return run()\n")
    (pkg / "cli.py").write_text("def run():\n    from pkg import stage\n    return stage\n")
    (pkg / "entry.py").write_text("X = 1\nif __name__ == '__main__':\n    from pkg.user import go\n")
    (pkg / "user.py").write_text("from pkg.entry import X\n")
    (pkg / "boundary.py").write_text("import importlib\ndef main(name):\n    return importlib.import_module(name)\n")
    (pkg / "other.py").write_text("if __name__ == '__main__':\n    from pkg.boundary import main\n    main('pkg.user')\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert cycles(graph) == [["pkg.cli", "pkg.stage"], ["pkg.entry", "pkg.user"]]
    assert graph["pkg.other"] == {"pkg.boundary"} and graph["pkg.boundary"] == set()


def test_the_package_has_no_import_circle():
    assert cycles(import_graph(module_files(PACKAGE, "nemo_factuality"))) == []


def test_the_tools_scripts_have_no_import_circle():
    """The GPU smoke kit is one kit: its phases share ``gpu_smoke_common`` and never import each other both ways."""
    tools = {name: path for name, path in module_files(REPO_ROOT / "tools", "").items()}
    assert {"gpu_smoke", "gpu_smoke_common", "gpu_smoke_megatron"} <= set(tools)
    assert cycles(import_graph(tools)) == []


def room(module: str) -> str:
    """The room a module lives in: a backend's package for any of its modules, else the module itself."""
    parts = module.split(".")
    depth = len(REGISTRY.split("."))
    if module.startswith(REGISTRY + ".") and parts[depth] in BACKEND_PACKAGES:
        return ".".join(parts[: depth + 1])
    return module


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each backend package collapsed into one node (its room)."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    return out


def test_each_backend_is_a_package_the_registry_names():
    packages = sorted(p.parent.name for p in BACKENDS_DIR.glob("*/__init__.py"))
    assert packages == sorted(BACKEND_PACKAGES)
    from nemo_factuality.trainers.backends import BACKENDS

    assert sorted(BACKENDS.names()) == sorted(BACKEND_PACKAGES)


def test_a_backend_packages_init_imports_nothing():
    """The lazy-import design: ``import nemo_factuality.trainers.backends.<name>`` loads none of the backend's stack,
    so the package's ``__init__`` holds a docstring and no import (not even a re-export of its modules)."""
    for name in BACKEND_PACKAGES:
        tree = ast.parse((BACKENDS_DIR / name / "__init__.py").read_text(encoding="utf-8"))
        imports = [ast.unparse(node) for node in _imports(tree)
                   if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
        assert imports == [], f"backends/{name}/__init__.py imports {imports}"


def test_the_rooms_have_no_import_circle():
    """With each backend package taken as one room, no circle either: one backend may use another's module (megatron
    uses hf's sampled distribution), never both ways."""
    graph = room_graph(import_graph(module_files(PACKAGE, "nemo_factuality")))
    assert {room(f"{REGISTRY}.{name}.actor") for name in BACKEND_PACKAGES} <= set(graph)
    assert cycles(graph) == []


def test_the_room_graph_collapses_a_backend_package():
    """The negative control: two backend packages that import each other's modules are one circle of rooms even
    though no module circle exists."""
    graph = {f"{REGISTRY}.hf.actor": {f"{REGISTRY}.megatron.memory"},
             f"{REGISTRY}.megatron.memory": set(),
             f"{REGISTRY}.megatron.actor": {f"{REGISTRY}.hf.actor"}}
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [[f"{REGISTRY}.hf", f"{REGISTRY}.megatron"]]


def test_the_stages_reach_a_backend_only_through_the_interfaces_and_the_registry():
    graph = import_graph(module_files(PACKAGE, "nemo_factuality"))
    for module in STAGE_SIDE:
        backends = sorted(t for t in graph[module] if t.startswith(REGISTRY + "."))
        assert backends == [], f"{module} imports a backend's module: {backends}"


def test_the_product_does_not_import_the_test_kit():
    """``nemo_factuality.testing`` serves the tests; a command that imported it would ship test stand-ins."""
    graph = import_graph(module_files(PACKAGE, "nemo_factuality"))
    users = {name: sorted(t for t in targets if t.startswith("nemo_factuality.testing"))
             for name, targets in graph.items() if not name.startswith("nemo_factuality.testing")}
    assert {name: kit for name, kit in users.items() if kit} == {}


def test_no_module_is_over_800_lines():
    long = {name: n for name, path in module_files(PACKAGE, "nemo_factuality").items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_the_architecture_page_names_every_backend_module_and_only_those_that_exist():
    page = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b((?:backends|engines)/(?:[a-z_]+/)?[a-z_]+\.py)\b", page))
    present = {path.relative_to(PACKAGE / "trainers").as_posix() for folder in ("backends", "engines")
               for path in (PACKAGE / "trainers" / folder).rglob("*.py") if path.name != "__init__.py"}
    assert named == present, (sorted(present - named), sorted(named - present))


def _message_strings(tree: ast.Module) -> list[str]:
    """String constants a module can show a user (docstrings and other bare expression statements excluded)."""
    bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare]


def test_no_user_facing_message_points_into_the_test_kit():
    """``nemo_factuality.testing`` is the tests' kit: a message of the product never sends a user there."""
    offenders = {name: hits for name, path in module_files(PACKAGE, "nemo_factuality").items()
                 if not name.startswith("nemo_factuality.testing")
                 and (hits := [s for s in _message_strings(ast.parse(path.read_text(encoding="utf-8")))
                               if "nemo_factuality.testing" in s or "nemo_factuality/testing" in s])}
    assert offenders == {}
    tree = ast.parse('"""docstring: nemo_factuality.testing is fine here"""\nX = "see nemo_factuality.testing.x"\n')
    assert _message_strings(tree) == ["see nemo_factuality.testing.x"]  # the check sees a message, not a docstring
