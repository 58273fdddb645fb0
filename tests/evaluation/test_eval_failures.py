"""Issue 11 §1: ``nemo-factuality eval`` with a judge that is down — failed records are excluded, counted in the
report, and the run exits non-zero above ``--max-failed-fraction`` (default 0); ``--fail-fast`` stops at once."""

import json

import pytest

from nemo_factuality.evaluation.cli import main as eval_main
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer


@pytest.fixture()
def inputs(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    kb = build_store(tmp_path / "p.jsonl", tmp_path / "kb.sqlite", progress=False)
    records = [{"id": str(i), "prompt": "Who is Ada?", "response": f"Ada Varga was born in {1917 + i}."} for i in range(4)]
    src = tmp_path / "responses.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    return src, kb


def _judge(down_for=()):
    def script(req):
        content = req["messages"][-1]["content"]
        if any(year in content for year in down_for):
            return Reply("model crashed", status=503)
        if "atomic facts" in content:
            sentence = content.split("Sentence:")[-1].strip()
            return Reply(f"- {sentence}")
        return Reply("[Supported]" if "1917" in content.split("Statement:")[-1] else "[Not Supported]")
    return script


def _run(srv, src, kb, out, *extra):
    return eval_main(["--input", str(src), "--output", str(out), "--config-name", "safe_vllm",
                      f"pipeline.evidence.store_path={kb}", f"pipeline.judge.base_url={srv.url}",
                      "pipeline.judge.max_retries=0", "pipeline.judge.backoff_s=0.01", *extra])


def test_safe_vllm_with_no_judge_exits_nonzero_and_counts_every_record(inputs, tmp_path, capsys):
    src, kb = inputs
    with ScriptedOpenAIServer(default=Reply("unavailable", status=503)) as srv:
        rc = _run(srv, src, kb, tmp_path / "out")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rc == 1  # not 0 with every record "abstained"
    assert report["failures"]["n_failed"] == 4 and report["failures"]["exceeded"] is True
    assert report["groups"] == {}  # nothing is scored from failed checks
    assert "HTTP 503" in report["failures"]["records"][0]["error"]
    assert "4 of 4 records could not be fact-checked" in capsys.readouterr().err


def test_partial_failure_is_excluded_and_the_fraction_is_configurable(inputs, tmp_path):
    src, kb = inputs
    with ScriptedOpenAIServer(_judge(down_for=("1920",))) as srv:
        strict = _run(srv, src, kb, tmp_path / "strict")
        lenient = _run(srv, src, kb, tmp_path / "lenient", "--max-failed-fraction", "0.25")
    report = json.loads((tmp_path / "lenient" / "report.json").read_text())
    assert strict == 1 and lenient == 0
    assert report["failures"]["n_failed"] == 1 and report["failures"]["fraction"] == 0.25
    assert report["failures"]["records"][0]["where"].endswith(":4")
    g = report["groups"]["all"]
    assert g["n_records"] == 3 and g["n_abstained"] == 0  # the failed record is not an abstention
    assert g["safe"]["precision"] == pytest.approx(1 / 3)  # 1917 supported; 1918, 1919 not; 1920 excluded
    assert "1 of 4 records could not be fact-checked" in (tmp_path / "lenient" / "report.md").read_text()


def test_fail_fast_stops_at_the_first_failure(inputs, tmp_path, capsys):
    src, kb = inputs
    with ScriptedOpenAIServer(_judge(down_for=("1918",))) as srv:
        rc = _run(srv, src, kb, tmp_path / "ff", "--fail-fast")
    assert rc == 1 and not (tmp_path / "ff" / "report.json").exists()
    err = capsys.readouterr().err
    assert "responses.jsonl:2" in err and "--fail-fast" in err and "HTTP 503" in err
