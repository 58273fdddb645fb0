"""NeMo-Aligner's reward client (``RemoteGPTRMClient``) with bounded waits and guaranteed cleanup.

Aligner's ``HTTPCommunicator`` builds ``FuturesModelClient(init_timeout_s=6000, inference_timeout_s=600000)``
and nothing closes it when a run raises: a refused connection surfaces as "Timeout: 600000 s" hours
later, and an exception leaves the client's worker threads alive so the process never exits.
``remote_reward_client`` instead

* checks, on every rank before the first rollout, that the server answers and serves the model, within
  ``init_timeout_s``, and fails naming the URL, the model and what to check;
* builds the same client with our timeouts; a request the server refused, dropped or timed out is sent
  again by the project's one retry loop (``serving.client.call_with_retry``, ``remote_rm.retry``: jittered
  backoff, each wait logged with the URL) on the model-parallel source rank while the other ranks wait in
  Aligner's broadcast; past the window, or for an error the server answered, a ``RemoteRewardError``
  (``RewardServerUnavailable``: exit 75) naming the URL;
* closes the client in ``finally``, whatever happens in the block.

    with remote_reward_client(cfg.remote_rm, pad_to_length=4096) as rm:
        rewards = rm.infer_rm(rollout_batch).result()

Importing this module imports nothing from NeMo or PyTriton.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx

from nemo_factuality.serving.client import Backoff, RemoteRewardError, RewardServerUnavailable, call_with_retry

log = logging.getLogger(__name__)


def _what_to_check(url: str, model: str) -> str:
    return (f"check that `nemo-factuality serve` (or Aligner's serve_reward_model.py) is running and reachable at {url}, "
            f"that it serves the model {model!r} (remote_rm.reward_model.name), and remote_rm.url / "
            f"remote_rm.reward_model.ip/port")


def check_reward_server(url: str, model: str, *, timeout_s: float, hint: str | None = None,
                        error: type[Exception] = RemoteRewardError, what: str = "reward server") -> None:
    """Wait at most ``timeout_s`` for Triton's ``/v2/models/<model>/ready``; raise ``error`` (naming the URL, the
    model and ``hint``: what to check) otherwise.

    Triton answers 400 both for a model it is still loading (a server readies its models one by one, seconds
    apart) and for one it does not serve, so a 400 is waited on like a closed port; a 404 is not Triton's
    answer (another service on that port) and fails at once."""
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer"
    while True:
        try:
            response = httpx.get(f"{url}/v2/models/{model}/ready", timeout=min(5.0, max(timeout_s, 0.1)))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code} for /v2/models/{model}/ready"
            if response.status_code == 400:
                last += ": still loading, or not a model this server serves"
            elif response.status_code == 404:
                break  # not a Triton server: waiting will not help
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise error(f"{what} {url} is not ready after {time.monotonic() - start:.1f} s ({last}): "
                f"{hint or _what_to_check(url, model)}")


@functools.lru_cache(maxsize=1)
def _bounded_client_classes():
    """NeMo-Aligner's remote reward client with bounded timeouts, retries and errors that name the server."""
    import torch
    from nemo_aligner.models.nlp.gpt.reward_critic_clients import RemoteGPTRMClient

    communicator_class, result_class = _bounded_communicator_class(), _named_result_class()

    class BoundedRemoteRMClient(RemoteGPTRMClient):
        """``RemoteGPTRMClient`` whose communicator takes ``cfg.init_timeout_s`` / ``cfg.timeout_s``."""

        def __post_init__(self):
            cfg = self.cfg
            self.communicator = communicator_class(cfg.init_timeout_s, cfg.timeout_s)
            self.communicator.add_server_by_name(cfg.reward_model.name, cfg.reward_model.ip, cfg.reward_model.port)
            self.pad_to_length = cfg.pad_to_length
            self.url = f"http://{cfg.reward_model.ip}:{cfg.reward_model.port}"
            retry = cfg.get("retry") or {}
            self.backoff = Backoff(**retry) if retry else Backoff()

        def infer_rm(self, rollout_batch):
            future = super().infer_rm(rollout_batch)
            return result_class(future.rm_future, self.url, self.cfg.reward_model.name,
                                lambda: self._send_again(rollout_batch), self.backoff)

        def _send_again(self, rollout_batch):
            """The same payload as ``infer_rm`` on a fresh synchronous client (the futures client's worker may hold
            the dropped connection)."""
            from nemo_factuality.serving.client import pytriton_client

            ModelClient = pytriton_client().ModelClient
            tokens = rollout_batch["response_tokens"].cpu()
            if self.pad_to_length is not None:
                tokens = torch.nn.functional.pad(tokens, (0, self.pad_to_length - tokens.size(-1)), value=0)
            data = {"tokens": tokens.numpy(), "sequence_lengths": rollout_batch["response_lengths"].unsqueeze(1).cpu().numpy()}
            with ModelClient(self.url, self.cfg.reward_model.name, init_timeout_s=self.cfg.init_timeout_s,
                             inference_timeout_s=self.cfg.timeout_s) as client:
                return client.infer_batch(**data)

    return BoundedRemoteRMClient


