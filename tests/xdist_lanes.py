"""pytest-xdist's ``loadfile`` scheduling with a lane for the test modules that mostly wait.

A module marked ``waits`` (``pytestmark = pytest.mark.waits``) spends most of its time waiting on servers starting,
timeouts or Slurm jobs, not computing: beside another module on a two-core machine its worker's core sits idle. With
three or more workers, the last one (``gwN``) takes only those modules and every other worker takes only the rest,
so the waits overlap the CPU-bound modules instead of taking a worker's turn. The CPU-bound modules still run two at
a time, and a waiting module competes with them only for the CPU it does use.

Without a waiting module, or with fewer than three workers, it schedules exactly as ``--dist loadfile`` does. A
waiting lane's worker that crashes hands its lane back: the replacement and the other workers take any module.
tests/conftest.py installs it (``pytest_xdist_make_scheduler``) for ``--dist loadfile``.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

#: How a module says it mostly waits, read from its text (the scheduler runs where no test module is imported).
WAITS_MARK = re.compile(r"^pytestmark = .*\bpytest\.mark\.waits\b", re.M)


@cache
def module_waits(path: Path) -> bool:
    try:
        return WAITS_MARK.search(path.read_text(errors="replace")) is not None
    except OSError:
        return False


class LaneScheduling(LoadFileScheduling):
    """``loadfile``, except that with 3+ workers the last takes the ``waits`` modules and the others the rest."""

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

    def _next_scope(self, node) -> str | None:
        """The first queued module of ``node``'s lane."""
        if self.waiting_node is None:
            return next(iter(self.workqueue), None)
        wanted = node is self.waiting_node
        return next((scope for scope in self.workqueue if self._waits(scope) == wanted), None)

    def _assign_work_unit(self, node) -> None:
        if not self._lanes_decided:
            self._decide_lanes()
        scope = self._next_scope(node)
        if scope is None:  # its lane is empty
            node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)  # the parent hands out the queue's first module
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self._lanes_decided and self._next_scope(node) is None:
            node.shutdown()
            return
        super()._reschedule(node)

    def remove_node(self, node):
        if node is self.waiting_node:  # crashed: any worker takes the waiting modules left
            self.waiting_node = None
        return super().remove_node(node)
