"""What every stage needs besides its algorithm: run directory, metrics, checkpoints, signals, reward calls.

* ``RunLogger``: ``metrics.jsonl`` (one object per step), TensorBoard, optional wandb.
* ``Checkpointer``: ``<run>/checkpoints/step_XXXXXX/`` written to a temporary directory and renamed
  when complete, ``latest`` pointer, the newest ``save_top_k`` kept (plus the best one under early
  stopping). A checkpoint holds the actor's (and critic's) full state plus ``trainer_state.json``:
  step, data position, counters, early-stopping state and every RNG (torch, numpy, python).
* ``PreemptionFlag``: SIGUSR1 (Slurm's ``--signal=B:USR1@...``) and SIGTERM set a flag; the stage
  checkpoints at the end of the step and exits 0 so the launcher's requeue resumes it.
* ``StepStart`` + ``checkpoint_if_server_gone``: a reward or critic server that stayed away past its retry
  window (the clients wait and retry; ``ServerUnavailableError``) ends the run with a checkpoint of the step's
  start and ``RunStopped`` (exit 75 at the command boundary), so the requeued job redoes that step.
* ``score_rollout``: decode a rollout, call the reward, place token rewards/signs on ``[B, S-1]``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_factuality import exit_codes
from nemo_factuality.fileio import respect_umask
from nemo_factuality.trainers.data import PromptRecord
from nemo_factuality.trainers.interfaces import Rollout
from nemo_factuality.trainers.parallel import DataParallel
from nemo_factuality.types import FactualityInputError, RewardBatch, ServerUnavailableError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rng_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    version, internal, gauss = state["python"]
    np_state = state["numpy"]
    out = {"python": [version, list(internal), gauss],
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return out


def set_rng_state(tensors: Mapping[str, torch.Tensor], js: Mapping[str, Any]) -> None:
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what ``rng_state()`` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- logging
class RunLogger:
    """One JSON object per step in ``metrics.jsonl``; the same scalars to TensorBoard (and wandb when enabled)."""

    def __init__(self, run_dir: Path, exp: Any, config: Any, *, enabled: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        self.enabled = enabled  # data parallelism: global rank 0 writes, the other ranks' loggers do nothing
        if not enabled:
            return
        if exp.create_tensorboard_logger:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; install nemo-factuality[train] for TensorBoard logs")
        if exp.create_wandb_logger:
            import wandb  # an explicit opt-in: fail loudly if missing

            self._wandb = wandb.init(project=exp.wandb_project, name=exp.wandb_name, dir=str(run_dir),
                                     config=asdict(config) if is_dataclass(config) else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and np.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint (they will be redone)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [ln for ln in self.path.read_text(encoding="utf-8").splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


class PhaseTimer:
    """``with timer("generate"): ...`` accumulates seconds per phase into ``time/<phase>``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- checkpoints
