"""``claims.jsonl`` through the real ``nemo-factuality eval`` command: every judged claim, its span, label and evidence
(hand-derived), and blank generations counted (report, markdown, console) instead of read as abstentions."""

import json

from nemo_factuality.cli import main as cli


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_pipeline_labelled_claims_have_spans_labels_and_the_fact_checked(tmp_path):
    kb = tmp_path / "kb.sqlite"
    (tmp_path / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    _write(tmp_path / "f.jsonl", [{"subject": "Ada Varga", "relation": "born_year", "value": "1917",
                                   "text": "Ada Varga was born in 1917."},
                                  {"subject": "Ada Varga", "relation": "hometown", "value": "Ostrava",
                                   "text": "Ada Varga grew up in Ostrava."}])
    assert cli(["kb", "build", "--passages", str(tmp_path / "p.jsonl"), "--facts", str(tmp_path / "f.jsonl"),
                "--out", str(kb)]) == 0
    response = "Ada Varga was born in 1917. Ada Varga grew up in Lyon. Ada Varga liked tea."
    recs = [{"id": "a", "prompt": "Tell me a bio of Ada Varga.", "response": response, "topic": "Ada Varga"},
            {"id": "b", "prompt": "Tell me a bio of Ada Varga.", "response": "   "}]
    out = tmp_path / "out"
    assert cli(["eval", "--input", str(_write(tmp_path / "r.jsonl", recs)), "--output", str(out), "--config-name", "demo_kb",
                f"pipeline.verifier.store_path={kb}"]) == 0
    got = _lines(out / "claims.jsonl")
    # by hand: the three sentences at offsets 0-27, 28-54, 55-76; the first states the stored year, the second
    # another hometown than the stored one, the third a relation the store does not hold (not enough info, which
    # eval counts as not supported); the blank response has no claim and one "abstained" record
    assert [(g["response_id"], g["claim_index"], g["claim"], g["span"], g["label"]) for g in got] == [
        ("a", 0, "Ada Varga was born in 1917.", [0, 27], "supported"),
        ("a", 1, "Ada Varga grew up in Lyon.", [28, 54], "not_supported"),
        ("a", 2, "Ada Varga liked tea.", [55, 75], "not_supported"),
        ("b", None, None, None, "abstained")]
    assert [response[s:e] for s, e in (g["span"] for g in got[:3])] == [g["claim"] for g in got[:3]]
    assert got[0]["evidence"] == ["exact fact sentence"]  # kb_exact: the claim is a stored fact's own sentence
    assert got[1]["evidence"] == ["(ada varga, hometown) is ['ostrava'], not 'lyon'"]
    assert got[2]["evidence"] == ["no stored fact about this claim"] and got[3]["empty_response"] is True


def test_labelled_records_located_and_empty_generations_counted(tmp_path, capsys):
    response = "Paris is big. Paris is big. Lyon is old."
    recs = [{"id": 1, "prompt": "p", "response": response,
             "claims": [{"text": "Paris is big.", "label": "supported"}, {"text": "Paris is big.", "label": "supported"},
                        {"text": "Lyon is old.", "label": "not_supported"}, {"text": "a paraphrase", "label": "irrelevant"}],
             "abstentions": [{"text": "I don't know its size.", "span": [50, 72]}]},
            {"id": 2, "prompt": "p", "response": "I'm sorry, I cannot help.", "claims": None},
            {"id": 3, "prompt": "p", "response": "", "claims": None},
            {"id": 4, "prompt": "p", "response": "\n", "claims": []}]
    out = tmp_path / "o"
    assert cli(["eval", "--input", str(_write(tmp_path / "r.jsonl", recs)), "--output", str(out)]) == 0
    got = _lines(out / "claims.jsonl")
    # a repeated claim is located after the previous one (14, not 0); a paraphrase has no span; an abstention keeps its
    # own span and is "abstained"; responses without claims get one record each, two of them blank
    assert [(g["response_id"], g["claim_index"], g["span"], g["label"]) for g in got] == [
        ("1", 0, [0, 13], "supported"), ("1", 1, [14, 27], "supported"), ("1", 2, [28, 40], "not_supported"),
        ("1", 3, None, "irrelevant"), ("1", 4, [50, 72], "abstained"),
        ("2", None, None, "abstained"), ("3", None, None, "abstained"), ("4", None, None, "abstained")]
    assert [g.get("empty_response") for g in got[5:]] == [False, True, True]
    assert all(g["evidence"] is None for g in got)  # labelled without evidence
    report = json.loads((out / "report.json").read_text())
    assert report["groups"]["all"]["n_empty"] == 2 and report["groups"]["all"]["n_abstained"] == 3
    assert "**2 of 4 responses are empty**" in (out / "report.md").read_text()
    assert "2 of 4 responses are empty (blank)" in capsys.readouterr().err


def test_all_empty_generations_say_so(tmp_path, capsys):
    recs = [{"id": i, "prompt": "p", "response": "", "claims": None} for i in range(3)]
    assert cli(["eval", "--input", str(_write(tmp_path / "r.jsonl", recs)), "--output", str(tmp_path / "o")]) == 0
    assert "3 of 3 responses are empty" in capsys.readouterr().err
    assert all(g["empty_response"] for g in _lines(tmp_path / "o" / "claims.jsonl"))
