"""General (helpfulness) reward models for KLCF's ``w_rm · σ(s_RM)`` term.

Two kinds, both called ``rm(prompts, completions) -> list[float]`` (raw scores, one per sample):

* ``{kind: hf, model_path: DIR}`` — a local Hugging Face ``*ForSequenceClassification`` model with one
  output (Skywork-Reward-V2 style): the (prompt, response) pair is rendered with the model's chat
  template (plain ``prompt\\n\\nresponse`` when it has none) and the single logit is the score.
  ``trust_remote_code`` is an explicit opt-in.
* ``{kind: remote, url: http://host:5555, model_name: factuality_reward}`` — a general RM served by
  ``nemo-factuality serve --config-name general_rm`` (the ``general_rm`` reward below): prompts and
  completions are sent as they are and a score the server could not compute comes back NaN.
* ``{kind: remote, url: http://host:5555, model_name: reward_model}`` — any server speaking NeMo-Aligner's
  ``reward_model`` protocol (``sentences`` bytes in, ``rewards [B, 1]`` out), e.g. an Aligner RM server; the
  text sent is ``template``. (That protocol has no NaN: a failed sample arrives as the server's fill value.)

A failure raises ``GeneralRMError`` (the KLCF reward turns it into per-sample NaN + reason).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nemo_factuality.registry import REWARDS
from nemo_factuality.rewards.base import validate_batch
from nemo_factuality.types import FactualityInputError, RewardBatch

log = logging.getLogger(__name__)
RICH_MODEL = "factuality_reward"  # what `nemo-factuality serve` serves with prompts/completions in, NaN kept


class GeneralRMError(RuntimeError):
    """The general reward model could not score a batch."""


class HFRewardModel:
    """A local single-logit sequence-classification reward model.

    Args:
        model_path: local directory with the model and its tokenizer.
        batch_size: sequences per forward pass.
        max_length: truncation length (tokens) of each rendered conversation.
        device: torch device.
        trust_remote_code: allow the model's own modelling code (explicit opt-in).
    """

    def __init__(self, model_path: str, batch_size: int = 8, max_length: int = 4096, device: str = "cpu",
                 trust_remote_code: bool = False) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from nemo_factuality.local_models import check_model_dir, from_pretrained

        key = "general_rm.model_path"  # a local *ForSequenceClassification reward model directory
        path = check_model_dir(model_path, key, tokenizer=True)
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, path, key, trust_remote_code=trust_remote_code)
        self.model = from_pretrained(AutoModelForSequenceClassification.from_pretrained, path, key,
                                     trust_remote_code=trust_remote_code)
        self.model = self.model.to(device).eval()
        if self.model.config.num_labels != 1:
            raise FactualityInputError(f"general_rm {path}: expected a reward model with one output, "
                                       f"got num_labels={self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:  # batched scoring needs to find each row's last token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
                else self.tokenizer.eos_token_id
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.path, self.batch_size, self.max_length, self.device, self._torch = str(path), batch_size, max_length, device, torch

    def render(self, prompt: str, completion: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return f"{prompt}\n\n{completion}"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        texts = [self.render(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt", add_special_tokens=False).to(self.device)
            with self._torch.no_grad():
                out.extend(self.model(**enc).logits[:, 0].float().tolist())
        return out

    def health(self) -> dict[str, str | None]:
        return {f"general_rm:{self.path}": None}


class RemoteRewardModel:
    """A served general RM (PyTriton): our ``factuality_reward`` model (prompts + completions → scores, NaN kept)
    or NeMo-Aligner's ``reward_model`` protocol (``sentences`` → ``rewards``)."""

    def __init__(self, url: str, model_name: str = "reward_model", timeout_s: float = 60.0,
                 template: str = "{prompt}\n\n{response}") -> None:
        self.url, self.model_name, self.timeout_s, self.template = url, model_name, timeout_s, template

    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        from nemo_factuality.serving.client import (
            RemoteFactualityReward,
            RemoteRewardError,
            pytriton_client,
            quiet_pytriton_timeouts,
        )

        ModelClient = pytriton_client().ModelClient

        if self.model_name == RICH_MODEL:
            client = RemoteFactualityReward(self.url, model_name=self.model_name, timeout_s=self.timeout_s,
                                            init_timeout_s=self.timeout_s)
            try:
                return client(prompts, completions).scores.tolist()
            except RemoteRewardError as err:
                raise GeneralRMError(f"general RM: {err}; check reward.general_rm.url / timeout_s") from err
        sentences = np.array([[self.template.format(prompt=p, response=c).encode("utf-8")]
                              for p, c in zip(prompts, completions, strict=True)], dtype=object)
        try:
            with quiet_pytriton_timeouts(), ModelClient(self.url, self.model_name, init_timeout_s=self.timeout_s,
                                                        inference_timeout_s=self.timeout_s) as client:
                out = client.infer_batch(sentences=sentences)
        except Exception as err:
            raise GeneralRMError(f"general RM {self.url} (model {self.model_name!r}) failed: {type(err).__name__}: {err}; "
                                 "check the server or reward.general_rm.url / timeout_s") from err
        return np.asarray(out["rewards"], dtype=np.float64).reshape(-1).tolist()

    def health(self) -> dict[str, str | None]:
        from nemo_factuality.serving.client import pytriton_client, quiet_pytriton_timeouts

        ModelClient = pytriton_client().ModelClient

        key = f"general_rm:{self.url}/{self.model_name}"
        try:
            with quiet_pytriton_timeouts(), ModelClient(self.url, self.model_name, init_timeout_s=5.0) as client:
                client.wait_for_model(timeout_s=5.0)
            return {key: None}
        except Exception as err:
            return {key: f"{self.url} model {self.model_name!r} not ready: {err}"}


def build_general_rm(spec: Mapping[str, Any] | Any) -> Any:
    """A general RM from ``{kind: hf | remote, ...}``; a callable is returned as is."""
    if callable(spec):
        return spec
    spec = dict(spec)
    kind = spec.pop("kind", "hf")
    if kind == "hf":
        return HFRewardModel(**spec)
    if kind == "remote":
        return RemoteRewardModel(**spec)
    raise FactualityInputError(f"general_rm.kind must be 'hf' or 'remote', got {kind!r}")


class GeneralRMReward:
    """A general RM as a servable reward: ``nemo-factuality serve --config-name general_rm`` puts it behind
    ``factuality_reward`` for KLCF's ``general_rm: {kind: remote, model_name: factuality_reward}``. The score is the
    model's raw logit (KLCF applies its own σ(s / rm_temperature))."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> RewardBatch:
        validate_batch(prompts, completions, columns, who="general_rm")
        scores = np.asarray(self.model(list(prompts), list(completions)), dtype=np.float64) if completions else np.zeros(0)
        return RewardBatch(scores, {"general_rm": scores})

    def health(self) -> dict[str, str | None]:
        return self.model.health()


@REWARDS.register("general_rm")
def build_general_rm_reward(model_path: str, batch_size: int = 8, max_length: int = 4096, device: str = "cpu",
                            trust_remote_code: bool = False) -> GeneralRMReward:
    """The ``general_rm`` reward: a local ``*ForSequenceClassification`` model (``HFRewardModel``) served as is."""
    return GeneralRMReward(HFRewardModel(model_path, batch_size=batch_size, max_length=max_length, device=device,
                                         trust_remote_code=trust_remote_code))
