"""Lab evaluation: the decode-time threshold, abstentions taken out of claims, the eval command's report, and the
per-person FActScore terms the report's paired bootstrap resamples."""

from __future__ import annotations

import json

import pytest

from nemo_factuality.lab import world as W
from nemo_factuality.lab.evaluate import apply_threshold, run_eval, score_rows
from nemo_factuality.lab.policy import Sample


def test_threshold_turns_low_confidence_values_into_abstentions():
    s = Sample("p", "Ab Cd was born in 1931. Ab Cd grew up in Dresk. Ab Cd spoke Rul.", [0.9, 0.2, 0.6])
    assert apply_threshold(s, 0.5) == "Ab Cd was born in 1931. Ab Cd grew up in unknown. Ab Cd spoke Rul."
    assert apply_threshold(s, 0.1) == s.response
    # A sentence without a recorded probability (truncated response) is left as it is.
    short = Sample("p", "Ab Cd was born in 1931. Ab Cd grew", [0.1])
    assert apply_threshold(short, 0.5) == "Ab Cd was born in unknown. Ab Cd grew"


def test_run_eval_scores_with_the_eval_command(tmp_path, capsys):
    cfg = W.WorldConfig(n_people=(2, 2, 2), bios_per_person=(1, 1, 1), seed=1)
    people = W.make_people(cfg)
    paths = W.write_world(tmp_path / "world", people, W.make_bios(people, cfg), W.split_people(people, (0, 0, 0), (1, 1, 1), 1))
    kb = W.build_world_kb(paths, tmp_path / "kb.sqlite")
    p, r = people[0], people[4]
    wrong = next(v for v in ("Zzz", "Qqq") if v != r.facts["hometown"])
    rows = [
        # popular: 2 supported claims + 1 abstention -> precision 1
        {"id": "a", "prompt": "x", "topic": p.name, "tier": "popular", "response": " ".join(
            [W.sentence(p.name, "born_year", p.facts["born_year"]), W.sentence(p.name, "hometown", p.facts["hometown"]),
             W.sentence(p.name, "language", W.ABSTAIN_VALUE)])},
        # rare: 1 supported + 1 wrong -> precision 0.5
        {"id": "b", "prompt": "x", "topic": r.name, "tier": "rare", "response": " ".join(
            [W.sentence(r.name, "born_year", r.facts["born_year"]), W.sentence(r.name, "hometown", wrong)])},
        # rare: abstains on every slot it writes -> an abstained response
        {"id": "c", "prompt": "x", "topic": r.name, "tier": "rare", "response": W.sentence(r.name, "occupation", W.ABSTAIN_VALUE)},
    ]
    out = run_eval(rows, kb, tmp_path / "eval")
    assert out["factscore"] == pytest.approx((1.0 + 0.5) / 2)
    assert out["respond_ratio"] == pytest.approx(2 / 3)
    assert out["claims_per_response"] == pytest.approx(2.0)  # over responding records, FActScore's convention
    assert out["abstain_rate"] == pytest.approx(2 / 6)
    assert out["precision"] == pytest.approx(3 / 4)
    # one wrong claim over the two responding responses; the rare tier's one over its one responding response
    assert out["hallucinated_per_response"] == pytest.approx(1 / 2)
    assert out["per_tier"]["rare"]["hallucinated_per_response"] == pytest.approx(1.0)
    assert out["per_tier"]["popular"]["hallucinated_per_response"] == 0.0
    assert out["per_tier"]["rare"]["factscore"] == pytest.approx(0.5)
    assert out["per_tier"]["popular"]["abstain_rate"] == pytest.approx(1 / 3)
    # per person: the sum of its responding responses' FActScore terms, and how many responded (c abstained)
    assert out["per_person"] == {p.name: {"score_sum": pytest.approx(1.0), "responding": 1},
                                 r.name: {"score_sum": pytest.approx(0.5), "responding": 1}}
    people = out["per_person"].values()
    assert sum(x["score_sum"] for x in people) / sum(x["responding"] for x in people) == pytest.approx(out["factscore"])
    for name in ("report.json", "report.md", "precision_vs_claims.png", "responses.jsonl", "claims.jsonl"):
        assert (tmp_path / "eval" / name).exists()
    # the audit file lists every sentence: the abstentions as abstained, the wrong hometown with the stored one
    audit = [json.loads(line) for line in (tmp_path / "eval" / "claims.jsonl").read_text().splitlines()]
    assert [(a["response_id"], a["label"]) for a in audit] == [
        ("a", "supported"), ("a", "supported"), ("a", "abstained"), ("b", "supported"), ("b", "not_supported"),
        ("c", "abstained")]
    assert audit[4]["evidence"] == [f"({r.name.lower()}, hometown) is [{r.facts['hometown'].lower()!r}], not {wrong.lower()!r}"]
    assert capsys.readouterr().out == ""  # the eval command's table goes to its report.md, not to the lab's output
    fresh = [{k: r[k] for k in ("id", "prompt", "response", "tier")} for r in rows]
    again = score_rows(fresh, kb)  # the same summary without the files
    for key in ("factscore", "safe_f1", "precision", "claims_per_response", "abstain_rate"):
        assert again[key] == pytest.approx(out[key]) and again["per_tier"]["rare"][key] == pytest.approx(out["per_tier"]["rare"][key])
