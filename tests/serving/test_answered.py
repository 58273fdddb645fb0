"""``AnsweredRows``: which rows a request with ids gets judged, and what it answers for the others."""

from __future__ import annotations

import numpy as np

from nemo_factuality.serving.answered import AnsweredRows
from nemo_factuality.types import RewardBatch


class _Counting:
    """Scores row i as float(value) with a component and details; records which rows it was asked for."""

    def __init__(self, values):
        self.values, self.asked = values, []

    def __call__(self, rows):
        rows = list(range(len(self.values))) if rows is None else rows
        self.asked.append(rows)
        v = np.array([float(self.values[i]) for i in rows])
        return RewardBatch(v, {"half": v / 2}, details=[{"row": self.values[i]} for i in rows])


def test_a_resent_batch_is_answered_from_the_first_and_a_mixed_one_judges_only_its_new_rows():
    answered = AnsweredRows(capacity=10)
    first = _Counting([1, 2, 3])
    out, repeated = answered.score(["a:0", "a:1", "a:2"], first)
    assert first.asked == [[0, 1, 2]] and repeated == 0 and out.scores.tolist() == [1, 2, 3]
    again = _Counting([9, 9, 9])  # a resend would be judged to something else: it must not be judged at all
    out, repeated = answered.score(["a:0", "a:1", "a:2"], again)
    assert again.asked == [] and repeated == 3
    assert out.scores.tolist() == [1, 2, 3] and out.components["half"].tolist() == [0.5, 1, 1.5]
    assert [d["row"] for d in out.details] == [1, 2, 3]
    mixed = _Counting([7, 8, 9])  # rows of two requests batched together by Triton: only the new ones are judged
    out, repeated = answered.score(["a:2", "b:0", "a:0"], mixed)
    assert mixed.asked == [[1]] and repeated == 2 and out.scores.tolist() == [3, 8, 1]


def test_ids_repeated_within_a_batch_are_judged_once_and_the_oldest_rows_are_forgotten():
    answered = AnsweredRows(capacity=2)
    reward = _Counting([4, 4, 5])
    out, _ = answered.score(["x", "x", "y"], reward)
    assert reward.asked == [[0, 2]] and out.scores.tolist() == [4, 4, 5]
    answered.score(["z"], _Counting([6]))
    assert len(answered) == 2
    forgotten = _Counting([10])
    answered.score(["x"], forgotten)  # evicted (least recently answered): judged again
    assert forgotten.asked == [[0]]


def test_requests_without_ids_or_with_the_memory_off_are_judged_whole():
    for answered, ids in ((AnsweredRows(capacity=10), None), (AnsweredRows(capacity=0), ["a", "b"])):
        reward = _Counting([1, 2])
        out, repeated = answered.score(ids, reward)
        assert reward.asked == [[0, 1]] and repeated == 0 and len(answered) == 0
