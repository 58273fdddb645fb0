"""Each method's reward against hand-computed cases, with real offline parts and a loopback judge."""

import math

import numpy as np
import pytest

from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.pipeline import build_pipeline
from nemo_factuality.rewards.factalign import FactAlignConfig, FactAlignLabeler, max_ngram_repeats
from nemo_factuality.rewards.fspo import FSPOConfig, FSPOReward, format_ok, token_f1
from nemo_factuality.rewards.klcf import KLCFConfig, KLCFReward
from nemo_factuality.rewards.knowrl import KnowRLConfig, KnowRLReward, combine, format_reward
from nemo_factuality.rewards.rlfh import RLFHConfig, RLFHReward
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.verify.llm_judge import AnswerGrader, CoverageJudge, InformativenessScorer

# ----------------------------------------------------------------------------------------- RLFH
RLFH_RESPONSE = "Paris is the capital of France and has two airports."
RLFH_EXTRACT = """>> Sentence 1: Paris is the capital of France and has two airports.
* Paris is the capital of France
* Paris has two airports
"""


def _rlfh_judge(req):
    content = req["messages"][-1]["content"]
    if "atomic statements" in content:
        if "I'm sorry" in content:
            return Reply(">> Sentence 1: I'm sorry, I don't have any information about that.\n* The assistant has no information")
        return Reply(RLFH_EXTRACT)
    if "Choose from" in content:
        return Reply("Correct")
    return Reply("4")  # informativeness


@pytest.fixture(scope="module")
def rlfh_server():
    with ScriptedOpenAIServer(_rlfh_judge) as srv:
        yield srv


def _rlfh(srv, tokenizer=None, **cfg):
    client = OpenAIJudgeClient(srv.url, "judge")
    pipe = build_pipeline({"extractor": {"name": "rlfh"}, "evidence": {"name": "bm25_sections"},
                           "verifier": {"name": "llm_judge", "style": "rlfh"}}, judge_client=client)
    return RLFHReward(pipe, InformativenessScorer(client), RLFHConfig(**cfg), tokenizer)


def test_rlfh_worked_example_and_token_placement(rlfh_server, tiny_tokenizer):
    reward = _rlfh(rlfh_server, tiny_tokenizer)
    ids = tiny_tokenizer(RLFH_RESPONSE, add_special_tokens=False)["input_ids"]
    out = reward(["What is Paris?"], [RLFH_RESPONSE], materials=[["Paris is the capital of France."]],
                 completion_ids=[ids], is_end=[True])
    # methods.md §2.4: two (Correct, '4') statements -> r_truth 0.45 each; r_info = 1.2 * ln(1 + 1 + 1) = 1.2 ln 3
    r_info = 1.2 * math.log(3)
    assert out.components["truth"][0] == pytest.approx(0.9)
    assert out.components["info"][0] == pytest.approx(r_info)
    assert out.scores[0] == pytest.approx(0.9 + r_info, abs=1e-5)
    tokens = out.token_rewards[0]
    assert len(tokens) == len(ids)
    # methods.md §2.4: each statement's reward sits at its last LCS-matched character in its sentence
    # ("e" of "France"; the "s" of "airports" for "Paris has two airports"); r_info at the sentence end
    from nemo_factuality.text.alignment import align_tokens

    align = align_tokens(tiny_tokenizer, RLFH_RESPONSE, ids)
    t_france = align.token_of_char(RLFH_RESPONSE.index("France") + len("France") - 1)
    t_airports = align.token_of_char(RLFH_RESPONSE.index("airports") + len("airports") - 1)
    expected = np.zeros(len(ids))
    expected[t_france] += 0.45
    expected[t_airports] += 0.45
    expected[-1] += r_info
    np.testing.assert_allclose(tokens, expected, atol=1e-5)
    assert out.scores[0] == pytest.approx(float(tokens.sum(dtype=np.float64)), abs=1e-9)


def test_rlfh_eos_penalty_clip_and_train_sh_maps(rlfh_server, tiny_tokenizer):
    reward = _rlfh(rlfh_server, tiny_tokenizer, reward_clip=(-10.0, 1.0))
    out = reward(["q"], [RLFH_RESPONSE], materials=[["x"]], is_end=[False])
    assert out.components["eos_penalty"][0] == -1.0
    assert out.token_rewards[0].max() <= 1.0  # clipped
    train_sh = _rlfh(rlfh_server, verif_map={"Correct": 0.3, "Hedged correct": 0.1, "Vague": -0.8, "Hedged wrong": -0.9,
                                             "Wrong": -1.2}, info_map={"5": 1.3, "4": 1.2, "3": 1.1, "2": 1.0, "1": -0.1})
    s = train_sh(["q"], [RLFH_RESPONSE], materials=[["x"]]).scores[0]
    assert s == pytest.approx(2 * 0.3 * 1.2 + 1.2 * math.log(2.4 + 1))


