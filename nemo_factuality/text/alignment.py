"""Character span → token index alignment on the exact response string.

Rewards are decided on text (sentences, claims) but consumed per token. We map with the
tokenizer's offset mapping over the *exact* response string, never by re-tokenising sentences
(FSPO's drift) or by ``len(decode(ids[:i+1]))`` alone (RLFH's drift on multi-byte characters).

When the policy's own token ids are given (what a trainer or NeMo-Aligner sends), those ids are
the ground truth: if re-tokenising the decoded text reproduces them we use the fast offsets
mapping; otherwise each token's character range is recovered by incremental decoding.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

from nemo_factuality.types import FactualityInputError, Span

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenAlignment:
    """Token ids of a response and the half-open character range each token covers in ``text``.

    ``offsets[i] == (start, end)``; a token that covers only part of a multi-byte character (byte
    BPE) gets an empty range at the character's position, and the token that completes the
    character covers it.
    """

    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.offsets):
            raise FactualityInputError(f"{len(self.token_ids)} token ids but {len(self.offsets)} offsets")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def _ends(self) -> list[int]:
        return [end for _, end in self.offsets]

    def token_of_char(self, char_index: int) -> int:
        """Index of the token that completes character ``char_index`` (the first token whose end > index)."""
        if not self.offsets:
            raise FactualityInputError("cannot align a character in a response with no tokens")
        if not (0 <= char_index < len(self.text)):
            raise FactualityInputError(f"character index {char_index} outside response of length {len(self.text)}")
        idx = bisect.bisect_right(self._ends, char_index)
        return min(idx, len(self.offsets) - 1)

    def last_token(self, span: Span) -> int:
        """The token holding the span's last character (RLFH: where a claim's reward is placed)."""
        if len(span) == 0:
            raise FactualityInputError(f"empty span [{span.start}, {span.end}) has no last token")
        return self.token_of_char(span.end - 1)

    def token_range(self, span: Span) -> tuple[int, int]:
        """Half-open token range ``[first, last + 1)`` covering every character of ``span``."""
        if len(span) == 0:
            raise FactualityInputError(f"empty span [{span.start}, {span.end}) has no tokens")
        return self.token_of_char(span.start), self.last_token(span) + 1


def align_tokens(tokenizer: Any, text: str, token_ids: Sequence[int] | None = None) -> TokenAlignment:
    """Align ``text`` to tokens of ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer (fast tokenizers give offsets directly).
        text: the exact response string the spans refer to.
        token_ids: the policy's response token ids, if known. Their decoding must equal ``text``
            (special tokens such as EOS may trail and are given empty ranges at the end).

    Returns:
        ``TokenAlignment`` with one character range per token.
    """
    if token_ids is None:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return TokenAlignment(text, tuple(enc["input_ids"]), tuple(_fix_offsets(enc["offset_mapping"], len(text))))
    ids = [int(t) for t in token_ids]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    # Trailing special tokens (EOS, padding) cover no characters; strip them so the common case —
    # the policy's ids are the tokenizer's own ids plus EOS — takes the fast offsets path.
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    body = len(ids)
    while body and ids[body - 1] in specials:
        body -= 1
    if list(enc["input_ids"]) == ids[:body]:
        offsets = _fix_offsets(enc["offset_mapping"], len(text)) + [(len(text), len(text))] * (len(ids) - body)
        return TokenAlignment(text, tuple(ids), tuple(offsets))
    return TokenAlignment(text, tuple(ids), tuple(_offsets_by_incremental_decode(tokenizer, ids, text)))


def _fix_offsets(offsets: Sequence[Sequence[int]], n_chars: int) -> list[tuple[int, int]]:
    """Make offsets non-overlapping and monotone.

    Byte-level BPE reports the full character range for every token that shares a multi-byte
    character (e.g. three tokens of an emoji each say (6, 7)); only the last of them completes it.
    """
    fixed: list[tuple[int, int]] = []
    prev_end = 0
    raw = [(int(a), int(b)) for a, b in offsets]
    for i, (start, end) in enumerate(raw):
        start, end = max(start, prev_end), min(end, n_chars)
        shares_next = i + 1 < len(raw) and raw[i + 1][0] < end
        if shares_next or end < start:
            fixed.append((start, start))
            continue
        fixed.append((start, end))
        prev_end = end
    return fixed


def _offsets_by_incremental_decode(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Character ranges from decoding growing prefixes; prefixes ending inside a character are held back."""
    offsets: list[tuple[int, int]] = []
    prev_end = 0
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # A prefix that stops inside a multi-byte character decodes to U+FFFD; hold it back.
        complete = prefix if text.startswith(prefix) else prefix.rstrip(_REPLACEMENT)
        end = len(complete)
        if not text.startswith(complete):
            raise FactualityInputError(
                f"token ids do not decode to the response text (diverges near character {prev_end}: "
                f"decoded {complete[prev_end:prev_end + 20]!r}, response {text[prev_end:prev_end + 20]!r}); "
                "pass the same tokenizer the policy used"
            )
        end = max(end, prev_end)
        offsets.append((prev_end, end))
        prev_end = end
    if prev_end != len(text):
        raise FactualityInputError(
            f"token ids decode to {prev_end} characters but the response has {len(text)}; "
            "pass the response's own token ids and the policy's tokenizer"
        )
    return offsets
