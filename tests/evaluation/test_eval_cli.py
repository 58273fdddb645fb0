"""``nemo-factuality eval`` end to end: hand-computed report numbers, demo, grouping, bad input."""

import json
import math
import os
import re

import pytest

from nemo_factuality.cli import main as cli
from nemo_factuality.evaluation.cli import main as eval_main
from nemo_factuality.types import FactualityInputError

S, NS, IR = "supported", "not_supported", "irrelevant"


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _rec(i, labels, group="a"):
    claims = None if labels is None else [{"text": f"c{j}", "label": lab} for j, lab in enumerate(labels)]
    return {"id": str(i), "prompt": "p", "response": "r", "claims": claims, "g": group}


def test_report_numbers_by_hand(tmp_path):
    recs = [_rec(1, [S, S, NS, IR]), _rec(2, [S]), _rec(3, None), _rec(4, [IR])]
    out = tmp_path / "out" / "report.json"
    assert cli(["eval", "--input", str(_write(tmp_path / "r.jsonl", recs)), "--output", str(out), "--k", "2", "--gamma", "0,10"]) == 0
    g = json.loads(out.read_text())["groups"]["all"]
    # SAFE over every response with >= 1 claim of any label (rec 1: S=2, NS=1; rec 2: S=1, NS=0; rec 4: only IR,
    # F1 = 0 and P = 0, as SAFE's evaluation counts it); rec 3 abstained (no claims) -> not an item.
    # rec1: P=2/3, R=min(1,2/2)=1, F1=2*(2/3)/(5/3)=0.8; rec2: P=1, R=1/2, F1=2*0.5/1.5=2/3.
    assert g["safe"]["f1@2"] == pytest.approx((0.8 + 2 / 3 + 0) / 3, abs=1e-12)
    assert g["safe"]["recall@2"] == pytest.approx((1 + 1 / 2 + 0) / 3, abs=1e-12)
    assert g["safe"]["precision"] == pytest.approx((2 / 3 + 1 + 0) / 3, abs=1e-12) and g["safe"]["n_items"] == 3
    assert g["safe"]["n_all_irrelevant"] == 1
    # FActScore: IR = not supported; rec3 (null) abstains; rec4 responds with 0/1.
    # gamma 0: mean(2/4, 1/1, 0/1) = 0.5; respond 3/4; facts/resp (4+1+1)/3 = 2.
    fs0 = g["factscore"]["gamma0"]
    assert fs0["score"] == pytest.approx(0.5) and fs0["respond_ratio"] == 0.75 and fs0["num_facts_per_response"] == 2
    # gamma 10: penalties exp(1-10/4), exp(1-10), exp(1-10) -> 0.5*e^-1.5 + 1*e^-9 + 0
    assert g["factscore"]["gamma10"]["score"] == pytest.approx((0.5 * math.exp(-1.5) + math.exp(-9)) / 3, abs=1e-12)
    # VeriScore: totals [4, 1, 1] -> upper median 1, max 4; P = (2/4 + 1 + 0)/3 = 0.5
    assert g["veriscore"]["K_median"] == 1 and g["veriscore"]["K_max"] == 4 and g["veriscore"]["precision"] == pytest.approx(0.5)
    # HalluLens (k=32): per prompt P = 2/4, 1, 0; R = 2/32, 1/32, 0
    assert g["hallulens"]["precision"] == pytest.approx(0.5)
    assert (out.parent / "report.md").read_text().startswith("# Factuality evaluation")
    assert (out.parent / "precision_vs_claims.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_group_by_and_demo(tmp_path):
    recs = [_rec(1, [S], "x"), _rec(2, [NS], "y")]
    out = tmp_path / "g"
    assert cli(["eval", "--input", str(_write(tmp_path / "r.jsonl", recs)), "--output", str(out), "--group-by", "g"]) == 0
    groups = json.loads((out / "report.json").read_text())["groups"]
    assert set(groups) == {"all", "x", "y"} and groups["x"]["safe"]["precision"] == 1.0
    demo = tmp_path / "demo"
    old_umask = os.umask(0o022)
    try:
        assert cli(["eval", "--demo", "--output", str(demo)]) == 0
    finally:
        os.umask(old_umask)
    # the temp-file-and-rename writes give the mode any file gets under umask 022 (mkstemp's is 0600)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in demo.iterdir() if p.is_file()}
    assert modes == {n: "0o644" for n in ("report.json", "report.md", "claims.jsonl", "precision_vs_claims.png",
                                          "demo_kb.sqlite")}, modes
    rep = json.loads((demo / "report.json").read_text())["groups"]
    # careful responders are more precise than bold ones on the embedded knowledge store
    assert rep["careful"]["safe"]["precision"] > rep["bold"]["safe"]["precision"]
    assert rep["all"]["n_records"] == 36 and rep["hedging"]["n_abstained"] >= 1


@pytest.mark.parametrize("content,needle", [
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": []}\nnot json\n', r"r.jsonl:2: invalid JSON"),
    (b'{"id": 1, "prompt": "p", "claims": []}\n', r"r.jsonl:1: missing field 'response'"),
    # issue 43: every missing field at once, and the fields the record does have
    (b'{"uid": 1, "question": "p", "answer": "r"}\n',
     r"r.jsonl:1: missing fields 'id', 'prompt', 'response' \(it has 'answer', 'question', 'uid'\)"),
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": [{"text": "c", "label": "maybe"}]}\n', r"label 'maybe' is not one of"),
    (b'{"id": 1, "prompt": "p", "response": "\xff"}\n', r"r.jsonl:1: invalid UTF-8"),
    # issue 17: each of these was a traceback with exit 1
    *[(b'{"id": 1, "prompt": "p", "response": "r", "claims": [], "unparseable": ' + v + b"}\n",
       r"r.jsonl:1: field 'unparseable' must be a non-negative integer") for v in (b"null", b'"three"', b"-Infinity")],
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": [], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}\n",
     r"r.jsonl:1: JSON nested too deeply"),
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": [], "x": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
     r"r.jsonl:1: JSON nested too deeply"),
    (b'{"id": ' + b"1" * 4301 + b', "prompt": "p", "response": "r", "claims": []}\n', r"r.jsonl:1: a JSON integer has more than 4300 digits"),
    (b'{"id": 1, "prompt": "p", "response": "r", "materials": 1.5}\n', r"r.jsonl:1: field 'materials' must be a list of strings"),
    (b'{"id": 1, "prompt": "p", "response": "r", "topic": ["t"]}\n', r"r.jsonl:1: field 'topic' must be a string or null"),
    # issue 43 item 9: a response past the segmenter's limit was refused mid-fact-checking, naming no record
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": []}\n{"id": "big", "prompt": "p", "response": "'
     + b"x" * 200_001 + b'"}\n', r"r.jsonl:2 \(id 'big'\): response has 200001 characters, more than "
     r"pipeline.segmenter.max_chars=200000"),
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": []}\n{"id": 2, "prompt": "p", "response": "r", "claims": []}\n'
     b'{"id": "1", "prompt": "p", "response": "r", "claims": []}\n', r"r.jsonl:3: id '1' repeats the id on \S*r.jsonl:1"),
    (b'{"id": [1], "prompt": "p", "response": "r", "claims": []}\n', r"r.jsonl:1: field 'id' must be a string or an integer"),
    (b'{"id": 1, "prompt": {"a": 1}, "response": "r", "claims": []}\n', r"r.jsonl:1: field 'prompt' must be a string"),
    (b'{"id": 1, "prompt": "p", "response": "r", "claims": [{"text": ["c"], "label": "supported"}]}\n',
     r"r.jsonl:1: claims\[0\].text must be a string"),
])
def test_bad_input_is_named_and_nothing_written(tmp_path, capsys, content, needle):
    src = tmp_path / "r.jsonl"
    src.write_bytes(content)
    with pytest.raises(FactualityInputError, match=needle):  # the library raises ...
        eval_main(["--input", str(src), "--output", str(tmp_path / "o")])
    assert cli(["eval", "--input", str(src), "--output", str(tmp_path / "o")]) == 2  # ... the command says it, exit 2
    err = capsys.readouterr().err
    assert re.search(needle, err) and err.startswith("nemo-factuality eval: error:") and "Traceback" not in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_group_by_missing_field(tmp_path):
    with pytest.raises(FactualityInputError, match="--group-by field 'nope'"):
        eval_main([ "--input", str(_write(tmp_path / "r.jsonl", [_rec(1, [S])])), "--output", str(tmp_path / "o"),
             "--group-by", "nope"])


