"""Async GRPO and PPO (``<stage>.max_staleness`` = k >= 1): the next step's rollouts generate, and are scored, while
this step trains.

One step, n (the trainer holds the weights after step n - 1)::

    trainer ▕take R_n▕refit?▕launch R_n+1▕ log-probs ▕ rewards ▕ advantages → update ▕take R_n+1 ...
    engine  ...R_n  ▕ idle ▕ R_n+1, one request per chunk ...............................▕
    reward  ...R_n's chunks ▕ R_n+1's chunks as they arrive (the step's RolloutScorer) ...

* **Which weights.** The engine is refit at a step boundary, with the trainer's current weights, only when the next
  step's rollouts would otherwise come from weights more than k updates older than the ones that train on them: at
  k = 1 every step (step n + 1 trains on rollouts of the weights after step n - 1), at k = 2 every other step. Each
  refit names the trainer step whose weights it loads (the engine's weight version, ``VLLMRollout.policy_version``),
  the engine reports the version that generated each chunk, and ``rollout/staleness`` is the trainer's step minus
  it. The loss corrects for the engine's policy with the truncated importance weights (``rollout.vllm.tis_cap``,
  required) against the log-probs the engine sampled with, the PPO ratio against the trainer's own recomputed ones.
* **One step ahead.** One engine per replica generates one request at a time, so a queue of several steps would not
  make it faster; k bounds how old the weights may be, and saves refits when it is above 1.
* **Faults.** Every wait on a flight is the engine's (each request bounded, restarts counted: ``wait_windows``);
  a flight's failure is a value until the step takes its rollouts, inside the stage's agreement (an engine past its
  restarts on one replica: every rank checkpoints and exits 75). A step abandoned before its update puts back what
  it had (``AheadStepStart``): its own rollouts stay pending, the next step's flight is cancelled and its draws
  (prompts, seeds) rewound, so the rerun draws them again.
* **Checkpoints.** A checkpoint waits for the rollouts in flight and saves them (``rollouts_ahead.pt``: each
  data-parallel rank's prompts, seeds and generated chunks with their versions), so a resumed run trains on exactly
  those (none lost, none repeated; their rewards are scored again). Rollouts a failed flight did not finish are
  regenerated on resume with the seeds drawn for them, from the resumed weights (their version says so). At k >= 2 a
  resumed run refits at its first step (the engine's older weights are not in the checkpoint), so its refit schedule
  restarts; k = 1 resumes exactly.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk
from nemo_factuality.trainers.runtime import StepStart, records_for_rows
from nemo_factuality.trainers.scoring import RolloutScorer
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

PENDING_FILE = "rollouts_ahead.pt"  # in a checkpoint: the rollouts generated for the steps after it


@dataclass
class StepRollouts:
    """One step's rollouts, generated ahead: its prompt rows on this rank, the seed of each chunk, the chunks it has
    (index → ``rollout_flight.FlightChunk``), the flight generating them (``in_flight``: launched by this process
    and not waited for, on every rank of the replica alike; ``flight`` is None off the engine's rank) and the scorer
    their rewards go to (None until the step takes them, for rollouts restored from a checkpoint)."""

    step: int
    picked: list[int]
    seeds: list[int]
    chunks: dict[int, Any] = field(default_factory=dict)
    flight: Any = None
    in_flight: bool = False
    scorer: RolloutScorer | None = None
    failure: Exception | None = None  # what ended its flight, raised when the step takes it
    launched: float = math.nan  # time.monotonic() of the launch (the engine's idle ends)
    ended: float = math.nan  # when the engine answered its last request
    generate_s: float = math.nan  # the flight's wall time


class RolloutsAhead:
    """The stage's rollouts one step ahead (``trainer``: a ``GRPOTrainer`` or ``PPOTrainer`` on a ``VLLMRollout``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.k = trainer, int(trainer._algo().max_staleness)
        self.pending: StepRollouts | None = None  # the rollouts of the next step to train
        self.trainer.actor.policy_version = trainer.step
        cfg = trainer.cfg
        if str(cfg.trainer.device).startswith("cuda") and cfg.rollout.vllm.placement == "colocated":
            log.warning("%s.max_staleness=%d with rollout.vllm.placement=colocated: the engine generates on the "
                        "trainer's GPUs while it trains, so the two overlap only as far as the GPUs run both at once; "
                        "rollout.vllm.placement=separate gives the engine GPUs of its own", trainer.stage, self.k)

    # ------------------------------------------------------------------ the step's rollouts
    def take(self) -> tuple[StepRollouts, list[Any]]:
        """The current step's rollouts and their chunks in plan order (launched now when none are pending: the first
        step, a resume without them); on every rank, inside the stage's agreement (a flight's failure there)."""
        t = self.trainer
        t.actor.policy_version = t.step  # the weights the actor holds: after step t.step (a resume's too)
        current = self.pending
        if current is None:
            current = t.parallel.agreed(lambda: self._launch(t.step + 1))
        self.pending = None
        chunks = t.parallel.agreed(lambda: self._complete(current))
        return current, chunks

    def launch_next(self) -> None:
        """Refit the engine when the next step's rollouts need it, and start them (on every rank, in the agreement: a
        refit's failure). Nothing after the last step."""
        t = self.trainer
        if t.step + 2 > t.cfg.trainer.max_steps:
            return
        self.pending = t.parallel.agreed(lambda: self._launch(t.step + 2))

    def _launch(self, step: int) -> StepRollouts:
        t = self.trainer
        held = t.actor.engine_version  # None: weights of no version of this run (an engine another run refit)
        if held is None or step - 1 - held > self.k:  # trained at step `step` by the weights after step - 1
            t.actor.refit()
        picked = t.parallel.shard(t.sampler.take(t._prompts_per_step()))
        prompt_ids = self._prompt_ids(picked)
        # the trainer's random stream, one draw per request as the on-policy loop draws them
        seeds = [int(torch.randint(0, 2**31 - 1, (1,))) for _ in t.actor.chunk_rows(len(prompt_ids))]
        rollouts = StepRollouts(step, picked, seeds, launched=time.monotonic())
        rollouts.scorer = self._scorer(rollouts)
        submit = rollouts.scorer.submit if rollouts.scorer.overlap else None
        rollouts.flight = t.actor.start_flight(prompt_ids, t.sampling, seeds, on_chunk=submit)
        rollouts.in_flight = True
        return rollouts

    def _complete(self, rollouts: StepRollouts) -> list[Any]:
        """Wait for ``rollouts``' flight and generate what it did not (with its seeds, from the current weights)."""
        t = self.trainer
        if rollouts.failure is not None:
            raise rollouts.failure
        self._wait(rollouts)
        if rollouts.failure is not None:
            raise rollouts.failure
        if rollouts.scorer is None:  # restored from a checkpoint: their rewards are scored again
            rollouts.scorer = self._scorer(rollouts)
            if rollouts.scorer.overlap:
                for index in sorted(rollouts.chunks):
                    rollouts.scorer.submit(rollouts.chunks[index].chunk)
        missing = [i for i in range(len(rollouts.seeds)) if i not in rollouts.chunks]
        if missing:
            for got in t.actor.generate_planned(self._prompt_ids(rollouts.picked), t.sampling, rollouts.seeds, missing):
                rollouts.chunks[got.index] = got
                if rollouts.scorer.overlap:
                    rollouts.scorer.submit(got.chunk)
        return [rollouts.chunks[i] for i in sorted(rollouts.chunks)]

    def _wait(self, rollouts: StepRollouts) -> None:
        """Wait for ``rollouts``' flight (every rank of the replica: the source's report is relayed); its failure is
        kept, its partial chunks dropped (the replica's ranks hold the same then), the rest regenerated later."""
        if not rollouts.in_flight:
            return
        rollouts.in_flight = False
        try:
            report = self.trainer.actor.finish_flight(rollouts.flight)
        except Exception as err:  # the stage's agreement decides on it when the step takes them (take)
            rollouts.failure = err
            return
        rollouts.chunks.update({c.index: c for c in report.chunks})
        rollouts.ended, rollouts.generate_s = report.ended, report.generate_s

    def settle(self) -> None:
        """Wait for the rollouts in flight (before a checkpoint or a validation, which use the engine): every rank of
        the replica at the same point; a failure stays a value, raised when the step takes them."""
        if self.pending is not None:
            self._wait(self.pending)

    def _prompt_ids(self, picked: list[int]) -> list[list[int]]:
        n = self.trainer._samples_per_prompt()
        return [self.trainer.prompt_ids[i] for i in picked for _ in range(n)]

    def _scorer(self, rollouts: StepRollouts) -> RolloutScorer:
        t = self.trainer
        records = records_for_rows([t.data[i] for i in rollouts.picked], t._samples_per_prompt())
        return RolloutScorer(t.reward, records, t.actor.tokenizer, t.actor.eos_id, t.parallel,
                             overlap=t._algo().overlap_reward)

    # ------------------------------------------------------------------ what the step logs
    def metrics(self, current: StepRollouts, chunks: list[Any], rollout: Rollout) -> dict[str, float]:
        """``rollout/staleness`` (mean and max over the step's rows of the trainer's step minus the version that
        generated the row), ``time/generate`` (the flight's wall time on the engine) and ``time/engine_idle`` (from the
        engine's last answer for this step to the next step's launch; NaN when not measured: the last step, rollouts
        from a checkpoint)."""
        versions = torch.zeros(len(rollout), dtype=torch.float64)
        for c in chunks:
            versions[torch.tensor(c.chunk.rows)] = float(c.version)
        stale = self.trainer.step - versions
        nxt = self.pending
        idle = nxt.launched - current.ended if nxt is not None else math.nan
        return {"rollout/staleness": stale.mean().item(), "rollout/staleness_max": stale.max().item(),
                "time/generate": current.generate_s, "time/engine_idle": idle}

    # ------------------------------------------------------------------ faults, checkpoints, the end
    def step_start(self) -> AheadStepStart:
        return AheadStepStart(self)

    def rewind(self, pending: StepRollouts | None) -> None:
        """Put back what a step had at its start: ``pending`` (its own rollouts, taken again by the rerun; their
        rewards scored again), the next step's flight cancelled (the sampler and RNG are rewound with its draws)."""
        if self.pending is not None and self.pending is not pending:
            self._drop(self.pending)
        if pending is not None and pending.scorer is not None:
            pending.scorer.close()
            pending.scorer = None
        self.pending = pending

    def _drop(self, rollouts: StepRollouts) -> None:
        if rollouts.flight is not None and rollouts.in_flight:
            rollouts.flight.cancel(self._window_s())
        rollouts.in_flight = False
        if rollouts.scorer is not None:
            rollouts.scorer.close()

    def _window_s(self) -> float:
        from nemo_factuality.trainers.config import wait_windows

        return max((s for keys, s in wait_windows(self.trainer.cfg) if "rollout.vllm" in keys), default=600.0)

    def close(self) -> None:
        """Stop what is in flight (the run ends): no thread uses the engine once the stage closes it."""
        if self.pending is not None:
            self._drop(self.pending)

    def state(self) -> dict[str, Any] | None:
        """This rank's pending rollouts as plain tensors and lists (``torch.load(weights_only=True)`` reads them)."""
        p = self.pending
        if p is None:
            return None
        chunks = [{"index": c.index, "rows": list(c.chunk.rows), "version": int(c.version),
                   **{k: getattr(c.chunk.rollout, k) for k in ("tokens", "prompt_lengths", "response_lengths", "is_end",
                                                               "logprobs")}} for c in p.chunks.values()]
        return {"step": p.step, "picked": list(p.picked), "seeds": list(p.seeds), "chunks": chunks}

    def load(self, checkpoint: Path) -> None:
        """The pending rollouts a checkpoint saved for this rank (nothing when it saved none)."""
        from nemo_factuality.trainers.engines.rollout_flight import FlightChunk

        path = checkpoint / PENDING_FILE
        if not path.exists():
            return
        saved = torch.load(path, weights_only=True)
        ranks, par = saved["ranks"], self.trainer.parallel
        if len(ranks) != par.size:
            raise FactualityInputError(
                f"{path}: rollouts generated ahead for {len(ranks)} data-parallel rank(s), this run has {par.size}: "
                "resume with the layout that wrote it, or delete the file to draw those prompts again")
        mine = ranks[par.rank]
        if mine is None or mine["step"] != self.trainer.step + 1:
            return
        self.pending = StepRollouts(mine["step"], mine["picked"], mine["seeds"])
        for c in mine["chunks"]:
            rollout = Rollout(c["tokens"], c["prompt_lengths"], c["response_lengths"], c["is_end"], c["logprobs"])
            self.pending.chunks[c["index"]] = FlightChunk(c["index"], RolloutChunk(c["rows"], rollout), c["version"])


def write_pending(records: list[dict[str, Any] | None], max_staleness: int, checkpoint: Path) -> None:
    """The writer rank's part of a checkpoint: every data-parallel rank's pending rollouts (``RolloutsAhead.state``)."""
    torch.save({"max_staleness": max_staleness, "ranks": records}, checkpoint / PENDING_FILE)


class AheadStepStart(StepStart):
    """``StepStart`` plus the rollouts pending at the step's start (``RolloutsAhead.rewind`` puts them back)."""

    def __init__(self, ahead: RolloutsAhead) -> None:
        super().__init__(ahead.trainer.sampler, ahead.trainer.critic)
        self.ahead, self.pending = ahead, ahead.pending

    def restore(self) -> None:
        super().restore()
        self.ahead.rewind(self.pending)