class Checkpointer:
    """``step_XXXXXX/`` checkpoints, complete or absent.

    With data parallelism every rank writes into the same temporary directory (the actor's ``save`` is
    collective: NeMo's distributed checkpoint), plus its own RNG state; global rank 0 alone writes the
    trainer state and finalises (rename, ``latest``, pruning) once every rank has written, and a barrier
    after that keeps every rank from going on (or resuming) before the checkpoint is complete.
    """

    def __init__(self, run_dir: Path, keep: int, parallel: DataParallel | None = None,
                 identity: Mapping[str, Any] | None = None) -> None:
        """``identity``: the model the stage trains (``resume.model_identity``), recorded in every checkpoint so a
        rerun of another model into this folder is refused before anything loads (``resume.check_resume``)."""
        self.root, self.keep = run_dir / "checkpoints", max(1, keep)
        self.identity = dict(identity or {})
        self.parallel = parallel or DataParallel(None)
        self.best: str | None = None  # a checkpoint early stopping wants kept
        self._written: tuple[int, str] | None = None  # (step, trainer state) of the last checkpoint this run wrote

    def latest(self) -> Path | None:
        """The committed checkpoint to resume from, or None. Decided on the writer rank alone (it alone may move a
        re-save's ``.replaced`` step back) and broadcast, so every rank resumes from the same one whatever its own
        view of a shared file system."""
        found, problem = self.parallel.on_writer(self._latest_on_writer)
        if problem:
            raise FactualityInputError(problem)
        return None if found is None else self.root / found

    def _latest_on_writer(self) -> tuple[str | None, str | None]:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None, None
        path = self.root / pointer.read_text().strip()
        aside = self.root / f".{path.name}.replaced"
        if not path.exists() and (aside / "trainer_state.json").exists():  # killed mid re-save: the old one stands
            os.replace(aside, path)
        if not (path / "trainer_state.json").exists():
            return None, (f"{pointer} names {path.name}, which is incomplete; delete {pointer} to start over or point "
                          "exp_manager.explicit_log_dir at a new directory")
        return path.name, None

    def save(self, step: int, actor: Any, critic: Any, state: Mapping[str, Any],
             extra: Callable[[Path], None] | None = None, *, force: bool = False) -> Path:
        """Write ``step_XXXXXX``; ``extra(tmp)`` adds the stage's own files (called on global rank 0 only).

        A step already saved with the same trainer state (a save-interval step that is also the last, or the best)
        is not written again unless ``force`` (the weights changed since: the best ones restored)."""
        name, par = f"step_{step:06d}", self.parallel
        final, tmp = self.root / name, self.root / f".{name}.partial"
        written = (step, json.dumps(state, sort_keys=True, default=str))
        # the same decision on every rank: the writer's view of the shared directory, broadcast
        if written == self._written and not force and par.on_writer(final.is_dir):
            return final
        if par.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        par.barrier()  # the temporary directory exists, and is empty, before any rank writes into it
        actor.save(tmp)
        if critic is not None:
            critic.save(tmp)
        rng = rng_state()
        tensors = {k: v for k, v in rng.items() if k in ("torch", "cuda")}
        if not par.is_writer:  # each rank resumes its own random streams
            torch.save({**tensors, "json": _rng_to_json(rng)}, tmp / f"rng.rank{par.global_rank}.pt")
        else:
            torch.save(tensors, tmp / "rng.pt")
            if extra is not None:
                extra(tmp)
        par.barrier()  # every rank's files are in tmp
        if par.is_writer:
            (tmp / "trainer_state.json").write_text(json.dumps({**state, "rng": _rng_to_json(rng), "model": self.identity}),
                                                    encoding="utf-8")
            respect_umask(tmp)  # safetensors files come out 0600 otherwise
            # a re-save of the same step: the old one moves aside and is deleted only once the new one is in place
            aside = self.root / f".{name}.replaced"
            shutil.rmtree(aside, ignore_errors=True)
            if final.exists():
                os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
            pointer_tmp = self.root / ".latest.tmp"
            pointer_tmp.write_text(name)
            os.replace(pointer_tmp, self.root / "latest")
            self._prune()
            log.info("checkpoint saved: %s", final)
        par.barrier()  # no rank reads (or resumes from) a checkpoint rank 0 is still finalising
        self._written = written
        return final

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep]:
            if old.name != self.best:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, actor: Any, critic: Any) -> dict[str, Any]:
        """Every rank restores the actor (collective), the trainer state and its own RNG state."""
        actor.load(path)
        if critic is not None:
            critic.load(path)
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        rng_json = state.pop("rng")
        own = path / f"rng.rank{self.parallel.global_rank}.pt"
        if self.parallel.global_rank and own.exists():
            saved = torch.load(own, weights_only=True)
            set_rng_state(saved, saved["json"])
        else:  # rank 0, or a checkpoint written by a smaller world
            set_rng_state(torch.load(path / "rng.pt", weights_only=True), rng_json)
        return state


