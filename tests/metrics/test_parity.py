"""Every record of the public-implementation goldens in tests/data/parity, compared at abs_tol 1e-12."""

from __future__ import annotations

import math

import pytest

from nemo_factuality.metrics import f1_at_k, factscore, is_response_abstained, longwiki_scores, veriscore_stats
from nemo_factuality.testing.paths import load_parity

TOL = 1e-12


def _close(ours, expected) -> bool:
    if expected is None:
        return ours is None or (isinstance(ours, float) and math.isnan(ours))
    if isinstance(expected, list):
        return len(ours) == len(expected) and all(_close(o, e) for o, e in zip(ours, expected))
    return math.isclose(float(ours), float(expected), rel_tol=0, abs_tol=TOL)


def test_safe_f1_at_k_every_record():
    golden = load_parity("safe_f1_at_k.json")
    assert len(golden["records"]) >= 1166
    for rec in golden["records"]:
        inp, exp = rec["input"], rec["expected"]
        k = 100 if inp["max_claims"] is None else inp["max_claims"]
        got = f1_at_k(inp["supported"], inp["not_supported"], k)
        assert _close(got.f1, exp["f1"]), rec
        assert isinstance(got.f1, int) == exp["f1_is_int"], rec
        assert _close(got.precision, exp["precision"]) and _close(got.recall, exp["recall"]), rec
        if got.precision is not None:  # the reported P and R reproduce the public F1
            assert _close(2 * got.precision * got.recall / (got.precision + got.recall), exp["f1"])


def test_safe_error_records():
    for rec in load_parity("safe_f1_at_k.json")["error_records"]:
        inp, exp = rec["input"], rec["expected"]
        with pytest.raises(ValueError, match=exp["message"].rstrip(".")):
            f1_at_k(inp["supported"], inp["not_supported"], inp["max_claims"])


def test_factscore_every_record():
    golden = load_parity("factscore_aggregate.json")
    for rec in golden["records"]:
        inp, exp = rec["input"], rec["expected"]
        decisions = [None if r["facts"] is None else [f["supported"] for f in r["facts"]] for r in inp["responses"]]
        got = factscore(decisions, gamma=inp["gamma"])
        assert _close(got.score, exp["score"]), inp["case"]
        assert (got.init_score is not None) == exp["has_init_score"], inp["case"]
        assert _close(got.init_score, exp["init_score"]), inp["case"]
        assert _close(got.respond_ratio, exp["respond_ratio"]), inp["case"]
        assert _close(got.num_facts_per_response, exp["num_facts_per_response"]), inp["case"]
        assert got.decisions == exp["decisions"], inp["case"]


def test_factscore_empty_fact_list_is_abstention_on_purpose():
    # The public aggregate gives NaN (gamma=0) or ZeroDivisionError (gamma>0) for facts == [];
    # we follow FActScore's own pipeline and treat zero extracted facts as an abstention.
    for rec in load_parity("factscore_aggregate.json")["edge_records"]:
        got = factscore([[]], gamma=rec["input"]["gamma"])
        assert math.isnan(got.score) and got.respond_ratio == 0.0
        if rec["expected"]["raises"] is None:
            assert rec["expected"]["score"] is None  # NaN in the public code, too


def test_abstain_detection_every_record():
    golden = load_parity("abstain_detection.json")
    for rec in golden["records"]:
        inp = rec["input"]
        assert is_response_abstained(inp["generation"], inp["fn_type"]) is rec["expected"]["abstained"], inp


def test_veriscore_every_record():
    golden = load_parity("veriscore_stats.json")
    fields = ["ave_sent", "S", "U", "P", "Rec_med", "Rec_max", "F1_med", "F1_max",
              "prec_lst", "rec_med_lst", "rec_max_lst", "f1_med_lst", "f1_max_lst"]
    for rec in golden["records"]:
        ks, stats = veriscore_stats(rec["input"]["domain_model_triplets"])
        assert ks == rec["expected"]["K"], rec["input"]["case"]
        assert len(stats) == len(rec["expected"]["per_model"])
        for ours, exp in zip(stats, rec["expected"]["per_model"]):
            assert (ours.domain, ours.model) == (exp["domain"], exp["model"])
            for name in fields:
                assert _close(getattr(ours, name), exp[name]), (rec["input"]["case"], name)
            # the public table row is the same numbers rounded to 3 decimals
            assert [round(x, 3) for x in (ours.ave_sent, ours.S, ours.U, ours.P, ours.Rec_med)] == exp["table_row"][2:7]


def test_veriscore_zero_total_raises_like_public():
    for rec in load_parity("veriscore_stats.json")["error_records"]:
        with pytest.raises(ZeroDivisionError):
            veriscore_stats(rec["input"]["domain_model_triplets"])


def test_hallulens_every_record():
    golden = load_parity("hallulens_longwiki.json")
    for rec in golden["records"]:
        inp, exp = rec["input"], rec["expected"]
        got = longwiki_scores([(r["prompt"], r["is_supported"]) for r in inp["rows"]], k=inp["k"])
        for name in ("overall_precision", "overall_recall", "overall_f1", "med_n_claims"):
            assert _close(getattr(got, name), exp[name]), (inp["case"], name)
        assert [p.prompt for p in got.per_prompt] == [p["prompt"] for p in exp["per_prompt"]]
        for ours, theirs in zip(got.per_prompt, exp["per_prompt"]):
            for name in ("precision", "recall", "f1", "n_claims"):
                assert _close(getattr(ours, name), theirs[name]), (inp["case"], ours.prompt, name)
