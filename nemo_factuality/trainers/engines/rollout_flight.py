"""One step's rollouts generated on the vLLM engine while the trainer trains (``<stage>.max_staleness`` >= 1).

The engine's channel is request/reply, one request at a time (``vllm_engine.VLLMEngine``). A ``Flight`` sends a step's
requests — one per chunk of ``model.rollout_micro_batch_size`` prompts, each with the seed the trainer drew for it —
from a thread of its own, the engine's only user while it runs, so the trainer's thread trains meanwhile; the trainer
touches the engine again only after ``result()`` (the step boundary: its refit, the next flight). Each request is
bounded as on the trainer's thread (``request_timeout_s``; a dead engine is restarted, up to ``restarts`` times, past
them ``EngineUnavailable``), so every wait on a flight is one of the engine's windows (``config.wait_windows``).

A file refit's reload is the flight's first request: the trainer writes the weights at the boundary and goes on
training while the engine loads them. Every chunk records the weight version the engine says generated it. Errors
are values until ``result()`` raises them, on the trainer's thread, inside the stage's agreement; a broadcast engine
restarted mid-flight (``EngineRestarted``: it holds ``model.path``'s weights until streamed to, which only the
trainer's thread can do) ends the flight early with what it has.

Only the replica's engine rank runs a flight, and a flight enters no collective: under model parallelism the other
ranks of the replica receive its ``FlightReport`` from the source (``VLLMRollout.finish_flight``), on their own
thread, where every collective of the step runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_factuality.trainers.engines.vllm_engine import EngineRestarted
from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class FlightChunk:
    """One chunk of a step's rollouts: its index in the step's plan, its rows and rollout, and the weight version (the
    trainer step whose weights the engine held: 0 = the starting weights) that generated it."""

    index: int
    chunk: RolloutChunk
    version: int


@dataclass
class PlannedChunk:
    """One request of a flight: the chunk's index, its prompt rows, their token ids and the seed drawn for it."""

    index: int
    rows: list[int]
    prompts: list[list[int]]
    seed: int


@dataclass
class FlightReport:
    """What a flight ended with (picklable: relayed to the replica's other ranks). ``restarted``: a broadcast engine
    was restarted mid-flight and the chunks not in ``chunks`` wait for its weights; ``generate_s``: the flight's
    wall time; ``ended``: ``time.monotonic()`` when the engine finished its last request (idle from then)."""

    chunks: list[FlightChunk] = field(default_factory=list)
    restarted: bool = False
    generate_s: float = 0.0
    ended: float = 0.0


class Flight:
    """The requests of ``plan`` on ``engine`` in a daemon thread, started at once; ``result()`` waits for them."""

    def __init__(self, engine: Any, plan: Sequence[PlannedChunk], sampling: SamplingParams, *, eos_id: int,
                 to_rollout: Callable[[list[list[int]], list[dict[str, Any]]], Rollout],
                 reload: tuple[Path, int | None] | None = None,
                 on_chunk: Callable[[RolloutChunk], None] | None = None) -> None:
        """``to_rollout(prompts, rows)``: the engine's answer as a ``Rollout`` (``vllm_rollout.engine_rollout``);
        ``reload``: (folder, version) of a file refit the engine loads first; ``on_chunk``: called with each chunk
        as it arrives, on the flight's thread (the stage's reward worker takes it from there)."""
        self.engine, self.plan, self.sampling, self.eos_id = engine, list(plan), sampling, eos_id
        self.to_rollout, self.reload, self.on_chunk = to_rollout, reload, on_chunk
        self.report = FlightReport()
        self.started = time.monotonic()
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-flight", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.reload is not None:
                self.engine.refit(*self.reload)
            for planned in self.plan:
                if self._cancelled.is_set():
                    return
                s = self.sampling
                rows, version = self.engine.generate_versioned(
                    planned.prompts, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, greedy=s.use_greedy, eos_id=self.eos_id, seed=planned.seed)
                chunk = RolloutChunk(planned.rows, self.to_rollout(planned.prompts, rows))
                self.report.chunks.append(FlightChunk(planned.index, chunk, version))
                if self.on_chunk is not None:
                    self.on_chunk(chunk)
        except EngineRestarted:
            self.report.restarted = True  # the trainer's thread streams the weights, then asks for the rest
        except Exception as err:  # raised by result(), on the trainer's thread
            self._error = err
        finally:
            self.report.ended = time.monotonic()
            self.report.generate_s = self.report.ended - self.started

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> FlightReport:
        """Wait for the flight (each of its requests is bounded by the engine's timeouts and restarts) and return its
        report, or raise what ended it (``EngineUnavailable``: the engine past its restarts)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.report

    def cancel(self, timeout_s: float) -> None:
        """Ask no more (the request in progress runs to its end) and wait for the thread, at most ``timeout_s`` (the
        engine's window: a request and its restarts); the flight's outcome is dropped."""
        self._cancelled.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("a rollout flight was still waiting for the engine %g s after it was cancelled", timeout_s)
