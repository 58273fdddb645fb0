"""Adapters from the one batched reward call to NeMo-RL, verl and TRL.

* ``FactualityEnvironment(reward).step(message_logs, metadata)`` → ``EnvironmentReturn`` (NeMo-RL's
  ``EnvironmentInterface`` shape, duck-typed so nemo_rl need not be installed): the prompt is the
  last user turn, the completion the last assistant turn, and ``metadata`` dicts become columns.
* ``make_compute_score(reward)`` → verl's ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None) -> {"score": ..., **components}``.
* ``make_trl_reward_funcs(reward)`` → TRL ``reward_funcs``: ``f(prompts, completions, **kwargs) ->
  list[float | None]`` (``None`` = abstain), optionally one function per component.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from nemo_factuality.interfaces import FactualityReward
from nemo_factuality.types import FactualityInputError

if TYPE_CHECKING:  # torch loads where a tensor is made: `import nemo_factuality.rewards` (every config check) stays light
    import torch


class EnvironmentReturn(NamedTuple):
    observations: list[dict[str, str]]
    metadata: list[dict[str, Any]]
    next_stop_strings: list[list[str] | None]
    rewards: torch.Tensor
    terminateds: torch.Tensor


def _text(message: Any) -> str:
    content = message.get("content", "") if isinstance(message, dict) else message
    return content if isinstance(content, str) else str(content)


def _split_log(log: Sequence[dict[str, Any]], i: int) -> tuple[str, str]:
    assistants = [m for m in log if m.get("role") == "assistant"]
    users = [m for m in log if m.get("role") == "user"]
    if not assistants:
        raise FactualityInputError(f"message_logs[{i}] has no assistant turn to score")
    return (_text(users[-1]) if users else ""), _text(assistants[-1])


def _columns(metadata: Sequence[dict[str, Any]] | None, n: int) -> dict[str, list[Any]]:
    """Per-sample metadata dicts → columns; a metadata list of the wrong length is an error, never dropped."""
    if metadata is None:
        return {}
    if len(metadata) != n:
        raise FactualityInputError(f"FactualityEnvironment.step: {len(metadata)} metadata entries for {n} message logs; "
                                   "pass one metadata dict (or None) per sample")
    keys = sorted({k for m in metadata for k in (m or {})})
    return {k: [(m or {}).get(k) for m in metadata] for k in keys}


class FactualityEnvironment:
    """NeMo-RL environment around any ``FactualityReward`` (single-turn: every step terminates)."""

    def __init__(self, reward: FactualityReward, *, nan_reward: float = 0.0) -> None:
        self.reward, self.nan_reward = reward, nan_reward

    def step(self, message_logs: Sequence[Sequence[dict[str, Any]]], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        import torch

        pairs = [_split_log(log, i) for i, log in enumerate(message_logs)]
        batch = self.reward([p for p, _ in pairs], [c for _, c in pairs], **_columns(metadata, len(pairs)))
        rewards = torch.tensor([self.nan_reward if math.isnan(s) else s for s in batch.scores], dtype=torch.float32)
        obs = [{"role": "environment", "content": f"reward {r:.4f}"} for r in rewards.tolist()]
        meta = [dict(m or {}, **batch.sample_dict(i)) for i, m in enumerate(metadata or [None] * len(pairs))]
        for i, d in enumerate(batch.details or []):
            if d.get("error"):
                meta[i]["error"] = d["error"]
        return EnvironmentReturn(obs, meta, [None] * len(pairs), rewards, torch.ones(len(pairs), dtype=torch.bool))

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        return batch, {}


def make_compute_score(reward: FactualityReward, *, nan_score: float = 0.0) -> Callable[..., dict[str, float]]:
    """verl ``custom_reward_function``: one sample in, ``{"score", **components}`` out."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, float]:
        extra = dict(extra_info or {})
        prompt = str(extra.pop("prompt", ""))
        columns = {k: [v] for k, v in extra.items()}
        columns.setdefault("ground_truth", [ground_truth])
        out = reward([prompt], [solution_str], **columns).sample_dict(0)
        return {k: (nan_score if (k == "score" and math.isnan(v)) else v) for k, v in out.items()}

    compute_score.__name__ = f"{type(reward).__name__}_compute_score"
    return compute_score


def make_trl_reward_funcs(reward: FactualityReward, *, components: Sequence[str] = ()) -> list[Callable[..., list[float | None]]]:
    """TRL ``reward_funcs``: the score, plus one function per named component if asked."""

    def _call(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_extra", "log_metric", "completion_ids")
                  or k == "completion_ids"}
        p = [_text(x[-1]) if isinstance(x, list) else str(x) for x in prompts]
        c = [_text(x[-1]) if isinstance(x, list) else str(x) for x in completions]
        return reward(p, c, **kwargs)

    def score(prompts, completions, **kwargs):
        return _call(prompts, completions, **kwargs).to_list()

    score.__name__ = type(reward).__name__.lower()
    funcs = [score]
    for name in components:
        def component(prompts, completions, _name=name, **kwargs):
            values = _call(prompts, completions, **kwargs).components[_name]
            return [None if math.isnan(v) else float(v) for v in values]

        component.__name__ = f"{score.__name__}_{name}"
        funcs.append(component)
    return funcs
