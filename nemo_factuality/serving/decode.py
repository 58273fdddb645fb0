"""Turn NeMo-Aligner's payload (policy token ids, 0-padded, with lengths) back into prompt and response."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_factuality.types import FactualityInputError


@dataclass(frozen=True)
class DecodedSample:
    prompt: str
    response: str
    prompt_len: int  # tokens before the response
    length: int  # prompt + response tokens (the valid part of the row)
    response_ids: tuple[int, ...]


def default_response_marker(tokenizer: Any) -> str:
    """The text a chat template puts before the assistant's reply (e.g. ``<|im_start|>assistant\\n``)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise FactualityInputError("policy tokenizer has no chat template; set response_marker in the serve config")
    probe = [{"role": "user", "content": "\x00probe\x00"}]
    with_gen = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    marker = with_gen[len(without):] if with_gen.startswith(without) else ""
    if not marker:
        raise FactualityInputError("could not derive the assistant marker from the chat template; set response_marker")
    return marker


class PayloadDecoder:
    """Decodes ``tokens [B, S]`` + ``sequence_lengths [B, 1]`` with the policy tokenizer."""

    def __init__(self, tokenizer: Any, response_marker: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.marker = response_marker or default_response_marker(tokenizer)
        self.marker_ids = list(tokenizer(self.marker, add_special_tokens=False)["input_ids"])

    def _find_prompt_len(self, ids: list[int], i: int) -> int:
        m = len(self.marker_ids)
        for start in range(len(ids) - m, -1, -1):
            if ids[start : start + m] == self.marker_ids:
                return start + m
        raise FactualityInputError(f"sample {i}: the response marker {self.marker!r} is not in the tokens; send "
                                   "prompt_lengths, or set response_marker to the text that starts the response")

    def decode(self, tokens: np.ndarray, lengths: np.ndarray, prompt_lengths: np.ndarray | None = None) -> list[DecodedSample]:
        if tokens.ndim != 2:
            raise FactualityInputError(f"'tokens' must be [B, S] int64, got shape {list(tokens.shape)}")
        lengths = np.asarray(lengths).reshape(-1)
        if lengths.shape[0] != tokens.shape[0]:
            raise FactualityInputError(f"'sequence_lengths' has {lengths.shape[0]} rows but 'tokens' has {tokens.shape[0]}")
        out = []
        for i in range(tokens.shape[0]):
            n = int(lengths[i])
            if not 0 < n <= tokens.shape[1]:
                raise FactualityInputError(f"sample {i}: sequence_lengths={n} outside [1, {tokens.shape[1]}] (the padded width)")
            ids = [int(t) for t in tokens[i, :n]]
            if prompt_lengths is not None:
                p = int(np.asarray(prompt_lengths).reshape(-1)[i])
                if not 0 <= p <= n:
                    raise FactualityInputError(f"sample {i}: prompt_lengths={p} outside [0, {n}]")
            else:
                p = self._find_prompt_len(ids, i)
            resp = ids[p:]
            out.append(DecodedSample(self.tokenizer.decode(ids[:p], skip_special_tokens=False),
                                     self.tokenizer.decode(resp, skip_special_tokens=True), p, n, tuple(resp)))
        return out


def decode_text(values: np.ndarray, name: str) -> list[str]:
    """``bytes`` input ``[B, 1]`` (or ``[B]``) → UTF-8 strings; invalid UTF-8 names the sample."""
    flat = np.asarray(values).reshape(values.shape[0], -1)
    out = []
    for i, row in enumerate(flat):
        raw = row[0]
        try:
            out.append(raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw))
        except UnicodeDecodeError as err:
            raise FactualityInputError(f"input {name!r}, sample {i}: invalid UTF-8 at byte {err.start}") from None
    return out


def pad_rows(rows: Sequence[np.ndarray], offsets: Sequence[int], width: int, dtype: Any) -> np.ndarray:
    """Place each row at its offset in a zero ``[B, width]`` array."""
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, (row, off) in enumerate(zip(rows, offsets)):
        n = min(len(row), max(width - off, 0))
        out[i, off : off + n] = row[:n]
    return out