class PreemptionFlag:
    """Set by SIGUSR1/SIGTERM; the stage checkpoints at the end of the current step and exits."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionFlag:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        log.warning("%s received: checkpointing at the end of this step, then exiting", self.signal)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __bool__(self) -> bool:
        return self.signal is not None


class TrainingStalledError(RuntimeError):
    """A stage stopped because it could not learn: ``trainer.max_invalid_steps`` steps without a valid sample,
    or a KTO iteration whose labeller labelled nothing.

    Not a user error and not a crash: the CLI boundary prints it as one line and exits with ``exit_code``."""

    exit_code = exit_codes.TRAINING_STALLED


class InvalidSteps:
    """Counts consecutive steps without a valid sample; ``limit`` of them (``trainer.max_invalid_steps``, 0 = off)
    stop the run, so a run whose rewards all fail ends with an error instead of "finishing" untrained."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def update(self, any_valid: bool) -> bool:
        """Record one step; True when the run must stop."""
        self.count = 0 if any_valid else self.count + 1
        return bool(self.limit) and self.count >= self.limit

    def error(self, step: int, checkpoint: Path, why: str) -> TrainingStalledError:
        return TrainingStalledError(
            f"stopped at step {step}: {self.count} consecutive steps had no valid sample ({why}); "
            f"trainer.max_invalid_steps={self.limit} (0 = never stop for this). Checkpoint {checkpoint} is written: "
            "fix the reward (its judges / server, the reward.* and remote_rm.* URLs) and rerun the same command to resume")


class RunStopped(ServerUnavailableError):
    """The stage stopped because a server stayed away past its retry window (after writing a checkpoint when it
    could); the command boundary prints it as one line and exits 75 so the launcher requeues the job."""


class StepStart:
    """What a step changes before its first optimiser update — the prompt sampler's position and the RNG streams —
    captured at its start, so a step abandoned before any update can be checkpointed as not yet begun.

    ``updated()``: the critic server took an optimiser step since (PPO's later minibatches); the weights are then
    mid-step and no checkpoint of the step's start exists."""

    def __init__(self, sampler: Any, critic: Any = None) -> None:
        self.sampler, self.critic = sampler, critic
        self.sampler_state, self.rng = sampler.state_dict(), rng_state()
        self.critic_step = getattr(critic, "expected_step", None)

    def restore(self) -> None:
        self.sampler.load_state_dict(self.sampler_state)
        restore_rng(self.rng)

    def updated(self) -> bool:
        return getattr(self.critic, "expected_step", None) != self.critic_step


@contextmanager
def checkpoint_if_server_gone(save: Callable[[], Path], *, step: int, before_save: Callable[[], None] | None = None,
                              start: StepStart | None = None) -> Iterator[None]:
    """Run the block; a ``ServerUnavailableError`` from it (a client's retry window ran out) becomes: ``start``
    restored (the abandoned step not begun) or ``before_save()`` (a finished step's metrics logged), ``save()``, and
    ``RunStopped`` naming the server and the checkpoint. No checkpoint when the error says one would be
    inconsistent (``checkpoint_safe = False``: a restarted critic behind the actor) or the step had updated weights.

    Under data parallelism the stages decide together before this sees the error (``DataParallel.agreed``): when
    one replica's server is gone every rank raises, so every rank restores, saves (collective) and stops alike."""
    try:
        yield
    except ServerUnavailableError as err:
        if isinstance(err, RunStopped):
            raise
        if not getattr(err, "checkpoint_safe", True) or (start is not None and start.updated()):
            raise RunStopped(f"{_one_line(err)}; no checkpoint written at step {step} (the weights were mid-step or "
                             "the critic lost its state): the rerun resumes from the last checkpoint") from err
        if start is not None:
            start.restore()
        if before_save is not None:
            before_save()
        path = save()
        raise RunStopped(f"{_one_line(err)}; checkpoint {path.name} written: rerun (Slurm requeue) to resume at "
                         f"step {step + 1}") from err


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


class EarlyStopping:
    def __init__(self, cfg: Any) -> None:
        self.cfg, self.best, self.best_step, self.bad = cfg, None, None, 0

    def update(self, step: int, metrics: Mapping[str, float]) -> tuple[bool, bool]:
        """(improved, should_stop) after a validation."""
        if self.cfg.monitor is None:
            return False, False
        if self.cfg.monitor not in metrics:
            raise FactualityInputError(f"trainer.early_stopping.monitor={self.cfg.monitor!r} is not among the validation "
                                       f"metrics {sorted(metrics)}")
        value = float(metrics[self.cfg.monitor])
        better = self.best is None or (value > self.best if self.cfg.mode == "max" else value < self.best)
        if better:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return better, self.bad >= self.cfg.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]


