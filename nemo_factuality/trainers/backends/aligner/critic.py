"""``RemoteCritic``: the PPO stage's ``Critic`` on NeMo-Aligner's critic server (``trainers/critic_server.py``).

    critic = RemoteCritic(cfg.critic)                     # checks critic_infer is ready within init_timeout_s
    values = critic.values(rollout)                       # [B, S-1], the actor's log-prob layout
    critic.train_step(minibatch, loss_fn, micro_batch_size=4)

``values`` sends tokens and lengths to ``critic_infer`` and keeps Aligner's ``[:, :S-1]`` (the value of the
state after ``tokens[:, :t+1]``, aligned with log-prob positions, as the hf critic). ``train_step`` sends
one PPO minibatch (tokens, returns, old values, mask) to ``critic_train``: the server runs Aligner's
clipped value loss ``0.5·masked_mean(max((clip(v, v_old ± c) − R)², (v − R)²))`` with
``critic.loss_clip_val`` — the stage's ``loss_fn`` is not sent. Aligner averages that per micro batch; the
stage's own value loss divides by the minibatch's token count, so the two agree when micro batches hold
equal token counts and weight tokens slightly differently otherwise.

Under data parallelism each rank asks for its own values (the model-parallel source rank sends; the result
is broadcast in the model-parallel group) and a minibatch is gathered onto rank 0, which sends it once:
one ``critic_train`` request is one critic optimiser step over the global minibatch.

Every failure names the URL and what to check, within ``critic.timeout_s`` / ``init_timeout_s``. A server
that refuses, drops or times out a request is waited for (``critic.retry``, jittered backoff, each wait logged
with the URL) and sent the same request again — a ``critic_train`` with the same request id (the server step it
applies to), which the server answers from the update it already applied when the first request was only slow
(queued or running, not lost), so one minibatch is never two optimiser steps. The server keeps its state in memory and resumes from its own
latest checkpoint when restarted, so once it answers again its optimiser step is compared with the one this
client expects: equal, the step goes on; one ahead on a ``critic_train`` retry, that update had gone through
before the connection dropped (its loss is reported as NaN); anything else, the restarted critic is behind the
actor and ``CriticServerRestarted`` ends the run without a new checkpoint, so the requeued job resumes both
from the last one they share. Past the window: ``CriticServerUnavailable`` (exit 75 after a checkpoint).
Importing this module imports neither NeMo nor PyTriton.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_factuality.trainers.backends.collectives import on_group_source, on_megatron_model_parallel_source
from nemo_factuality.trainers.interfaces import LossFn, Rollout
from nemo_factuality.types import ServerUnavailableError

log = logging.getLogger(__name__)

INFER, TRAIN, SAVE, STATE = "critic_infer", "critic_train", "critic_save", "critic_state"
_NO_INPUT = {"dummy_var": np.zeros(1, dtype=np.int64)}  # critic_save / critic_state take a placeholder input


def _step_of(state: Mapping[str, np.ndarray]) -> int:
    """The optimiser step in a ``critic_state`` answer."""
    return int(np.asarray(state["step"]).reshape(-1)[0])


class RemoteCriticError(RuntimeError):
    """The critic server could not be reached, refused a request, or holds another step than the checkpoint."""


class CriticServerUnavailable(RemoteCriticError, ServerUnavailableError):
    """The critic server stayed unreachable past ``critic.retry.max_wait_s`` (the stage checkpoints, exits 75)."""


class CriticServerRestarted(RemoteCriticError, ServerUnavailableError):
    """The critic server came back at another optimiser step than this run's: its state is not the actor's
    partner any more, so no checkpoint may be written now; the run exits 75 and resumes from the last one."""

    checkpoint_safe = False


def _what_to_check(url: str) -> str:
    return (f"check that `python -m nemo_factuality.trainers.critic_server` is running and reachable at {url} "
            "(critic.url; it listens on critic.port) and its log for errors")


class RemoteCritic:
    """``Critic`` whose weights, optimiser and checkpoints live in the critic server."""

    # one server step on the minibatch gathered from every data-parallel rank (critic.micro_batch_size splits that)
    trains_on_gathered_minibatch = True

    def __init__(self, cfg: Any, *, check: bool = True) -> None:
        if not cfg.url:
            raise RemoteCriticError("critic.url is not set: the aligner backend's PPO critic is the critic server")
        self.url = cfg.url.rstrip("/")
        self.timeout_s, self.init_timeout_s = float(cfg.timeout_s), float(cfg.init_timeout_s)
        self.micro_batch_size = int(cfg.micro_batch_size)
        from nemo_factuality.serving.client import Backoff
        from nemo_factuality.trainers.runtime import backoff

        retry = getattr(cfg, "retry", None)
        self.retry = backoff(retry) if retry is not None else Backoff()
        self.expected_step: int | None = None  # the server's optimiser step as this run knows it
        self.committed_step: int | None = None  # the server step the last checkpoint paired with (None: none yet)
        if check:
            from nemo_factuality.trainers.backends.aligner.reward import check_reward_server

            # every model a step sends to, in one window: Triton readies a server's models one by one, so a
            # critic_infer that answers says nothing of critic_state (a loaded node takes seconds between them)
            deadline = time.monotonic() + self.init_timeout_s
            for model in (INFER, TRAIN, STATE):
                check_reward_server(self.url, model, timeout_s=max(0.0, deadline - time.monotonic()),
                                    hint=_what_to_check(self.url), error=RemoteCriticError, what="critic server")

    # ---- requests ------------------------------------------------------------------------------
    def _send(self, model: str, inputs: Mapping[str, np.ndarray], batched: bool,
              timeout_s: float | None = None) -> dict[str, np.ndarray]:
        from nemo_factuality.serving.client import pytriton_client, quiet_pytriton_timeouts

        ModelClient = pytriton_client().ModelClient

        init_s, infer_s = (self.init_timeout_s, self.timeout_s) if timeout_s is None else (timeout_s, timeout_s)
        with quiet_pytriton_timeouts(), ModelClient(self.url, model, init_timeout_s=init_s,
                                                    inference_timeout_s=infer_s) as client:
            return client.infer_batch(**inputs) if batched else client.infer_sample(**inputs)

    def _request(self, model: str, inputs: Mapping[str, np.ndarray], *, batched: bool) -> dict[str, np.ndarray]:
        """One request, retried while the server is away (``critic.retry``); after a failure, the server's step is
        checked before the request is sent again (see the module docstring)."""
        from nemo_factuality.serving.client import call_with_retry

        failed = False

        def attempt() -> dict[str, np.ndarray]:
            if failed and model != STATE:
                done = self._check_step_after_outage(model)
                if done is not None:
                    return done
            return self._send(model, inputs, batched)

        def note_failure() -> None:
            nonlocal failed
            failed = True

        try:
            return call_with_retry(attempt, what="critic server", url=self.url, backoff=self.retry,
                                   key="critic.retry.max_wait_s", before_retry=note_failure,
                                   unavailable=lambda msg: CriticServerUnavailable(f"{msg}: {_what_to_check(self.url)}"))
        except RemoteCriticError:
            raise
        except Exception as err:  # PyTriton raises several client error types; all end the step the same way
            raise RemoteCriticError(f"critic server {self.url} failed {model} ({_last_error_line(err)}): "
                                    f"{_what_to_check(self.url)}") from err

    def _check_step_after_outage(self, model: str) -> dict[str, np.ndarray] | None:
        """The server answers again: is it still at this run's step? ``{"loss_mean": NaN}`` when a retried
        ``critic_train`` finds its update already applied (send nothing); None to send the request."""
        if self.expected_step is None:
            return None
        now = _step_of(self._send(STATE, _NO_INPUT, False))
        if now == self.expected_step:
            return None
        if model == TRAIN and now == self.expected_step + 1:
            log.warning("critic server %s had applied the update before the connection dropped (step %d); its loss "
                        "was lost (logged as NaN)", self.url, now)
            return {"loss_mean": np.array([np.nan], dtype=np.float32)}
        raise CriticServerRestarted(
            f"critic server {self.url} came back at optimiser step {now}, but this run's critic is at step "
            f"{self.expected_step}: it restarted from an older checkpoint, so the run stops without a new checkpoint; "
            "rerun (the requeued job) to resume actor and critic from their last shared checkpoint")

    # ---- Critic --------------------------------------------------------------------------------
    def values(self, rollout: Rollout) -> torch.Tensor:
        """``[B, S-1]`` values of this rank's rollout (no grad)."""
        self._know_step()
        tokens = rollout.tokens.long()
        width = tokens.shape[1]
        inputs = {"tokens": tokens.numpy().astype(np.int64),
                  "sequence_lengths": rollout.response_lengths.long().unsqueeze(1).numpy().astype(np.int64)}
        out = on_megatron_model_parallel_source(lambda: self._request(INFER, inputs, batched=True)["values"])
        values = torch.from_numpy(np.array(out, dtype=np.float32))  # a copy: the response buffer is read-only
        assert values.shape[0] == tokens.shape[0] and values.shape[1] >= width - 1, (values.shape, tokens.shape)
        return values[:, : width - 1].contiguous()

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One critic optimiser step on the server over the global minibatch (``loss_fn`` stays here: the server
        runs Aligner's value loss). ``loss/value`` is the mean share per micro batch and data-parallel rank, as every
        backend's train_step reports it; ``critic/server_loss`` is the server's minibatch loss."""
        del loss_fn
        self._know_step()
        rows = {"tokens": batch["tokens"].long(), "returns": batch["returns"].float(),
                "prev_values": batch["old_values"].float(), "mask": batch["mask"].float()}
        gathered = _gather_to_rank0({k: v.numpy() for k, v in rows.items()})
        # the update's id: the server step it applies to. A resend after a timeout carries the same id, and a server
        # whose first request was only slow answers it from that update instead of applying a second one
        request_id = np.array([self.expected_step], dtype=np.int64)
        loss = on_group_source(lambda: float(self._request(TRAIN, {**_pad_and_concat(gathered), "request_id": request_id},
                                                     batched=False)["loss_mean"].reshape(-1)[0]), None)
        self.expected_step = None if self.expected_step is None else self.expected_step + 1  # every rank counts it
        # the stages sum ``loss/*`` back over micro batches and data-parallel ranks (each backend reports its mean share)
        shares = max(1, -(-int(batch["tokens"].shape[0]) // micro_batch_size)) * _data_parallel_size()
        return {"loss/value": loss / shares, "critic/server_loss": loss}

    def server_step(self) -> int:
        """The server's optimiser step (asked on rank 0, the same on every rank); this run expects it from now on."""
        self.expected_step = int(on_group_source(lambda: _step_of(self._request(STATE, _NO_INPUT, batched=False)), None))
        return self.expected_step

    def _know_step(self) -> None:
        if self.expected_step is None:
            self.server_step()

    def save(self, path: Path) -> None:
        """The server writes its own checkpoint; ``critic.json`` records which server step belongs to this one (the
        critic server resumes from the step the run's committed checkpoint names: ``critic_server._latest``).

        A server that does not answer a short probe is not asked to save — that would wait a second retry window
        and end with no checkpoint at all: the checkpoint pairs the actor with the critic's last committed step
        (``None``: a fresh critic), which the restarted server resumes from."""
        probe_s = min(self.init_timeout_s, 10.0)

        def save_if_answering() -> int | None:
            try:
                self._send(STATE, _NO_INPUT, False, timeout_s=probe_s)
            except Exception as err:  # gone: keep the committed pairing
                log.warning("critic server %s did not answer within %.0f s (%s): this checkpoint pairs the actor with "
                            "the critic's last committed step %s, which the restarted server resumes from", self.url,
                            probe_s, _last_error_line(err), self.committed_step)
                return None
            self._request(SAVE, _NO_INPUT, batched=False)
            return _step_of(self._request(STATE, _NO_INPUT, batched=False))

        saved = on_group_source(save_if_answering, None)  # on global rank 0, relayed to every rank
        if saved is not None:
            self.expected_step = self.committed_step = saved
        if _rank() == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "critic.json").write_text(json.dumps({"url": self.url, "server_step": self.committed_step}),
                                                    encoding="utf-8")

    def load(self, path: Path) -> None:
        """The server resumed from its own latest checkpoint at start-up: check it is this checkpoint's step."""
        info = json.loads((Path(path) / "critic.json").read_text(encoding="utf-8"))
        now = self.server_step()
        committed = info["server_step"]  # None: saved while the critic had no checkpoint (it starts fresh, at 0)
        self.committed_step = committed
        if now != (0 if committed is None else int(committed)):
            raise RemoteCriticError(
                f"the critic server at {self.url} is at optimiser step {now} but the checkpoint {path} was saved with "
                f"it at step {info['server_step']}: restart the critic server so it resumes from its latest checkpoint "
                "(<exp_manager.explicit_log_dir>/critic/checkpoints), saved together with this one")

    def close(self) -> None:
        """Nothing is held between requests (each opens and closes its client)."""


