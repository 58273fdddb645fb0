"""LLM extractors and verifiers end to end against the scripted server (real client code path)."""

import pytest

from nemo_factuality.claims.llm import (
    ExtractionParseError,
    FactScoreExtractor,
    RLFHExtractor,
    SAFEExtractor,
    parse_bullets,
    parse_rlfh,
)
from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.text.segment import RegexSegmenter
from nemo_factuality.types import Claim, Label
from nemo_factuality.verify.llm_judge import AnswerGrader, CoverageJudge, InformativenessScorer, LLMJudgeVerifier

pytestmark = pytest.mark.waits  # mostly on judge timeouts (tests/conftest.py gives it the waiting lane)

RESPONSE = "Paris is the capital of France. It has about two million inhabitants."
RLFH_REPLY = """>> Sentence 1: Paris is the capital of France.
* Paris is the capital of France.
>> Sentence 2: It has about two million inhabitants.
* Paris has about two million inhabitants.
"""


def test_rlfh_parser_shapes():
    assert parse_rlfh("No statements") == {}
    assert parse_rlfh(RLFH_REPLY)["Paris is the capital of France."] == ["Paris is the capital of France."]
    with pytest.raises(ExtractionParseError):
        parse_rlfh("Here are the facts: Paris is big.")


def test_bullet_parser_variants():
    assert parse_bullets("- a\n* b\n1. c\n2) d\n\nNote: done") == ["a", "b", "c", "d"]
    assert parse_bullets("- NON_FACTUAL", sentinel="NON_FACTUAL") == []
    assert parse_bullets("   ") == []
    with pytest.raises(ExtractionParseError):
        parse_bullets("Paris is the capital.")


def test_rlfh_extractor_retries_garbage_then_succeeds():
    state = {"n": 0}

    def script(req):
        state["n"] += 1
        return Reply("garbage with no format") if state["n"] == 1 else Reply(RLFH_REPLY)

    seg = RegexSegmenter()
    with ScriptedOpenAIServer(script) as srv:
        ex = RLFHExtractor(OpenAIJudgeClient(srv.url, "judge"), retries=2)
        (claims,) = ex.extract_batch(["Capital?"], [RESPONSE], [seg.split(RESPONSE)])
        temps = [r["temperature"] for r in srv.requests]
    assert temps[1] > temps[0]  # RLFH raises the temperature on retry
    assert [c.text for c in claims] == ["Paris is the capital of France.", "Paris has about two million inhabitants."]
    assert claims[0].span is not None and claims[0].sentence_id == 0
    # paraphrased: owner sentence kept, span = the LCS of the statement inside it (methods.md §2.4)
    assert claims[1].sentence_id == 1 and claims[1].span is not None
    sentence_1 = seg.split(RESPONSE)[1].span
    assert sentence_1.start <= claims[1].span.start < claims[1].span.end <= sentence_1.end


def test_extractors_give_empty_and_count_failure_when_always_garbage():
    seg = RegexSegmenter()
    with ScriptedOpenAIServer(lambda r: Reply("nothing useful")) as srv:
        ex = FactScoreExtractor(OpenAIJudgeClient(srv.url, "judge"), retries=1)
        out = ex.extract_batch(["p", "p"], [RESPONSE, ""], [seg.split(RESPONSE), []])
    assert out == [[], []] and ex.stats["parse_failures"] == 1
    # the failure is a value: the first list says why, the blank response's list is a plain "no claims"
    assert "extraction failed" in out[0].error and "nothing useful" in out[0].error
    assert getattr(out[1], "error", None) is None


def test_safe_extractor_one_request_per_sentence():
    seg = RegexSegmenter()
    with ScriptedOpenAIServer(lambda r: Reply("- fact A\n- fact B")) as srv:
        (claims,) = SAFEExtractor(OpenAIJudgeClient(srv.url, "judge")).extract_batch(["p"], [RESPONSE], [seg.split(RESPONSE)])
        assert len(srv.requests) == 2
    assert [c.sentence_id for c in claims] == [0, 0, 1, 1]


