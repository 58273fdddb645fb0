"""Degenerate, repetitive input (normal early in RL) costs time linear in its size at every stage.

Each input is sized so that the quadratic code this replaced took seconds to minutes (figures from
issue 17) while linear code takes milliseconds; the bounds are generous for a shared CI machine.
Speed itself is measured in ``benchmarks/robustness_bench.py``.
"""

from __future__ import annotations

from fuzz_support import budget, elapsed
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_factuality.evaluation.render import render_plot
from nemo_factuality.evaluation.report import EvalRecord
from nemo_factuality.judge import parsers
from nemo_factuality.text.alignment import align_tokens
from nemo_factuality.text.segment import RegexSegmenter

PARSERS = [parsers.parse_rlfh_verify, parsers.parse_rlfh_assess, parsers.parse_safe_rating, parsers.parse_safe_relevance,
           parsers.parse_true_false, parsers.parse_covered, parsers.parse_simpleqa_grade]
TOOLS = ["factscore", "safe_rating", "safe_relevance", "veriscore", "hallulens"]


def test_segmenting_repeated_initials_is_linear():
    text = "A. " * 66666  # ~3 min before (every period searched the whole prefix); under max_chars
    seconds = elapsed(RegexSegmenter().split, text)
    assert seconds < 10, f"RegexSegmenter().split('A. ' * 66666) took {seconds:.1f} s"
    assert [s.text for s in RegexSegmenter().split(text)] == [text.strip()]  # initials never end a sentence


def test_unclosed_brackets_parse_in_linear_time():
    text = "[" * 50000  # ~20 s before: the bracket regex retried from every "["
    for parse in (parsers.parse_safe_rating, parsers.parse_safe_relevance):
        seconds = elapsed(parse, text)
        assert seconds < 2, f"{parse.__name__}('[' * 50000) took {seconds:.1f} s"
        assert parse(text).error
    for tool in ("safe_rating", "safe_relevance"):
        assert elapsed(parsers.parse_verdict_compat, tool, text) < 2


def test_aligning_ids_that_differ_from_a_retokenisation_is_linear(tiny_tokenizer):
    text = "naïve café 🙂 東京 Paris. " * 600
    # One character at a time: ids the policy may well produce, unlike a re-tokenisation of the text.
    ids = [i for ch in text for i in tiny_tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert len(ids) > 12000  # ~30 s before (every prefix decoded: ~2 s for 3k ids)
    seconds = elapsed(align_tokens, tiny_tokenizer, text, ids)
    assert seconds < 5, f"align_tokens on {len(ids)} ids took {seconds:.1f} s"


def test_plot_with_long_group_names_is_fast(tmp_path):
    render_plot([EvalRecord("0", "p", "r", (("c", "supported"),), "warm-up")], tmp_path / "warm.png")  # imports
    names = ["x" * 200_000, "y" * 200_000] + [f"group {k}" for k in range(300)]
    records = [EvalRecord(str(i), "p", "r", (("c", "supported"), ("d", "not_supported")), name)
               for i, name in enumerate(names)]
    seconds = elapsed(render_plot, records, tmp_path / "p.png")  # 6-18 s before on one long name
    assert seconds < 5, f"render_plot took {seconds:.1f} s"


units = st.lists(st.sampled_from(["A", ".", " ", "[", "]", "\n", "。", '"', "<think>", "e.g", "hedged", "1", "{",
                                  "Supported", "#", "\u0301", "🙂", "true", "not", "x"]), min_size=1, max_size=4).map("".join)


@settings(max_examples=budget(25))
@given(units)
def test_any_repetition_is_cheap_at_every_text_stage(unit):
    text = unit * (60_000 // len(unit))
    seconds = elapsed(RegexSegmenter().split, text)
    for parse in PARSERS:
        seconds += elapsed(parse, text)
    for tool in TOOLS:
        seconds += elapsed(parsers.parse_verdict_compat, tool, text)
    assert seconds < 10, f"{unit!r} * {60_000 // len(unit)}: {seconds:.1f} s"
