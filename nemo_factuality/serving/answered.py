"""The reward server's memory of rows it already scored, by request id: a resend is answered from it, not re-judged.

A client whose request timed out resends it while the first is still being scored (the judges were slow, not
gone). Without ids the server scores it twice — doubling the judge load at the moment the judges are slowest.
The training client gives every row an id (``<call uuid>:<row>``, the same on every resend of that call); the
server scores only the rows whose id it has not answered yet (batches run one at a time, so a resend waits behind
the first request and then finds its rows here) and keeps the newest ``capacity`` rows. Requests without ids
(NeMo-Aligner's client) are scored as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from nemo_factuality.types import RewardBatch


class AnsweredRows:
    """Bounded id → one-row ``RewardBatch`` map (least recently answered evicted first); thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[str, RewardBatch] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def score(self, ids: Sequence[str] | None,
              score_rows: Callable[[list[int] | None], RewardBatch]) -> tuple[RewardBatch, int]:
        """(the batch's result in row order, how many rows came from earlier answers). ``score_rows(indices)`` scores
        the rows at ``indices`` (``None``: every row — requests without ids, or caching off); a row whose id repeats
        within the batch is scored once."""
        if ids is None or self.capacity <= 0:
            return score_rows(None), 0
        with self._lock:
            known = {rid: self._rows[rid] for rid in set(ids) if rid in self._rows}
        first_of: dict[str, int] = {}
        for i, rid in enumerate(ids):
            if rid not in known:
                first_of.setdefault(rid, i)
        fresh = sorted(first_of.values())
        answered = dict(known)
        if fresh:
            result = score_rows(fresh)
            for k, i in enumerate(fresh):
                answered[ids[i]] = result.take([k])
        with self._lock:
            for rid in ids:
                self._rows[rid] = answered[rid]
                self._rows.move_to_end(rid)
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
        return RewardBatch.concat([answered[rid] for rid in ids]), len(ids) - len(fresh)
