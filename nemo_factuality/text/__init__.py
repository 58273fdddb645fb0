"""Text utilities: sentence segmentation with exact spans, think/answer sections, token alignment."""

from nemo_factuality.text.alignment import TokenAlignment, align_tokens
from nemo_factuality.text.segment import RegexSegmenter, find_sections, split_sentences

__all__ = ["TokenAlignment", "align_tokens", "RegexSegmenter", "find_sections", "split_sentences"]
