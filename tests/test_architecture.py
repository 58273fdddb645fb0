"""The house keeps its shape (docs/architecture.md): imports follow the layers, no import circle, no module over 800 lines,
and the architecture page's picture names the modules that exist.

Imports are read from the source (``ast``), function-level ones included: a lazy import is still a dependency, and a
circle of lazy imports is still a circle (it only moves the failure from import time to call time). What a module runs
as a script (its ``if __name__ == "__main__":`` block) is an entry point above every layer and does not count.
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
              "nemo_factuality.trainers.interfaces", "nemo_factuality.trainers.data", "nemo_factuality.trainers.reference")


def _is_main_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside ``if __name__ == "__main__":`` blocks."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [n for n in tree.body if not _is_main_block(n)]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        stack.extend(child for child in ast.iter_child_nodes(node) if not _is_main_block(child))
    return out


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


def test_the_cycle_finder_finds_a_circle_of_lazy_imports(tmp_path):
    """The negative control: a circle made only of imports inside functions (as the stages ↔ CLI one was) is found, and
    a script entry block's import is not one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("def main():\n    from pkg.cli import run\n    return run()\n")
    (pkg / "cli.py").write_text("def run():\n    from pkg import stage\n    return stage\n")
    (pkg / "entry.py").write_text("X = 1\nif __name__ == '__main__':\n    from pkg.user import go\n")
    (pkg / "user.py").write_text("from pkg.entry import X\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert cycles(graph) == [["pkg.cli", "pkg.stage"]]
    assert "pkg.user" not in graph["pkg.entry"] and "pkg.entry" in graph["pkg.user"]


def test_the_package_has_no_import_circle():
    assert cycles(import_graph(module_files(PACKAGE, "nemo_factuality"))) == []


def test_the_tools_scripts_have_no_import_circle():
    """The GPU smoke kit is one kit: its phases share ``gpu_smoke_common`` and never import each other both ways."""
    tools = {name: path for name, path in module_files(REPO_ROOT / "tools", "").items()}
    assert {"gpu_smoke", "gpu_smoke_common", "gpu_smoke_megatron"} <= set(tools)
    assert cycles(import_graph(tools)) == []


def test_the_stages_reach_a_backend_only_through_the_interfaces_and_the_registry():
    graph = import_graph(module_files(PACKAGE, "nemo_factuality"))
    for module in STAGE_SIDE:
        backends = sorted(t for t in graph[module] if t.startswith("nemo_factuality.trainers.backends."))
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
    named = set(re.findall(r"\b((?:backends|engines)/[a-z_]+\.py)\b", page))
    present = {f"{path.parent.name}/{path.name}" for folder in ("backends", "engines")
               for path in (PACKAGE / "trainers" / folder).glob("*.py") if path.name != "__init__.py"}
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