def test_group_by_value_must_be_a_scalar(tmp_path):
    rec = {**_rec(1, [S]), "g": {"nested": [1, 2]}}
    with pytest.raises(FactualityInputError, match=r"r.jsonl:1: --group-by field 'g' must be a string or a number"):
        eval_main(["--input", str(_write(tmp_path / "r.jsonl", [rec])), "--output", str(tmp_path / "o"), "--group-by", "g"])


def test_plot_series_and_legend_are_capped(tmp_path):
    from nemo_factuality.evaluation.render import MAX_LEGEND_CHARS, MAX_PLOTTED_GROUPS, plotted_groups, render_plot
    from nemo_factuality.evaluation.report import EvalRecord

    names = ["$\\frac{$", "long " * 1000, "two\nlines"] + [f"g{k}" for k in range(22)]
    records = [EvalRecord(str(i), "p", "r", (("c", S),), name) for i, name in enumerate(names)]
    series = plotted_groups(records)
    assert len(series) == MAX_PLOTTED_GROUPS + 1 and series[-1][0] == "other (15 groups)"
    assert sum(len(members) for _, members in series) == len(records)  # every record is drawn
    assert all(len(label) <= MAX_LEGEND_CHARS + 2 and "\n" not in label for label, _ in series)
    assert series[0][0] == "\\$\\frac{\\$"  # literal dollars, not mathtext
    render_plot(records, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_table_keeps_one_row_per_group():
    from nemo_factuality.evaluation.render import render_markdown
    from nemo_factuality.evaluation.report import EvalOptions, EvalRecord, build_report, to_json_safe

    names = ["a|b", "line\nbreak", "z" * 5000]
    report = to_json_safe(build_report([EvalRecord(str(i), "p", "r", (("c", S),), n) for i, n in enumerate(names)],
                                       EvalOptions()))
    rows = [line for line in render_markdown(report).splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4 and rows[1].startswith("| a\\|b |") and rows[2].startswith("| line break |")
    assert all(len(r) < 400 for r in rows)


def test_plot_draws_identical_points_once_with_their_count_and_names_what_it_leaves_out(tmp_path):
    from nemo_factuality.evaluation.render import group_label, point_counts, render_plot
    from nemo_factuality.evaluation.report import parse_record, precision_points

    recs = [_rec(i, [S, S, NS]) for i in range(5)] + [_rec(5, [S]), _rec(6, None), _rec(7, [IR, IR])]
    records = [parse_record(r, where=f"x:{i}") for i, r in enumerate(recs)]
    assert point_counts(precision_points(records)) == {(3, round(2 / 3, 6)): 5, (1, 1.0): 1}
    assert group_label("all", records) == "all: n=8, 1 abstained, 1 without S/NS"
    render_plot(records, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_counts_never_overprint(tmp_path):
    """Two groups with 17 and 30 responses at one point (4 claims, precision 1) printed "1730"; now every count
    is written where no other count is, and every count > 1 is written."""
    from nemo_factuality.evaluation.render import render_plot
    from nemo_factuality.evaluation.report import EvalRecord

    records: list[EvalRecord] = []
    for n, group, labels in ((17, "popular", [S] * 4), (30, "rare", [S] * 4), (12, "popular", [S] * 3 + [NS]),
                             (9, "rare", [S] * 3 + [NS]), (3, "popular", [S] * 12), (2, "rare", [S] * 2 + [NS] * 2),
                             (7, "popular", [S] * 5), (5, "rare", [S] * 5)):
        records += [EvalRecord(str(len(records) + i), "p", "r", tuple(("c", lab) for lab in labels), group) for i in range(n)]
    written = render_plot(records, tmp_path / "p.png").counts
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # per panel: the distribution (27, 12, 35, 9, 2) and the scatter (17, 30, 12, 9, 2, 7, 5, 3)
    assert sorted(int(c.text) for c in written) == sorted([27, 12, 35, 9, 2, 17, 30, 12, 9, 2, 7, 5, 3])
    boxes = [c.box for c in written]
    for i, (ax0, ay0, ax1, ay1) in enumerate(boxes):
        for bx0, by0, bx1, by1 in boxes[i + 1:]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, (boxes[i], (bx0, by0, bx1, by1))


def _hits(circle: tuple[float, float, float], box: tuple[float, float, float, float]) -> bool:
    (x, y, r), (x0, y0, x1, y1) = circle, box
    return (min(max(x, x0), x1) - x) ** 2 + (min(max(y, y0), y1) - y) ** 2 < r**2


def _boxes_meet(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return not (a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1])


def test_plot_counts_overprint_no_other_marker_and_no_mean_bar(tmp_path):
    """A lab evaluation's precisions bunch up (4/5, 5/6, 3/4 of six slots): their markers overlap, and a count
    written on its own marker overprinted the next one, or the group's mean bar. Each count now sits on its own
    marker or beside it, clear of every other marker and bar."""
    from nemo_factuality.evaluation.render import render_plot
    from nemo_factuality.evaluation.report import EvalRecord

    records: list[EvalRecord] = []
    for n, group, labels in ((24, "rare", [S] * 6), (7, "rare", [S] * 4 + [NS]), (3, "rare", [S] * 5 + [NS]),
                             (3, "rare", [S] * 3 + [NS]), (2, "rare", [S] * 2 + [NS] * 2), (4, "rare", [S] + [NS] * 3),
                             (16, "medium", [S] * 6), (7, "medium", [S] * 4 + [NS]), (3, "medium", [S] * 5 + [NS]),
                             (3, "medium", [S] * 3 + [NS]), (2, "medium", [S] * 2 + [NS]), (23, "popular", [S] * 6)):
        records += [EvalRecord(str(len(records) + i), "p", "r", tuple(("c", lab) for lab in labels), group) for i in range(n)]
    layout = render_plot(records, tmp_path / "p.png")
    markers = layout.markers
    assert any(math.dist(a[:2], b[:2]) < a[2] + b[2] for i, a in enumerate(markers) for b in markers[i + 1:])  # they do overlap
    assert len(layout.counts) == 2 * 12  # every count > 1, in both panels, was written
    for count in layout.counts:
        others = [m for k, m in enumerate(markers) if k != count.marker]
        assert not any(_hits(m, count.box) for m in others), count
        assert not any(_boxes_meet(bar, count.box) for bar in layout.bars), count

