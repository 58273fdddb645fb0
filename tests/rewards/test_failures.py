"""Issue 11 §1: a failure is a value, never a default — with a judge that answers 503 (or garbage), every
reward gives NaN with the reason in ``details[i]["error"]``, FactAlign gives no label, and nothing scores 0.0."""

import math

import numpy as np
import pytest

from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.pipeline import build_pipeline
from nemo_factuality.rewards.factalign import FactAlignConfig, FactAlignLabeler
from nemo_factuality.rewards.klcf import KLCFConfig, KLCFReward
from nemo_factuality.rewards.knowrl import KnowRLReward
from nemo_factuality.rewards.rlfh import RLFHReward
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.verify.llm_judge import AnswerGrader, CoverageJudge, InformativenessScorer

pytestmark = pytest.mark.waits  # mostly on scripted judges' timeouts (tests/conftest.py gives it the waiting lane)

RESPONSE = "Ada Varga was born in 1917. Ada Varga grew up in Ostrava."
DOWN = Reply("upstream unavailable", status=503)


@pytest.fixture()
def down_judge():
    with ScriptedOpenAIServer(default=DOWN) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", max_retries=0, timeout_s=5)
        yield client
        client.close()


def _assert_failed(batch, i, *needles):
    assert math.isnan(batch.scores[i]), f"sample {i} scored {batch.scores[i]} with its judge down"
    err = batch.details[i]["error"]
    for needle in needles:
        assert needle in err, err


def test_klcf_with_judge_down_is_nan_not_zero(down_judge):
    pipe = build_pipeline({"extractor": {"name": "klcf", "retries": 0}, "verifier": {"name": "llm_judge", "style": "truthfulness"},
                           "abstain_detection": None}, judge_client=down_judge)
    reward = KLCFReward(pipe, CoverageJudge(down_judge), KLCFConfig(w_rm=0))
    out = reward(["Who is Ada?", "q"], [RESPONSE, ""], checklist=[["Ada Varga was born in 1917."], []])
    _assert_failed(out, 0, "klcf claim extraction failed", "HTTP 503", "judge.timeout_s")
    assert math.isnan(out.scores[1]) and "error" not in out.details[1]  # blank = abstain, not a failure


def test_klcf_unreadable_coverage_is_not_not_covered(kb_pipeline):
    with ScriptedOpenAIServer(by_substring={"Fact: Ada Varga was born": "Covered"}, default="I cannot tell") as srv:
        reward = KLCFReward(kb_pipeline, CoverageJudge(OpenAIJudgeClient(srv.url, "judge")), KLCFConfig(w_rm=0))
        out = reward(["q", "q"], [RESPONSE, RESPONSE],
                     checklist=[["Ada Varga was born in 1917.", "Ada Varga grew up in Ostrava."], ["Ada Varga was born in 1917."]])
    _assert_failed(out, 0, "1 of 2 checklist items unjudged", "I cannot tell")
    assert out.scores[1] == pytest.approx(1.0 + 1.0)  # both claims supported, the one item covered


def test_klcf_failed_general_rm_fails_its_samples(kb_pipeline):
    def broken_rm(prompts, completions):
        raise ConnectionError("rm node unreachable")

    out = KLCFReward(kb_pipeline, None, KLCFConfig(w_rm=1.0), general_rm=broken_rm)(["q"], [RESPONSE])
    _assert_failed(out, 0, "general reward model failed", "rm node unreachable")


def test_rlfh_with_judge_down_is_nan_not_zero(down_judge, tiny_tokenizer):
    pipe = build_pipeline({"extractor": {"name": "rlfh", "retries": 0}, "evidence": {"name": "bm25_sections"},
                           "verifier": {"name": "llm_judge", "style": "rlfh"}, "abstain_detection": None}, judge_client=down_judge)
    out = RLFHReward(pipe, InformativenessScorer(down_judge), tokenizer=tiny_tokenizer)(["q"], [RESPONSE], materials=[["x"]])
    _assert_failed(out, 0, "rlfh claim extraction failed", "HTTP 503")
    assert not out.token_rewards[0].any()  # no token carries a reward for a failed sample


def test_rlfh_informativeness_judge_down_fails_the_sample():
    def judge(req):
        content = req["messages"][-1]["content"]
        if "atomic statements" in content:
            return Reply(">> Sentence 1: Ada Varga was born in 1917.\n* Ada Varga was born in 1917")
        return Reply("Correct") if "Choose from" in content else DOWN

    with ScriptedOpenAIServer(judge) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", max_retries=0)
        pipe = build_pipeline({"extractor": {"name": "rlfh"}, "evidence": {"name": "bm25_sections"},
                               "verifier": {"name": "llm_judge", "style": "rlfh"}}, judge_client=client)
        out = RLFHReward(pipe, InformativenessScorer(client))(["q"], ["Ada Varga was born in 1917."], materials=[["x"]])
    _assert_failed(out, 0, "informativeness judge failed for 1 of 1 statements", "HTTP 503")


