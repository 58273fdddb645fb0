"""pytest-xdist's ``loadfile`` scheduling with a lane for the test modules that mostly wait.

A module marked ``waits`` (``pytestmark = pytest.mark.waits``, alone or among other marks, on one line or several)
spends most of its time waiting on servers starting, timeouts or Slurm jobs, not computing: beside another module on
a two-core machine its worker's core sits idle. With three or more workers, the last one (``gwN``) takes those modules
first and every other worker the rest first, so the waits overlap the CPU-bound modules instead of taking a worker's
turn. The lanes are preferences, not fences: a worker whose own lane has nothing queued takes the other lane's next
module rather than shutting down, so neither lane's tail runs beside an idle worker.

Without a waiting module, or with fewer than three workers, it schedules exactly as ``--dist loadfile`` does. A
waiting lane's worker that crashes hands its lane back: the replacement and the other workers take any module.
tests/conftest.py installs it (``pytest_xdist_make_scheduler``) for ``--dist loadfile``.

pytest-xdist has no public hook to pick which queued unit a worker gets, so this subclasses ``LoadFileScheduling``
and relies on two of its internals: ``workqueue`` (the ordered scopes not yet handed out) and
``_assign_work_unit(node)`` (which hands out the queue's first scope). pyproject.toml's dev extra pins pytest-xdist
exactly for that; ``tests/test_xdist_lanes.py`` runs this scheduler under real xdist workers, so a release that moved
either fails there first.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadFileScheduling


def _is_waits_mark(node: ast.AST) -> bool:
    """``pytest.mark.waits`` or ``mark.waits`` (called or not)."""
    if isinstance(node, ast.Call):
        node = node.func
    if not (isinstance(node, ast.Attribute) and node.attr == "waits"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "mark") or (
        isinstance(owner, ast.Attribute) and owner.attr == "mark" and isinstance(owner.value, ast.Name)
        and owner.value.id == "pytest")


def marks_waits(source: str) -> bool:
    """Whether a module's top-level ``pytestmark`` (a mark, a list or tuple of marks, any layout) holds ``waits``.

    Read from the source (the scheduler runs where no test module is imported); a file that does not parse is not
    marked.

    >>> marks_waits("import pytest\\npytestmark = [\\n    pytest.mark.slow,\\n    pytest.mark.waits,\\n]\\n")
    True
    >>> marks_waits("pytestmark = pytest.mark.slow\\nx = pytest.mark.waits\\n")
    False
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and stmt.value is not None:
            if any(_is_waits_mark(node) for node in ast.walk(stmt.value)):
                return True
    return False


@cache
def module_waits(path: Path) -> bool:
    try:
        return marks_waits(path.read_text(errors="replace"))
    except OSError:
        return False


class LaneScheduling(LoadFileScheduling):
    """``loadfile``, except that with 3+ workers the last prefers the ``waits`` modules and the others the rest."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._root = Path(str(config.rootpath))
        self._lanes_decided = False
        self.waiting_node = None  # the worker of the waiting lane; None: one lane for all

    def _waits(self, scope: str) -> bool:
        return module_waits(self._root / scope)

    def _decide_lanes(self) -> None:
        """Once, when the first module is handed out (the queue holds every module then)."""
        self._lanes_decided = True
        waiting = sum(self._waits(scope) for scope in self.workqueue)
        if len(self.nodes) >= 3 and 0 < waiting < len(self.workqueue):
            self.waiting_node = max(self.nodes, key=lambda node: int(node.gateway.id.removeprefix("gw")))
            self.log(f"waiting lane: {waiting} modules on {self.waiting_node.gateway.id}")

    def _next_scope(self, node) -> str:
        """The first queued module of ``node``'s lane, else the other lane's first (the queue is not empty here)."""
        if self.waiting_node is None:
            return next(iter(self.workqueue))
        wanted = node is self.waiting_node
        return next((scope for scope in self.workqueue if self._waits(scope) == wanted), next(iter(self.workqueue)))

    def _assign_work_unit(self, node) -> None:
        if not self._lanes_decided:
            self._decide_lanes()
        scope = self._next_scope(node)
        self.workqueue.move_to_end(scope, last=False)  # the parent hands out the queue's first module
        super()._assign_work_unit(node)

    def remove_node(self, node):
        if node is self.waiting_node:  # crashed: any worker takes the waiting modules left
            self.waiting_node = None
        return super().remove_node(node)