def test_rlfh_drops_refusal_sentences(rlfh_server):
    out = _rlfh(rlfh_server)(["q"], ["I'm sorry, I don't have any information about that."], materials=[["x"]])
    assert out.scores[0] == 0.0  # the only sentence is filtered: no statement rewards, no sentence reward


# ----------------------------------------------------------------------------------------- FSPO
def _fspo_pipe(kb):
    return build_pipeline({"extractor": {"name": "identity", "segments": ["think"]}, "evidence": {"name": "given"},
                           "verifier": {"name": "kb_exact", "store_path": kb}, "abstain_detection": None})


def test_fspo_answer_f1_format_and_helpers():
    assert token_f1("the Eiffel Tower", "Eiffel tower") == 1.0
    assert token_f1("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("yes", "no") == 0.0 and token_f1("no", "no") == 1.0
    assert format_ok("step.</think><answer>x</answer>", prompt_opens_think=True)
    assert not format_ok("<think>a</think><answer>x</answer><answer>y</answer>", prompt_opens_think=True)
    assert not format_ok("<answer>x</answer></think>", prompt_opens_think=True)


@pytest.mark.parametrize("outside", [1, 0])
def test_fspo_signs_and_scores(kb, tiny_tokenizer, outside):
    reward = FSPOReward(_fspo_pipe(kb), FSPOConfig(outside_mask=outside), tiny_tokenizer)
    good = "Ada Varga was born in 1917. Ada Varga grew up in Lyon.</think><answer>Ostrava</answer>"
    math_sample = "2 plus 2 is 4.</think><answer>4</answer>"
    broken = "no tags here"
    out = reward(["q"] * 3, [good, math_sample, broken], ground_truth=["Ostrava", "4", "x"], knowledge=["kb", None, "kb"])
    assert out.scores.tolist() == [1.0, 1.0, 0.0]
    assert out.components["format"].tolist() == [0.0, 0.0, -2.0]
    assert out.components["reasoning"][0] == 0.0  # mean(+1, -1)
    from nemo_factuality.text.alignment import align_tokens

    al = align_tokens(tiny_tokenizer, good)
    signs = out.token_signs[0]
    s1_end = good.index("1917.") + 4
    s2_start = good.index("Ada Varga grew")
    assert signs[al.token_of_char(0)] == 1 and signs[al.token_of_char(s1_end)] == 1
    assert signs[al.token_of_char(s2_start + 3)] == -1 and signs[al.token_of_char(good.index("Lyon"))] == -1
    assert signs[al.token_of_char(good.index("Ostrava"))] == outside  # answer tokens: outside_mask
    assert not out.token_signs[1].any() and not out.token_signs[2].any()  # math and format failure: all 0


def test_fspo_paper_fact_weight(kb):
    reward = FSPOReward(_fspo_pipe(kb), FSPOConfig(fact_weight=1.0))
    wrong_steps = "Ada Varga was born in 1950. Ada Varga grew up in Lyon.</think><answer>Ostrava</answer>"
    out = reward(["q"], [wrong_steps], ground_truth=["Ostrava"], knowledge=["kb"])
    assert out.scores[0] == pytest.approx(1.0 - 1.0)  # answer F1 1 + mean(-1, -1)


# --------------------------------------------------------------------------------------- KnowRL
@pytest.mark.parametrize("r_correct,refusal,r_fact,gated,additive", [
    (2.0, False, 0.5, 2.0, 2.5), (1.0, True, 0.5, 1.0, 1.5), (-1.0, False, 0.5, -0.5, -0.5), (-1.0, False, 0.0, -1.0, -1.0),
])
def test_knowrl_combination_truth_table(r_correct, refusal, r_fact, gated, additive):
    assert combine(r_correct, refusal, r_fact, "gated") == gated
    assert combine(r_correct, refusal, r_fact, "additive") == additive


def test_knowrl_end_to_end(kb):
    assert format_reward("reasoning</think><answer>x</answer>") == 1.0
    assert format_reward("<think></think><answer>x</answer>") == -1.0
    pipe = build_pipeline({"verifier": {"name": "kb_exact", "store_path": kb}, "abstain_detection": None})
    with ScriptedOpenAIServer(by_substring={"Predicted answer: 1917": "A", "Predicted answer: 1930": "B",
                                            "Predicted answer: I don't know": "C", "Predicted answer: ???": "zzz"}) as srv:
        grader = AnswerGrader(OpenAIJudgeClient(srv.url, "judge"))
        think = "Ada Varga was born in 1917. Ada Varga grew up in Ostrava."
        comps = [f"{think}</think><answer>1917</answer>", f"{think}</think><answer>1930</answer>",
                 "Not sure.</think><answer>I don't know</answer>", "no answer tags", f"{think}</think><answer>???</answer>"]
        for mode in ("gated", "additive"):
            reward = KnowRLReward(pipe, grader, KnowRLConfig(combine=mode))
            out = reward(["When was Ada Varga born?"] * 5, comps, ground_truth=["1917"] * 5, topic=["Ada Varga"] * 5)
            fact = math.exp(1 - 10 / 2)  # 2/2 supported, gamma 10 length penalty
            assert out.components["fact"][0] == pytest.approx(fact)
            assert out.components["correct"].tolist()[:4] == [2.0, -1.0, 1.0, -1.0]
            # an unreadable grade is a failure, not the released code's silent 0
            assert math.isnan(out.components["correct"][4]) and math.isnan(out.scores[4])
            assert "answer grading failed" in out.details[4]["error"] and "zzz" in out.details[4]["error"]
            if mode == "gated":
                assert out.scores[1] == pytest.approx(1.0 + (-1.0 + fact))
            else:
                assert out.scores[0] == pytest.approx(1.0 + 2.0 + fact)
            assert out.scores[3] == pytest.approx(-1.0 + -1.0)  # format -1, no answer -1
        assert reward.stats()["grade_failures"] >= 1


# ----------------------------------------------------------------------------------------- KLCF
def test_klcf_dual_fact_arithmetic(kb_pipeline):
    with ScriptedOpenAIServer(by_substring={"Fact: Ada Varga was born in 1917.": "Covered", "Fact: Ada Varga grew up": "Not covered"},
                              default="???") as srv:
        reward = KLCFReward(kb_pipeline, CoverageJudge(OpenAIJudgeClient(srv.url, "judge")),
                            KLCFConfig(w_checklist=2.0, w_truthfulness=1.0, w_rm=0.5), general_rm=lambda p, c: [0.0] * len(c))
        resp = "Ada Varga was born in 1917. Ada Varga was born in 1920."
        out = reward(["Tell me about Ada Varga."] * 2, [resp, "Lev Novak worked as a chemist."],
                     checklist=[["Ada Varga was born in 1917.", "Ada Varga grew up in Ostrava."], []])
    # sample 0: recall 1/2, precision 1/2 (one of two claims), rm sigmoid(0) = 0.5
    assert out.components["checklist_recall"][0] == 0.5 and out.components["truthfulness_precision"][0] == 0.5
    assert out.scores[0] == pytest.approx(2.0 * 0.5 + 1.0 * 0.5 + 0.5 * 0.5)
    # sample 1: no checklist -> recall skipped (NaN component); precision 1
    assert math.isnan(out.components["checklist_recall"][1]) and out.scores[1] == pytest.approx(1.0 + 0.25)


# ------------------------------------------------------------------------------------ FactAlign
def test_factalign_labels(kb_pipeline):
    lab = FactAlignLabeler(kb_pipeline, FactAlignConfig(k=2, t=0.75))
    good = "Ada Varga was born in 1917. Ada Varga grew up in Ostrava."
    mixed = "Ada Varga was born in 1917. Lev Novak was born in 1917."
    out = lab(["q", "q"], [good, mixed])
    # good: S=2, NS=0, K=2 -> P=1, R=1, F1=1 > 0.75; mixed: S=1, NS=1 -> P=.5, R=.5, F1=.5
    assert out.components["label"].tolist() == [1.0, 0.0]
    assert out.scores.tolist() == [1.0, 0.5]
    assert out.sentence_labels == [[True, True], [True, False]]
    assert [s.slice(mixed) for s in out.sentence_spans[1]] == ["Ada Varga was born in 1917.", "Lev Novak was born in 1917."]


def test_factalign_repetition_filter(kb_pipeline):
    assert max_ngram_repeats("a b c a b c a b c", 3) == 3
    lab = FactAlignLabeler(kb_pipeline, FactAlignConfig(k=1, rep_ngram=3, max_response_repeats=1, max_sentence_repeats=5))
    rep = "Ada Varga was born in 1917. Ada Varga was born in 1917."
    out = lab(["q"], [rep])
    assert out.components["label"][0] == 0.0  # the 3-gram "ada varga was" repeats twice > 1
    # the duplicate claim was dropped (dedup guard), but the repeated sentence is still a negative label
    assert out.sentence_labels[0] == [True, False]