def _bounded_communicator_class():
    """Aligner's ``HTTPCommunicator`` whose PyTriton clients take an inference timeout (Aligner's wait forever)."""
    from nemo_aligner.servers.http_communicator import HTTPCommunicator

    from nemo_factuality.serving.client import pytriton_client

    FuturesModelClient = pytriton_client().FuturesModelClient  # before Aligner's communicator makes its clients

    class BoundedHTTPCommunicator(HTTPCommunicator):
        def __init__(self, init_timeout_s: float, inference_timeout_s: float) -> None:
            super().__init__(init_timeout_s=init_timeout_s)
            self.inference_timeout_s = inference_timeout_s

        def add_server_by_name(self, server_name, ip="localhost", port=5555):
            client = FuturesModelClient(f"http://{ip}:{port}", server_name, init_timeout_s=self.init_timeout_s,
                                        inference_timeout_s=self.inference_timeout_s)
            self.connections[server_name] = (ip, port, client)

    return BoundedHTTPCommunicator


class _Done:
    """A finished future holding ``output``."""

    def __init__(self, output) -> None:
        self.output = output

    def result(self):
        return self.output


def _named_result_class():
    """Aligner's ``RMFutureResult`` that retries while the server is away and names it in every error."""
    from nemo_aligner.models.nlp.gpt.reward_critic_clients import RMFutureResult

    class NamedRMFutureResult(RMFutureResult):
        """Aligner's result (broadcast over the model-parallel group): on the source rank the request is retried
        while the server is away (a fresh synchronous client per resend), and errors name the server."""

        def __init__(self, rm_future, url: str, model: str, resend, backoff: Backoff) -> None:
            super().__init__(rm_future)
            self.url, self.model, self.resend, self.backoff = url, model, resend, backoff

        def result(self):
            if self.rm_future is not None:  # the model-parallel source rank: it alone holds a request
                self.rm_future = _Done(self._output_with_retry())
            return super().result()

        def _output_with_retry(self):
            first = [self.rm_future]

            def attempt():
                future, first[0] = first[0], None
                return future.result() if future is not None else self.resend()

            hint = f"{_what_to_check(self.url, self.model)}, or raise remote_rm.timeout_s"
            try:
                return call_with_retry(attempt, what="reward server", url=f"{self.url} (model {self.model!r})",
                                       backoff=self.backoff, key="remote_rm.retry.max_wait_s",
                                       unavailable=lambda msg: RewardServerUnavailable(f"{msg}. {hint}"))
            except RemoteRewardError:
                raise
            except Exception as err:
                raise RemoteRewardError(f"reward request to {self.url} (model {self.model!r}) failed: "
                                        f"{type(err).__name__}: {err}. {hint}") from err

    return NamedRMFutureResult


def _endpoint(remote_rm: Any) -> tuple[str, int, str]:
    """(ip, port, model name) from ``remote_rm.url`` or ``remote_rm.reward_model.{ip,port}``."""
    model = remote_rm.reward_model.name
    url = getattr(remote_rm, "url", None)
    if url:
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise RemoteRewardError(f"remote_rm.url={url!r} must look like http://host:port")
        return parts.hostname, parts.port, model
    if not remote_rm.reward_model.ip:
        raise RemoteRewardError("remote_rm has neither url nor reward_model.ip: say where the reward server runs")
    return remote_rm.reward_model.ip, int(remote_rm.reward_model.port), model


def _retry_fields(retry: Any) -> dict[str, float]:
    if retry is None:
        return {}
    return {k: float(getattr(retry, k) if not isinstance(retry, dict) else retry[k])
            for k in ("max_wait_s", "initial_s", "max_s", "jitter")}


@contextmanager
def remote_reward_client(remote_rm: Any, *, pad_to_length: int | None, check: bool = True) -> Iterator[Any]:
    """Aligner's ``RemoteGPTRMClient`` for ``remote_rm`` (url | reward_model.{name,ip,port}, init_timeout_s,
    timeout_s, retry.{max_wait_s,initial_s,max_s,jitter}), checked before use and always closed."""
    from omegaconf import OmegaConf

    ip, port, model = _endpoint(remote_rm)
    init_timeout = float(getattr(remote_rm, "init_timeout_s", 60.0))
    if check:
        check_reward_server(f"http://{ip}:{port}", model, timeout_s=init_timeout)
    cfg = OmegaConf.create({"reward_model": {"name": model, "ip": ip, "port": port}, "pad_to_length": pad_to_length,
                            "init_timeout_s": init_timeout, "timeout_s": float(getattr(remote_rm, "timeout_s", 600.0)),
                            "retry": _retry_fields(getattr(remote_rm, "retry", None))})
    client = _bounded_client_classes()(cfg)
    try:
        yield client
    finally:
        client.communicator.close()
