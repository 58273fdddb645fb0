"""Judge-reply parsers on any text and any logprobs: a value or an explicit unparseable result, never an exception."""

from __future__ import annotations

import math

from fuzz_support import budget, json_values, texts
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_factuality.judge import parsers
from nemo_factuality.types import Label

STRICT = [parsers.parse_rlfh_verify, parsers.parse_rlfh_assess, parsers.parse_safe_rating, parsers.parse_safe_relevance,
          parsers.parse_true_false, parsers.parse_covered, parsers.parse_simpleqa_grade]
TOOLS = ["factscore", "safe_rating", "safe_relevance", "veriscore", "hallulens"]
# Replies shaped like what judges send, brackets and JSON included, plus any text.
replies = st.one_of(
    texts,
    st.lists(st.sampled_from(list('[]{}":,.#\n ') + ["Supported", "Not Supported", "Foo", "true", "false",
                                                     '"is_supported"', "1" * 5000, "Correct", "[" * 2000])).map("".join),
    json_values.map(lambda v: _json_text(v)),
)


def _json_text(value) -> str:
    import json

    return json.dumps(value, allow_nan=True)


@settings(max_examples=budget(500))
@given(replies)
def test_strict_parsers_give_a_value_or_an_error(text):
    for parse in STRICT:
        out = parse(text)
        assert (out.value is None) == (out.error is not None), (parse.__name__, out)


@settings(max_examples=budget(500))
@given(replies)
def test_compat_modes_never_raise(text):
    for tool in TOOLS:
        assert isinstance(parsers.parse_verdict_compat(tool, text), dict)
        assert isinstance(parsers.compat_label(tool, text), Label)


# Logprobs as a judge might send them: right shape with odd values, or anything at all.
candidates = st.fixed_dictionaries({}, optional={"token": json_values | st.sampled_from(["True", " false", "Yes", "no"]),
                                                 "logprob": json_values | st.floats(max_value=0.0)})
logprob_lists = st.lists(st.fixed_dictionaries({}, optional={
    "token": st.sampled_from(["True", "False", "yes"]) | json_values,
    "logprob": st.floats() | json_values,
    "top_logprobs": st.lists(candidates, max_size=5) | json_values,
}), max_size=3)


@settings(max_examples=budget(800))
@given(logprob_lists | json_values)
def test_p_true_is_a_probability_none_or_an_error(logprobs):
    parsed = parsers.parse_p_true(logprobs)
    assert parsed.error is None or parsed.value is None
    if parsed.value is not None:
        assert 0.0 <= parsed.value <= 1.0 and not math.isnan(parsed.value)
    assert parsers.p_true_from_logprobs(logprobs) == parsed.value