# ---------------------------------------------------------------------------------------------- prompts and rewards
def encode_prompts(records: Sequence[PromptRecord], tokenizer: Any, apply_chat_template: bool,
                   max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each record's prompt as the policy sees it (chat template or raw text)."""
    out = []
    for rec in records:
        if rec.messages is not None and apply_chat_template and not rec.verbatim:
            if getattr(tokenizer, "chat_template", None) is None:
                raise FactualityInputError("data.apply_chat_template=true but the tokenizer has no chat template; "
                                           "set data.apply_chat_template=false to use raw prompts")
            ids = tokenizer.apply_chat_template(rec.messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        else:
            text = "".join(m["content"] for m in rec.messages) if rec.verbatim and rec.messages else rec.prompt
            ids = tokenizer(text, add_special_tokens=not rec.verbatim)["input_ids"]
        if len(ids) > max_prompt_tokens:
            raise FactualityInputError(f"{rec.where or 'prompt'}: {len(ids)} prompt tokens > data.max_prompt_tokens="
                                       f"{max_prompt_tokens}; shorten it or raise the limit")
        out.append(list(ids))
    return out


def completions_of(rollout: Rollout, tokenizer: Any, eos_id: int) -> tuple[list[str], list[list[int]]]:
    """(text, ids) of each response without its EOS.

    Special tokens the policy emitted mid-response stay in ``ids`` but not in the text (they cover no
    characters; ``text.alignment`` gives them empty ranges), so the reward judges readable text while
    token rewards still land one per id.
    """
    ids = [rollout.response_ids(i, eos_id=eos_id) for i in range(len(rollout))]
    return [tokenizer.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False) for x in ids], ids


def score_rollout(reward: Any, rollout: Rollout, records: Sequence[PromptRecord], tokenizer: Any,
                  eos_id: int) -> tuple[RewardBatch, list[str]]:
    """Call ``reward(prompts, completions, completion_ids=..., is_end=..., **columns)`` for a rollout.

    ``records[i]`` is the prompt record of rollout row ``i``. Token-level outputs must have one entry
    per response token (``completion_ids``); anything else is a reward bug and raises.
    """
    batch, completions, ids = call_reward(reward, rollout, records, tokenizer, eos_id)
    return check_token_outputs(batch, ids), completions


def call_reward(reward: Any, rollout: Rollout, records: Sequence[PromptRecord], tokenizer: Any,
                eos_id: int) -> tuple[RewardBatch, list[str], list[list[int]]]:
    """The reward call of ``score_rollout`` alone: (the reward's batch as returned, completions, completion ids)."""
    completions, ids = completions_of(rollout, tokenizer, eos_id)
    names = sorted({k for r in records for k in r.columns})
    columns = {k: [r.columns.get(k) for r in records] for k in names}
    batch = reward([r.prompt for r in records], completions, completion_ids=ids,
                   is_end=[bool(x) for x in rollout.is_end.tolist()], **columns)
    if len(batch) != len(rollout):
        raise RuntimeError(f"reward returned {len(batch)} scores for {len(rollout)} completions")
    return batch, completions, ids


def check_token_outputs(batch: RewardBatch, ids: Sequence[Sequence[int]]) -> RewardBatch:
    """``batch`` with its token-level outputs checked against the response token ``ids`` (one entry per token).

    A served reward always sends token rewards/signs; all-empty rows mean the method has none (e.g. a scalar
    labeller), not "zero reward on every token", so they become ``None``."""
    for attr in ("token_rewards", "token_signs"):
        values = getattr(batch, attr)
        if values is not None and any(ids) and not any(len(v) for v in values):
            setattr(batch, attr, None)
            continue
        if values is None:
            continue
        for i, (v, x) in enumerate(zip(values, ids, strict=True)):
            if len(v) != len(x):
                raise RuntimeError(f"reward {attr}[{i}] has {len(v)} entries for {len(x)} response tokens")
    return batch


def place_on_tokens(values: Sequence[np.ndarray] | None, rollout: Rollout, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Per-response-token arrays → ``[B, S-1]`` at action positions ``prompt_len - 1 + j`` (0 elsewhere)."""
    if values is None:
        return None
    out = torch.zeros(rollout.tokens.shape[0], rollout.tokens.shape[1] - 1, dtype=dtype)
    for i, v in enumerate(values):
        if len(v):
            start = int(rollout.prompt_lengths[i]) - 1
            # torch.tensor copies: a served reward's arrays are read-only views of the response buffer
            out[i, start : start + len(v)] = torch.tensor(np.asarray(v), dtype=dtype)
    return out


def build_reward(cfg: Any, tokenizer: Any) -> Any:
    """The in-process reward (``reward:`` block, built by name) or the served one (``remote_rm``), health-checked."""
    url = cfg.remote_rm.resolved_url()
    if url is not None:
        from nemo_factuality.serving.client import RemoteFactualityReward

        reward = RemoteFactualityReward(url, model_name=cfg.remote_rm.reward_model.name, timeout_s=cfg.remote_rm.timeout_s,
                                        init_timeout_s=cfg.remote_rm.init_timeout_s, retry=backoff(cfg.remote_rm.retry))
        log.info("waiting for the reward server at %s (model %r) to be ready (connect, then model ready: up to %g s "
                 "each)", url, cfg.remote_rm.reward_model.name, reward.health_wait_s)
        down = {k: v for k, v in reward.health().items() if v}
        if down:
            raise FactualityInputError(f"remote_rm: the reward server is not ready: {'; '.join(down.values())} "
                                       "(check remote_rm.url / remote_rm.reward_model.ip and that `nemo-factuality serve` runs)")
        return reward
    from nemo_factuality.registry import build_reward as build_method_reward

    reward = build_method_reward(cfg.reward, tokenizer)
    check_reward_health(reward, cfg.reward)
    return reward


def check_reward_health(reward: Any, spec: Mapping[str, Any]) -> None:
    """Fail before training when the in-process reward's judges, general RM or store are down (``health()``),
    naming each failure and the ``reward.*`` key that points at it: otherwise every reward is NaN and the
    run trains nothing while waiting on each judge's timeout."""
    health = getattr(reward, "health", None)
    down = {k: v for k, v in (health() if callable(health) else {}).items() if v}
    if not down:
        return
    parts = []
    for component, why in down.items():
        keys = [key for key, value in _location_keys(spec, "reward") if value.rstrip("/") in why]
        parts.append(f"{why} (config key{'s' if len(keys) > 1 else ''} {', '.join(keys)})" if keys else f"{component}: {why}")
    raise FactualityInputError("the reward is not ready: " + "; ".join(parts) +
                               "; start what is down, or point its config key at one that runs")


def _location_keys(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """``(dotted key, value)`` of every URL / path leaf (``*url``, ``*path``) of a reward spec."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            key = f"{prefix}.{k}"
            if isinstance(v, str) and v and str(k).endswith(("url", "path")):
                yield key, v
            else:
                yield from _location_keys(v, key)


def backoff(retry: Any) -> Any:
    """A ``RetryConfig`` (``remote_rm.retry`` / ``critic.retry``) as the clients' ``Backoff``."""
    from nemo_factuality.serving.client import Backoff

    return Backoff(max_wait_s=float(retry.max_wait_s), initial_s=float(retry.initial_s), max_s=float(retry.max_s),
                   jitter=float(retry.jitter))


def records_for_rows(records: Sequence[PromptRecord], repeats: int) -> list[PromptRecord]:
    return [r for r in records for _ in range(repeats)]


def response_stats(rollout: Rollout) -> dict[str, float]:
    lengths = (rollout.response_lengths - rollout.prompt_lengths).float()
    return {"response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "is_end_frac": rollout.is_end.float().mean().item()}
