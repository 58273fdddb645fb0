"""The stages' reward calls on a step's rollout: in a worker thread, overlapping generation and log-probs, or in line.

At the presets' scale the reward phase (a judge pipeline over every claim of hundreds of long-form rollouts)
can last as long as generation. With ``<stage>.overlap_reward=true`` each rollout micro batch is handed to a
worker thread as soon as the actor has generated it (``submit``); the worker calls the reward on it while
the actor generates the next one and then computes log-probs, and ``result`` waits only for what is still
being scored::

    generate ▕chunk 1▕chunk 2▕chunk 3▕ log-probs ▕ wait ▕ advantages → update
    reward          ▕  1   ▕  2   ▕    3    ▕

One worker calls the reward once per micro batch, one call after another, so the judges see no more
concurrency than in one big call (the in-process rewards and the served client parallelise each call
themselves). With ``overlap=False`` ``submit`` calls the reward in line: the stage submits the whole rollout
after generation (generate → reward → log-probs, one after the other).

Under model parallelism the ranks of a replica hold the same rollout: only the replica's source rank calls
the reward, and ``result`` broadcasts its batch (``DataParallel.on_model_parallel_source``). An exception
raised by the reward is re-raised by ``result`` — never by ``submit`` — unchanged on the rank that had it and
relayed to every other rank of the job (``DataParallel.agreed``: a server gone on one replica stops them all
alike), and the micro batches submitted after it are not scored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nemo_factuality.trainers.data import PromptRecord
from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk
from nemo_factuality.trainers.parallel import DataParallel
from nemo_factuality.trainers.runtime import call_reward, check_token_outputs
from nemo_factuality.types import RewardBatch

log = logging.getLogger(__name__)

_Scored = tuple[list[int], RewardBatch, list[list[int]]]  # (prompt rows, the reward's batch, response token ids)


class _Skipped(Exception):
    """A micro batch submitted after another one's reward call failed: not scored (that failure is raised)."""


class RolloutScorer:
    """Scores the micro batches of one step's rollout; ``result()`` gives their rewards in prompt-row order.

    ``records[i]`` is the prompt record of row ``i`` of the step's rollout (the rows ``RolloutChunk.rows`` name).
    ``reward_s``: wall time of the reward calls; ``exposed_s``: how long the step waited for them.
    """

    def __init__(self, reward: Any, records: Sequence[PromptRecord], tokenizer: Any, eos_id: int,
                 parallel: DataParallel, *, overlap: bool) -> None:
        self.reward, self.records, self.tokenizer, self.eos_id = reward, list(records), tokenizer, eos_id
        self.parallel, self.overlap = parallel, overlap
        self.reward_s = self.exposed_s = 0.0
        self._done: list[_Scored] = []  # in line: what each call returned (on every rank)
        self._pending: list[Future] = []
        self._failed = threading.Event()
        self._inline_error: Exception | None = None  # an in-line call's failure, raised by result()
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
                        if overlap and parallel.is_model_parallel_source else None)

    def submit(self, chunk: RolloutChunk) -> None:
        """Score ``chunk``: queued for the worker (overlap; the model-parallel source rank only), else now."""
        if self.overlap:
            if self._worker is not None:
                self._pending.append(self._worker.submit(self._score, chunk))
            return
        if self._inline_error is not None:
            return  # raised by result(), where every rank of the job decides together
        start = time.perf_counter()
        try:
            self._done.append(self.parallel.on_model_parallel_source(lambda: self._score(chunk)))
        except Exception as err:
            self._inline_error = err
        finally:
            self.exposed_s += time.perf_counter() - start

    def result(self) -> RewardBatch:
        """Every submitted row's rewards in row order (waits for the worker); token outputs checked per token.

        A failure on any rank (another replica's server gone) is raised on every rank (``DataParallel.agreed``)."""
        return self.parallel.agreed(self._result)

    def _result(self) -> RewardBatch:
        start = time.perf_counter()
        try:
            if self._inline_error is not None:
                raise self._inline_error
            scored = self.parallel.on_model_parallel_source(self._collect) if self.overlap else self._done
        finally:
            self.exposed_s += time.perf_counter() - start
            self.close()
        rows = [r for part, _, _ in scored for r in part]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        batch = RewardBatch.concat([b for _, b, _ in scored]).take(order)
        ids = [x for _, _, part in scored for x in part]
        return check_token_outputs(batch, [ids[i] for i in order])

    def __enter__(self) -> RolloutScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker (micro batches not started yet are dropped); safe to call twice."""
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    # ---------------------------------------------------------------------------------------------- internals
    def _score(self, chunk: RolloutChunk) -> _Scored:
        if self._failed.is_set():
            raise _Skipped
        start = time.perf_counter()
        try:
            batch, _, ids = call_reward(self.reward, chunk.rollout, [self.records[i] for i in chunk.rows],
                                        self.tokenizer, self.eos_id)
        except BaseException:
            self._failed.set()
            raise
        finally:
            self.reward_s += time.perf_counter() - start  # one worker: the calls never overlap each other
        return list(chunk.rows), batch, ids

    def _collect(self) -> list[_Scored]:
        """The worker's results in submission order; the first failure is raised as it was raised in the worker."""
        try:
            return [future.result() for future in self._pending]
        finally:
            self._pending = []


def rollout_rows(rollout: Rollout) -> RolloutChunk:
    """The whole of ``rollout`` as one chunk (the in-line order's single reward call)."""
    return RolloutChunk(list(range(len(rollout))), rollout)
