"""Character span → token index alignment on the exact response string.

Rewards are decided on text (sentences, claims) but consumed per token. We map with the
tokenizer's offset mapping over the *exact* response string, never by re-tokenising sentences
(FSPO's drift) or by ``len(decode(ids[:i+1]))`` alone (RLFH's drift on multi-byte characters).

When the policy's own token ids are given (what a trainer or NeMo-Aligner sends), those ids are
the ground truth: if re-tokenising the text reproduces them we use the fast offsets mapping;
otherwise each token's character range is recovered by incremental decoding over a small window
(linear in the number of ids).

A token's range is every character it holds at least one byte of. With byte-level BPE a token
may end inside a multi-byte character ("a" + the first byte of "Æ"): that character then lies in
both tokens, so neighbouring ranges can share one character. This is what keeps the invariant
the rewards rely on: every character lies in at least one token, and ``token_range(span)`` covers
every character of the span.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_factuality.types import FactualityInputError, Span

_REPLACEMENT = "\ufffd"
_MAX_TOKEN_ID = 2**32  # tokenizers store ids as u32
# A UTF-8 character has at most 4 bytes, so at most 4 byte-holding tokens can leave it unfinished;
# the margin admits tokens that hold no bytes. More than this is not a character being completed.
_MAX_PENDING_TOKENS = 16


@dataclass(frozen=True)
class TokenAlignment:
    """Token ids of a response and the half-open character range each token covers in ``text``.

    ``offsets[i] == (start, end)``: the characters token ``i`` holds at least one byte of. Tokens
    holding no bytes (EOS, padding) get an empty range at their position. Checked on construction:
    starts and ends never decrease, and every character of ``text`` lies in at least one range.
    """

    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    _starts: list[int] = field(init=False, repr=False, compare=False)
    _ends: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.offsets):
            raise FactualityInputError(f"{len(self.token_ids)} token ids but {len(self.offsets)} offsets")
        _check_offsets(self.offsets, len(self.text))
        object.__setattr__(self, "_starts", [s for s, _ in self.offsets])
        object.__setattr__(self, "_ends", [e for _, e in self.offsets])

    def __len__(self) -> int:
        return len(self.token_ids)

    def _check_char(self, char_index: int) -> None:
        if not self.offsets:
            raise FactualityInputError("cannot align a character in a response with no tokens")
        if not (0 <= char_index < len(self.text)):
            raise FactualityInputError(f"character index {char_index} outside response of length {len(self.text)}")

    def token_of_char(self, char_index: int) -> int:
        """Index of the token that completes character ``char_index`` (the last token holding a byte of it)."""
        self._check_char(char_index)
        # Starts never decrease and some token holds the character, so the last token starting at
        # or before it holds it too.
        return bisect.bisect_right(self._starts, char_index) - 1

    def first_token_of_char(self, char_index: int) -> int:
        """Index of the first token holding a byte of character ``char_index``."""
        self._check_char(char_index)
        return bisect.bisect_right(self._ends, char_index)

    def last_token(self, span: Span) -> int:
        """The token that completes the span's last character (RLFH: where a claim's reward is placed)."""
        if len(span) == 0:
            raise FactualityInputError(f"empty span [{span.start}, {span.end}) has no last token")
        return self.token_of_char(span.end - 1)

    def token_range(self, span: Span) -> tuple[int, int]:
        """Half-open token range ``[first, last + 1)``: every token holding a byte of the span."""
        if len(span) == 0:
            raise FactualityInputError(f"empty span [{span.start}, {span.end}) has no tokens")
        return self.first_token_of_char(span.start), self.last_token(span) + 1


def _check_offsets(offsets: Sequence[tuple[int, int]], n_chars: int) -> None:
    """Raise unless ranges lie in ``[0, n_chars]``, never go backwards and cover every character."""
    reach, prev = 0, (0, 0)
    for i, (start, end) in enumerate(offsets):
        if not (0 <= start <= end <= n_chars) or start < prev[0] or end < prev[1]:
            raise FactualityInputError(f"token {i}: character range {(start, end)} after {prev} is out of order "
                                       f"or outside a response of {n_chars} characters")
        if end > start and start > reach:
            raise FactualityInputError(f"characters [{reach}, {start}) lie in no token")
        reach, prev = max(reach, end), (start, end)
    if reach != n_chars:
        raise FactualityInputError(f"characters [{reach}, {n_chars}) lie in no token")


def align_tokens(tokenizer: Any, text: str, token_ids: Sequence[int] | None = None) -> TokenAlignment:
    """Align ``text`` to tokens of ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer (fast tokenizers give offsets directly).
        text: the exact response string the spans refer to (valid Unicode: no lone surrogates).
        token_ids: the policy's response token ids, if known: integers in ``[0, 2**32)`` whose
            decoding equals ``text`` (special tokens such as EOS may appear and get empty ranges).

    Returns:
        ``TokenAlignment`` with one character range per token.

    Raises:
        FactualityInputError: text that is not valid Unicode, ids that are not token ids, ids that
            decode to other text, or ids that end inside a character.
    """
    _check_text(text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    own_ids = [int(t) for t in enc["input_ids"]]
    if token_ids is None:
        offsets = _offsets_from_mapping(enc["offset_mapping"], len(text))
        if offsets is None:
            offsets = _offsets_by_incremental_decode(tokenizer, own_ids, text)
        return TokenAlignment(text, tuple(own_ids), tuple(offsets))
    ids = _check_ids(token_ids)
    # Trailing special tokens (EOS, padding) cover no characters; strip them so the common case —
    # the policy's ids are the tokenizer's own ids plus EOS — takes the fast offsets path.
    specials = _special_ids(tokenizer)
    body = len(ids)
    while body and ids[body - 1] in specials:
        body -= 1
    if own_ids == ids[:body]:
        offsets = _offsets_from_mapping(enc["offset_mapping"], len(text))
        if offsets is not None:
            offsets += [(len(text), len(text))] * (len(ids) - body)
            return TokenAlignment(text, tuple(ids), tuple(offsets))
    return TokenAlignment(text, tuple(ids), tuple(_offsets_by_incremental_decode(tokenizer, ids, text)))


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise FactualityInputError(f"response text must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise FactualityInputError(
            f"response text has a lone surrogate {text[err.start]!r} at character {err.start}, which no tokenizer "
            "can encode; decode the response with errors='replace' (or fix its source)"
        ) from None


def _check_ids(token_ids: Any) -> list[int]:
    """The ids as Python ints, each an integer in ``[0, 2**32)`` (numpy/torch integers accepted)."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise FactualityInputError(f"token_ids must be a sequence of integers, got {type(token_ids).__name__}")
    ids = []
    for i, t in enumerate(token_ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            value = operator.index(t)
        except TypeError:
            raise FactualityInputError(f"token_ids[{i}] is a {type(t).__name__}; token ids must be integers") from None
        if not 0 <= value < _MAX_TOKEN_ID:
            shown = value if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
            raise FactualityInputError(f"token_ids[{i}] is {shown}; token ids lie in [0, 2**32)")
        ids.append(value)
    return ids


def _special_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(getattr(tokenizer, "all_special_ids", []) or [])


def _offsets_from_mapping(mapping: Sequence[Sequence[int]], n_chars: int) -> list[tuple[int, int]] | None:
    """Character ranges from a fast tokenizer's offset mapping, or None where it cannot be trusted.

    Byte-level BPE already reports, for each token, the characters it holds a byte of (three
    tokens of one emoji each say ``(6, 7)``; "a" + the first byte of "Æ" says ``(0, 2)``). A gap
    between tokens can only be whitespace the tokenizer trimmed from the next token's range
    (``trim_offsets``); that token holds it, so its start is moved back. Anything else that breaks
    the invariants (a trimmed tail, ranges going backwards) returns None: decode instead.
    """
    fixed: list[tuple[int, int]] = []
    reach = 0
    for a, b in mapping:
        start, end = min(max(int(a), 0), n_chars), min(max(int(b), 0), n_chars)
        if end > start and start > reach:
            start = reach
        fixed.append((start, end))
        reach = max(reach, end)
    try:
        _check_offsets(fixed, n_chars)
    except FactualityInputError:
        return None
    return fixed


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Decode ids to text without special tokens or clean-up (the backend directly when there is one: faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _offsets_by_incremental_decode(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Character ranges by incremental decoding, in time linear in ``len(ids)`` (see ``_IncrementalAligner``).

    Raises:
        FactualityInputError: the ids decode to other text, or end inside a character.
    """
    aligner = _IncrementalAligner(_decoder(tokenizer), _special_ids(tokenizer), text)
    offsets = [aligner.step(tid) for tid in ids]
    if aligner.partial:
        raise FactualityInputError(
            f"token ids end inside a character (the last {len(aligner.pending)} ids hold part of a multi-byte "
            f"character after character {aligner.done}); pass ids that decode to whole characters")
    if aligner.done != len(text):
        raise FactualityInputError(
            f"token ids decode to {aligner.done} characters but the response has {len(text)}; "
            "pass the response's own token ids and the policy's tokenizer"
        )
    return offsets


class _IncrementalAligner:
    """Walks the ids once; each step decodes a window of at most a few dozen ids.

    The window is the context (ids after a character boundary that produced the latest text, so
    decoders that strip a leading space or join byte-fallback runs see the same neighbours) plus
    the pending ids of a character not yet complete. A window ending inside a character decodes to
    trailing U+FFFD (byte-fallback decoders may garble the whole run): held back until an id
    completes it. Special ids hold no bytes and never enter a window.

    Text that itself holds U+FFFD is ambiguous (an unfinished character decodes to U+FFFD too): a
    U+FFFD counts as soon as the text has it, and a later id whose bytes turn out to belong to it is
    given it too (``_continues_replacement``). Where a byte-fallback decoder regroups such a run so
    that no consistent ranges exist, the result is a ``FactualityInputError``, never wrong ranges:
    ``TokenAlignment`` checks its invariants.
    """

    def __init__(self, decode: Callable[[list[int]], str], specials: frozenset[int], text: str) -> None:
        self.decode, self.specials, self.text = decode, specials, text
        self.done = 0  # characters of ``text`` completed so far
        self.context: list[int] = []
        self.context_text = ""
        self.pending: list[int] = []  # ids since the context, holding an unfinished character
        self.counted = 0  # characters of the pending window's text already counted in ``done``
        self.partial = False  # the ids so far end inside a character
        self.ends_in_replacement = False  # the last completed character is a U+FFFD the text has there

    def step(self, tid: int) -> tuple[int, int]:
        """The character range of the next id."""
        if tid in self.specials:
            return self.done, self.done + self.partial
        window_text = self.decode(self.context + self.pending + [tid])
        if not window_text.startswith(self.context_text):
            if not window_text.endswith(_REPLACEMENT):
                raise _mismatch(self.text, self.done, window_text[len(self.context_text):])
            return self._hold(tid, "")  # a byte-fallback run garbled until its character completes
        new = window_text[len(self.context_text) + self.counted:]
        complete = new if self.text.startswith(new, self.done) else new.rstrip(_REPLACEMENT)
        if not self.text.startswith(complete, self.done):
            raise _mismatch(self.text, self.done, complete)
        start = self.done
        if self.ends_in_replacement and not self.partial and _continues_replacement(self.decode([tid]), new):
            start -= 1
        if len(complete) < len(new):
            return self._hold(tid, complete, start)
        self.done += len(complete)
        self.partial = False
        if new:  # a complete character: these ids become the context of the next
            self.context = self.pending + [tid]
            self.ends_in_replacement = complete.endswith(_REPLACEMENT)
        else:  # no text of its own (or absorbed by the decoder): a boundary all the same
            grown = self.context + self.pending + [tid]
            self.context = grown if len(grown) <= 2 * _MAX_PENDING_TOKENS else self.pending + [tid]
        self.pending, self.counted = [], 0
        self.context_text = self.decode(self.context)
        return start, self.done

    def _hold(self, tid: int, complete: str, start: int | None = None) -> tuple[int, int]:
        """Count ``complete`` and keep ``tid`` pending: it ends inside a character."""
        start = self.done if start is None else start
        self.done += len(complete)
        self.counted += len(complete)
        self.partial = True
        self.pending.append(tid)
        if len(self.pending) > _MAX_PENDING_TOKENS:
            raise FactualityInputError(
                f"token ids {self.pending[:8]}... do not decode to whole characters near character {self.done}; "
                "pass the same tokenizer the policy used")
        return start, self.done + 1


def _continues_replacement(alone: str, new: str) -> bool:
    """Whether a token holds bytes of the U+FFFD before it: text that has U+FFFD is ambiguous, as an
    unfinished character decodes to U+FFFD too. Decoded alone, a token opening with continuation
    bytes shows more leading U+FFFD than it adds to the text (or adds nothing at all)."""
    return not new or _leading_replacements(alone) > _leading_replacements(new)


def _leading_replacements(s: str) -> int:
    return len(s) - len(s.lstrip(_REPLACEMENT))


def _mismatch(text: str, at: int, decoded: str) -> FactualityInputError:
    return FactualityInputError(
        f"token ids do not decode to the response text (diverges near character {at}: "
        f"decoded {decoded[:20]!r}, response {text[at:at + 20]!r}); pass the same tokenizer the policy used"
    )