def _items(texts):
    return [VerifyItem(Claim(i, t), evidence=("Paris is the capital of France.",), prompt="q") for i, t in enumerate(texts)]


def test_llm_verifier_styles_and_garbage_mid_batch():
    replies = {"claim-ok": "Correct", "claim-bad": "Wrong.", "claim-vague": "Vague", "claim-garbage": "I like turtles",
               "claim-down": Reply("x", status=500)}
    with ScriptedOpenAIServer(by_substring=replies) as srv:
        v = LLMJudgeVerifier(OpenAIJudgeClient(srv.url, "judge", max_retries=0), style="rlfh")
        out = v.verify_batch(_items(list(replies)))
    labels = [x.label for x in out]
    assert labels == [Label.SUPPORTED, Label.NOT_SUPPORTED, Label.NOT_ENOUGH_INFO, Label.UNPARSEABLE, Label.UNPARSEABLE]
    assert "unparseable RLFH verify reply" in out[3].error and out[3].raw == "I like turtles"
    assert "HTTP 500" in out[4].error
    assert v.stats == {"claims_verified": 5, "judge_errors": 1, "unparseable": 1}


def test_truthfulness_uses_logprobs_for_p_true():
    lp = [{"token": "True", "logprob": -0.2231, "top_logprobs": [{"token": "True", "logprob": -0.2231},
                                                                {"token": "False", "logprob": -1.6094}]}]
    with ScriptedOpenAIServer(lambda r: Reply("True", logprobs=lp)) as srv:
        (verdict,) = LLMJudgeVerifier(OpenAIJudgeClient(srv.url, "judge"), style="truthfulness").verify_batch(_items(["c"]))
        assert srv.requests[0]["logprobs"] is True
    assert verdict.label is Label.SUPPORTED and verdict.score == pytest.approx(0.8 / (0.8 + 0.2), abs=1e-3)


def test_informativeness_coverage_and_grader():
    with ScriptedOpenAIServer(by_substring={"Statement: s1": "4", "Statement: s2": "no idea", "Fact: f1": "Covered",
                                            "Fact: f2": "Not covered", "Fact: f3": "?", "Gold answer: Paris": "A",
                                            "Gold answer: Rome": "C"}) as srv:
        client = OpenAIJudgeClient(srv.url, "judge")
        assert [x[0] for x in InformativenessScorer(client).score_batch(_items(["s1", "s2"]))] == [4, None]
        cov = CoverageJudge(client)
        assert cov.covered_batch(["r"] * 3, ["f1", "f2", "f3"]) == [True, False, None] and cov.errors == 1
        grades = AnswerGrader(client).grade_batch(["q", "q"], ["Paris", "Rome"], ["Paris", "I don't know"])
        assert [g[0] for g in grades] == ["CORRECT", "NOT_ATTEMPTED"]


@pytest.mark.parametrize("logprobs", [[{"token": "True", "logprob": "high"}], [{"top_logprobs": None}], "garbage",
                                      [{"token": "True", "logprob": 1e400}], {"content": 7}])
def test_truthfulness_verifier_turns_malformed_logprobs_into_unparseable(logprobs):
    from nemo_factuality.interfaces import VerifyItem
    from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
    from nemo_factuality.types import Claim, Label
    from nemo_factuality.verify.llm_judge import LLMJudgeVerifier

    with ScriptedOpenAIServer(lambda req: Reply("True", logprobs=logprobs)) as server:
        verifier = LLMJudgeVerifier(OpenAIJudgeClient(server.url, "judge", max_retries=0), style="truthfulness")
        (verdict,) = verifier.verify_batch([VerifyItem(Claim(0, "Paris is in France."))])
    assert verdict.label is Label.UNPARSEABLE and verdict.error, verdict
    assert verifier.stats["unparseable"] == 1
