"""Every record of verdict_parsing.json: our per-tool compatibility modes reproduce the public tools."""

import math

import pytest

from nemo_factuality.judge.parsers import (
    compat_label,
    p_true_from_logprobs,
    parse_covered,
    parse_p_true,
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


@pytest.mark.parametrize("text,raises", [("[" * 1000, "RecursionError"), ("1" * 4301, "ValueError"),
                                         ('{"is_supported": ' + "9" * 5000 + "}", "ValueError")])
def test_hallulens_replies_json_cannot_read_are_unparseable(text, raises):
    assert parse_verdict_compat("hallulens", text)["raises"] == raises
    assert compat_label("hallulens", text) is Label.UNPARSEABLE


def test_p_true_reads_top_logprobs():
    lp = [{"token": "True", "logprob": -0.1, "top_logprobs": [{"token": "True", "logprob": math.log(0.6)},
                                                              {"token": " no", "logprob": math.log(0.2)},
                                                              {"token": "Maybe", "logprob": math.log(0.2)}]}]
    assert parse_p_true(lp).value == pytest.approx(0.75) and p_true_from_logprobs(lp) == pytest.approx(0.75)
    assert parse_p_true(None) == parse_p_true([]) == parse_p_true([{"token": "Maybe", "logprob": -0.1}])  # nothing to read
    assert parse_p_true(None).ok and parse_p_true(None).value is None


@pytest.mark.parametrize("logprobs", [
    [{}], [{"token": "True"}], [{"token": "True", "logprob": None}], [{"token": None, "logprob": -1.0}],
    [{"token": "True", "logprob": "x"}], [{"token": "True", "logprob": 1e308}], [{"token": "True", "logprob": float("nan")}],
    [{"token": "True", "logprob": 10**5000}], [{"top_logprobs": 5}], [{"top_logprobs": [None]}], [None], "True", 7, {"a": 1},
])
def test_malformed_logprobs_are_an_explicit_error_not_an_exception(logprobs):
    parsed = parse_p_true(logprobs)
    assert parsed.value is None and parsed.error.startswith("unparseable logprobs")
    assert p_true_from_logprobs(logprobs) is None
