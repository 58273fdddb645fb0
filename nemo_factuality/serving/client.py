"""``RemoteFactualityReward``: the served reward with the in-process call shape.

    reward = RemoteFactualityReward("http://reward-node:5555")
    batch = reward(prompts, completions, ground_truth=[...])     # -> RewardBatch

Errors name the URL, the model and the config key to change; nothing is retried silently.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from nemo_factuality.types import FactualityInputError, RewardBatch, Span


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or refused the request."""


@contextlib.contextmanager
def quiet_pytriton_timeouts() -> Iterator[None]:
    """PyTriton warns on every client whose connect wait is shorter than its request timeout, which is how
    these clients are set up on purpose (a bounded wait for the server, a long one for a judged batch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Client network and/or connection timeout")
        yield


class RemoteFactualityReward:
    def __init__(self, url: str, *, model_name: str = "factuality_reward", timeout_s: float = 120.0,
                 init_timeout_s: float = 30.0) -> None:
        self.url, self.model_name, self.timeout_s, self.init_timeout_s = url, model_name, timeout_s, init_timeout_s

    def _client(self) -> Any:
        from pytriton.client import ModelClient

        return ModelClient(self.url, self.model_name, init_timeout_s=self.init_timeout_s, inference_timeout_s=self.timeout_s)

    def health(self) -> dict[str, str | None]:
        from pytriton.client import ModelClient

        try:
            with quiet_pytriton_timeouts(), ModelClient(self.url, self.model_name,
                                                        init_timeout_s=min(self.init_timeout_s, 5.0)) as client:
                client.wait_for_model(timeout_s=min(self.init_timeout_s, 5.0))
            return {f"reward_server:{self.model_name}": None}
        except Exception as err:
            return {f"reward_server:{self.model_name}": f"{self.url} model {self.model_name!r} not ready: {err}"}

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        n = len(completions)
        if len(prompts) != n:
            raise FactualityInputError(f"remote reward: {len(prompts)} prompts but {n} completions")
        if n == 0:
            return RewardBatch(np.zeros(0))
        rows = [{k: v[i] for k, v in columns.items() if v is not None} for i in range(n)]
        payload = {
            "prompts": np.array([[p.encode("utf-8")] for p in prompts], dtype=object),
            "completions": np.array([[c.encode("utf-8")] for c in completions], dtype=object),
            "columns": np.array([[json.dumps(r, default=_jsonable).encode("utf-8")] for r in rows], dtype=object),
        }
        try:
            with quiet_pytriton_timeouts(), self._client() as client:
                out = client.infer_batch(**payload)
        except Exception as err:
            raise RemoteRewardError(
                f"reward server {self.url} (model {self.model_name!r}) failed: {type(err).__name__}: {err}. "
                f"Check that 'nemo-factuality serve' is running there and its judges are ready "
                f"(GET /health/ready), or raise reward.timeout_s (now {self.timeout_s:g} s)") from err
        return _to_batch(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


def _to_batch(out: dict[str, np.ndarray]) -> RewardBatch:
    details = [json.loads(d[0]) for d in out["details"]]
    lengths = [d["n_response_tokens"] for d in details]
    comps = sorted({k for d in details for k in d["components"]})
    components = {k: np.array([np.nan if d["components"].get(k) is None else d["components"][k] for d in details]) for k in comps}
    offsets = [d["response_offset"] for d in details]
    token_rewards = [out["token_rewards"][i, o : o + n] for i, (o, n) in enumerate(zip(offsets, lengths))]
    token_signs = [out["token_signs"][i, o : o + n] for i, (o, n) in enumerate(zip(offsets, lengths))]
    present = details[0].get("token_outputs") if details else None
    if present is not None:  # the reward has no such output: the zeros on the wire are padding, not values
        token_rewards = token_rewards if "token_rewards" in present else None
        token_signs = token_signs if "token_signs" in present else None
    sentence_labels = sentence_spans = None
    if details and all("sentence_labels" in d and "sentence_spans" in d for d in details):  # a labeller (FactAlign)
        sentence_labels = [[bool(x) for x in d["sentence_labels"]] for d in details]
        sentence_spans = [[Span(int(a), int(b)) for a, b in d["sentence_spans"]] for d in details]
    return RewardBatch(out["rewards"].reshape(-1).astype(np.float64), components, token_rewards=token_rewards,
                       token_signs=token_signs, details=[d.get("details", {}) for d in details],
                       sentence_labels=sentence_labels, sentence_spans=sentence_spans)
