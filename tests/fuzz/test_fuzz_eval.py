"""Evaluation input on generated records and lines: a report or one ``FactualityInputError`` naming the line, nothing else."""

from __future__ import annotations

import json
import math

import pytest
from fuzz_support import budget, json_values, texts
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_factuality.evaluation.report import (
    EvalOptions,
    build_report,
    check_core_fields,
    check_unique_ids,
    parse_record,
    to_json_safe,
)
from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.types import FactualityInputError

labels = st.sampled_from(["supported", "not_supported", "irrelevant", " Supported ", "maybe"]) | json_values
claims = st.lists(st.fixed_dictionaries({"text": texts | json_values, "label": labels}) | json_values, max_size=5)
records = st.fixed_dictionaries(
    {"id": st.integers(0, 5) | st.sampled_from(["0", "1", "a"]) | json_values},
    optional={"prompt": texts | json_values, "response": texts | json_values, "claims": st.none() | claims | json_values,
              "unparseable": st.integers(-2, 3) | json_values, "g": json_values},
)


@settings(max_examples=budget(300))
@given(st.lists(records, min_size=1, max_size=6), st.sampled_from([None, "g"]))
def test_records_give_a_report_or_a_named_error(raws, group_by):
    rows = [(f"in.jsonl:{i + 1}", raw) for i, raw in enumerate(raws)]
    try:
        for where, raw in rows:
            check_core_fields(raw, where=where)
        check_unique_ids(rows)
        recs = [parse_record(raw, where=where, group_by=group_by) for where, raw in rows]
    except FactualityInputError as err:
        assert str(err).startswith("in.jsonl:") and "\n" not in str(err)
        return
    assert len({r.id for r in recs}) == len(recs)  # duplicates never reach the metrics
    report = to_json_safe(build_report(recs, EvalOptions()))
    json.dumps(report, allow_nan=False)  # strict JSON
    assert report["groups"]["all"]["n_records"] == len(recs)


lines = st.one_of(
    json_values.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(alphabet=st.sampled_from('[]{}":,0123456789-eE.NIa '), max_size=40),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(4000, 6000).map(lambda n: '{"id": ' + "7" * n + "}"),
)


@settings(max_examples=budget(200))
@given(st.lists(lines, min_size=1, max_size=4), st.binary(max_size=8))
def test_jsonl_lines_give_objects_or_a_named_error(tmp_path_factory, text_lines, noise):
    path = tmp_path_factory.mktemp("jsonl") / "in.jsonl"
    path.write_bytes("\n".join(text_lines).encode("utf-8") + b"\n" + noise)
    try:
        for where, obj in iter_jsonl(path):
            assert isinstance(obj, dict) and where.startswith(f"{path}:")
    except FactualityInputError as err:
        assert str(err).startswith(f"{path}:") and "\n" not in str(err)


@pytest.mark.parametrize("value", [None, "three", -math.inf, math.nan, 1.5, -1, True, [1]])
def test_unparseable_must_be_a_count(value):
    raw = {"id": 1, "prompt": "p", "response": "r", "claims": [], "unparseable": value}
    with pytest.raises(FactualityInputError, match=r"x.jsonl:3: field 'unparseable' must be a non-negative integer"):
        parse_record(raw, where="x.jsonl:3")
