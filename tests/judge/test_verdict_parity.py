"""Every record of verdict_parsing.json: our per-tool compatibility modes reproduce the public tools."""

import pytest

from nemo_factuality.judge.parsers import (
    compat_label,
    parse_covered,
    parse_rlfh_assess,
    parse_rlfh_verify,
    parse_safe_rating,
    parse_simpleqa_grade,
    parse_true_false,
    parse_verdict_compat,
)
from nemo_factuality.testing.paths import load_parity
from nemo_factuality.types import Label


def test_every_golden_record():
    golden = load_parity("verdict_parsing.json")
    assert len(golden["records"]) == 139
    for rec in golden["records"]:
        tool, text, exp = rec["input"]["tool"], rec["input"]["text"], rec["expected"]
        got = parse_verdict_compat(tool, text)
        if tool == "hallulens" and exp.get("raises"):
            assert got["raises"] == exp["raises"], rec
            continue
        for key, value in exp.items():
            if key in ("message", "meaning"):
                continue
            assert got[key] == value, (tool, text, key)


def test_compat_labels_keep_tool_quirks():
    assert compat_label("factscore", "Unsupported") is Label.SUPPORTED  # FActScore's quirk, on purpose
    assert compat_label("safe_rating", "[supported]") is Label.UNPARSEABLE  # SAFE drops it
    assert compat_label("veriscore", "Supported but only partially.") is Label.NOT_SUPPORTED
    assert compat_label("hallulens", "The claim is supported.") is Label.UNPARSEABLE
    with pytest.raises(ValueError, match="unknown tool"):
        parse_verdict_compat("fever", "x")


@pytest.mark.parametrize("text,label,hedged", [
    ("Correct", Label.SUPPORTED, False), ("The statement is wrong.", Label.NOT_SUPPORTED, False),
    ("Vague.", Label.NOT_ENOUGH_INFO, False), ("Incorrect", Label.NOT_SUPPORTED, False),
    ("Hedged correct", Label.SUPPORTED, True), ("hedged  wrong", Label.NOT_SUPPORTED, True),
])
def test_rlfh_verify(text, label, hedged):
    parsed = parse_rlfh_verify(text)
    assert parsed.value is label and parsed.hedged is hedged


@pytest.mark.parametrize("fn,text", [
    (parse_rlfh_verify, "I think maybe"), (parse_rlfh_assess, "very helpful"), (parse_safe_rating, "Supported"),
    (parse_true_false, "perhaps"), (parse_covered, "hmm"), (parse_simpleqa_grade, "D) something"),
    (parse_rlfh_verify, None), (parse_rlfh_assess, "10"),
])
def test_garbage_is_explicitly_unparseable(fn, text):
    parsed = fn(text)
    assert parsed.value is None and parsed.error and "unparseable" in parsed.error


def test_strict_parsers_read_common_shapes():
    assert parse_rlfh_assess("Score: 4 (crucial)").value == 4
    assert parse_safe_rating("so [**Not Supported**].").value is Label.NOT_SUPPORTED
    assert parse_safe_rating("[STATEMENT] ... final: [Supported]").value is Label.SUPPORTED
    assert parse_true_false("Answer: False.").value is False
    assert parse_covered("Not covered").value is False and parse_covered("COVERED").value is True
    assert parse_simpleqa_grade("B").value == "INCORRECT" and parse_simpleqa_grade("NOT_ATTEMPTED").value == "NOT_ATTEMPTED"