def _last_error_line(err: Exception) -> str:
    """The server's own error (its traceback's last ``…Error: …`` line) rather than the whole relayed traceback."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    return f"{type(err).__name__}: {line[:300]}"


# ---- the few collectives it needs (no-ops without torch.distributed) --------------------------------
def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _data_parallel_size() -> int:
    if not torch.distributed.is_initialized():
        return 1
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size()


def _gather_to_rank0(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]] | None:
    """Every data-parallel rank's minibatch shard on global rank 0 (None elsewhere). Model-parallel peers hold
    the same shard, so only the data-parallel group of rank 0 is gathered."""
    if not torch.distributed.is_initialized():
        return [arrays]
    from megatron.core import parallel_state as mpu

    group = mpu.get_data_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    if 0 not in ranks:
        return None
    out: list[Any] | None = [None] * len(ranks) if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(arrays, out, dst=0, group=group)
    return out


def _pad_and_concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Shards right-padded to one width (tokens with 0, the rest with 0: masked out) and stacked."""
    out = {}
    for key in parts[0]:
        width = max(p[key].shape[1] for p in parts)
        dtype = np.int64 if key == "tokens" else np.float32
        out[key] = np.concatenate([np.pad(p[key], ((0, 0), (0, width - p[key].shape[1]))) for p in parts]).astype(dtype)
    return out