def test_verifier_down_fails_sample_even_when_extraction_worked(kb):
    def judge(req):
        content = req["messages"][-1]["content"]
        return Reply("- Ada Varga was born in 1917.") if "atomic facts" in content else DOWN

    with ScriptedOpenAIServer(judge) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", max_retries=0)
        pipe = build_pipeline({"extractor": {"name": "factscore"}, "verifier": {"name": "llm_judge", "style": "safe"},
                               "abstain_detection": None}, judge_client=client)
        (check,) = pipe.check(["q"], [RESPONSE])
        out = KLCFReward(pipe, None, KLCFConfig(w_rm=0))(["q"], [RESPONSE])
    assert check.error.startswith("verification failed for 1 of 1 claims") and not check.abstained
    _assert_failed(out, 0, "verification failed")


def test_factalign_emits_no_label_for_a_failed_check(down_judge):
    pipe = build_pipeline({"extractor": {"name": "safe", "retries": 0}, "verifier": {"name": "llm_judge", "style": "safe"},
                           "abstain_detection": None}, judge_client=down_judge)
    out = FactAlignLabeler(pipe, FactAlignConfig(k=2))(["q"], [RESPONSE])
    assert math.isnan(out.components["label"][0])  # not 0.0 = "undesirable": the KTO data stays clean
    assert out.sentence_labels == [[]] and out.sentence_spans == [[]]
    _assert_failed(out, 0, "safe claim extraction failed")


def test_knowrl_grader_down_is_nan(kb, down_judge):
    pipe = build_pipeline({"verifier": {"name": "kb_exact", "store_path": kb}, "abstain_detection": None})
    out = KnowRLReward(pipe, AnswerGrader(down_judge))(["When?"], ["Ada Varga was born in 1917.</think><answer>1917</answer>"],
                                                      ground_truth=["1917"])
    _assert_failed(out, 0, "answer grading failed", "HTTP 503")
    assert np.isnan(out.components["correct"][0])


def test_klcf_checklist_builder_never_writes_a_silently_empty_checklist(down_judge, tmp_path):
    import json

    from nemo_factuality.rewards.klcf_checklist import build_checklists

    src = tmp_path / "samples.jsonl"
    src.write_text(json.dumps({"prompt": "Who is Ada?", "responses": [RESPONSE, RESPONSE]}) + "\n")
    pipe = build_pipeline({"extractor": {"name": "klcf", "retries": 0}, "verifier": {"name": "llm_judge", "style": "truthfulness"},
                           "abstain_detection": None}, judge_client=down_judge)
    build_checklists(pipe, src, tmp_path / "out.jsonl")
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["checklist"] is None and row["n_failed"] == 2 and "HTTP 503" in row["error"]


# a special token sampled inside a multi-byte character: ids that cannot be aligned to the text they decode to
UNALIGNABLE_IDS = [347, 213, 161, 1, 109, 7, 367, 386]


def test_a_sample_whose_token_ids_do_not_align_fails_alone(kb, tiny_tokenizer):
    """FSPO's token signs and RLFH's token rewards need the policy's ids aligned to the text: one sample whose ids
    cannot be is NaN with the reason and zero token outputs, the rest of the batch is scored as usual."""
    from nemo_factuality.rewards.fspo import FSPOConfig, FSPOReward

    bad = tiny_tokenizer.decode(UNALIGNABLE_IDS, skip_special_tokens=True)
    good = "<think>Ada Varga was born in 1917.</think><answer>1917</answer>"
    ids = [UNALIGNABLE_IDS, tiny_tokenizer.encode(good, add_special_tokens=False)]
    pipe = build_pipeline({"extractor": {"name": "identity", "segments": ["think"]}, "evidence": {"name": "given"},
                           "verifier": {"name": "kb_exact", "store_path": kb}, "abstain_detection": None})
    out = FSPOReward(pipe, FSPOConfig(), tiny_tokenizer)(["q", "q"], [bad, good], ground_truth=["1917"] * 2,
                                                         knowledge=["Ada Varga was born in 1917."] * 2, completion_ids=ids)
    _assert_failed(out, 0, "token alignment", "out of order")
    assert out.scores[1] > 0 and "error" not in out.details[1]
    assert [len(s) for s in out.token_signs] == [len(x) for x in ids] and not out.token_signs[0].any()
    assert out.token_signs[1].any()  # the good sample's verified step is signed

    def judge(req):
        content = req["messages"][-1]["content"]
        if "atomic statements" in content:
            return Reply(">> Sentence 1: Ada Varga was born in 1917.\n* Ada Varga was born in 1917")
        return Reply("Correct") if "Choose from" in content else Reply("5")

    with ScriptedOpenAIServer(judge) as srv:
        client = OpenAIJudgeClient(srv.url, "judge", max_retries=0)
        rlfh_pipe = build_pipeline({"extractor": {"name": "rlfh"}, "evidence": {"name": "bm25_sections"},
                                    "verifier": {"name": "llm_judge", "style": "rlfh"}}, judge_client=client)
        text = "Ada Varga was born in 1917."
        ids = [UNALIGNABLE_IDS, tiny_tokenizer.encode(text, add_special_tokens=False)]
        out = RLFHReward(rlfh_pipe, InformativenessScorer(client), tokenizer=tiny_tokenizer)(
            ["q", "q"], [bad, text], materials=[["x"]] * 2, completion_ids=ids)
    _assert_failed(out, 0, "token alignment")
    assert math.isfinite(out.scores[1]) and "error" not in out.details[1]
    assert [len(t) for t in out.token_rewards] == [len(x) for x in ids] and not out.token_rewards[0].any()
