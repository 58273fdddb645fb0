"""The composed pipeline end to end: offline parts by registry name, and an LLM pipeline over a loopback judge."""

import json

import pytest

from nemo_factuality.knowledge.store import build_store
from nemo_factuality.pipeline import PipelineConfig, build_pipeline
from nemo_factuality.registry import RegistryError
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.types import FactualityInputError, Label


@pytest.fixture(scope="module")
def kb(tmp_path_factory):
    d = tmp_path_factory.mktemp("kb")
    (d / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    (d / "f.jsonl").write_text(json.dumps({"subject": "Ada Varga", "relation": "born_year", "value": "1917",
                                           "text": "Ada Varga was born in 1917."}) + "\n")
    return str(build_store(d / "p.jsonl", d / "kb.sqlite", facts_jsonl=d / "f.jsonl", progress=False))


def test_offline_pipeline(kb):
    pipe = build_pipeline({"verifier": {"name": "kb_exact", "store_path": kb}})
    checks = pipe.check(["q"] * 4, ["Ada Varga was born in 1917. Ada Varga was born in 1920.", "", "   ",
                                     "I'm sorry, I cannot help."])
    assert [v.label for v in checks[0].verdicts] == [Label.SUPPORTED, Label.NOT_SUPPORTED]
    assert [c.abstained for c in checks] == [False, True, True, True]
    assert pipe.health() == {"knowledge_store": None}


def test_pipeline_config_errors(kb):
    with pytest.raises(RegistryError, match=r"missing required option\(s\) \['store_path'\]"):
        build_pipeline(PipelineConfig())
    with pytest.raises(FactualityInputError, match="needs an LLM judge"):
        build_pipeline({"extractor": {"name": "rlfh"}, "verifier": {"name": "kb_exact", "store_path": kb}})
    with pytest.raises(RegistryError, match="Known verifiers"):
        build_pipeline({"verifier": {"name": "oracle"}})
    with pytest.raises(FactualityInputError, match="unknown key"):
        build_pipeline({"verfier": {}})
    pipe = build_pipeline({"verifier": {"name": "kb_exact", "store_path": kb}})
    with pytest.raises(FactualityInputError, match="column 'topics' has 1 entries but there are 2"):
        pipe.check(["a", "b"], ["x", "y"], topics=["t"])


def test_llm_pipeline_over_loopback_judge(kb):
    def script(req):
        content = req["messages"][-1]["content"]
        if "atomic facts" in content:
            return Reply("- Ada Varga was born in 1917.\n- Ada Varga was a pilot.")
        return Reply("[Supported]" if "born in 1917" in content.split("Statement:")[-1] else "[Not Supported]")

    with ScriptedOpenAIServer(script) as srv:
        pipe = build_pipeline({"extractor": {"name": "factscore"}, "evidence": {"name": "kb", "store_path": kb},
                               "verifier": {"name": "llm_judge", "style": "safe"},
                               "judge": {"base_url": srv.url, "model": "judge", "concurrency": 4}})
        (check,) = pipe.check(["Tell me about Ada Varga."], ["Ada Varga was born in 1917 and flew planes."],
                              topics=["Ada Varga"])
        verify_prompts = [r["messages"][-1]["content"] for r in srv.requests if "[Supported]" in r["messages"][-1]["content"]]
    assert [c.text for c in check.claims] == ["Ada Varga was born in 1917.", "Ada Varga was a pilot."]
    assert [v.label for v in check.verdicts] == [Label.SUPPORTED, Label.NOT_SUPPORTED]
    assert all("Ada Varga was born in 1917." in p for p in verify_prompts)  # KB evidence reached the judge
