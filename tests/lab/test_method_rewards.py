"""The five methods' rewards on the lab world (lab/method_rewards.py), against hand-computed values.

Three bios about one person are scored by every method: ``true`` (all six slots right), ``mixed`` (a wrong
birth year, the right home town, ``unknown`` occupation) and ``abstain`` (only ``unknown`` occupation).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from nemo_factuality.lab import world as W
from nemo_factuality.lab.method_rewards import KBCoverageJudge, check_reward_options
from nemo_factuality.lab.policy import train_tokenizer
from nemo_factuality.lab.worlds import get_world
from nemo_factuality.registry import RegistryError, build_reward
from nemo_factuality.types import FactualityInputError

CFG = W.WorldConfig(n_people=(4, 6, 10), bios_per_person=(5, 2, 1), seed=3)


@pytest.fixture(scope="module")
def bios(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab_methods")
    people = W.make_people(CFG)
    bios = W.make_bios(people, CFG)
    kb = W.build_world_kb(W.write_world(out / "world", people, bios, W.split_people(people, (1, 1, 2), (1, 2, 3), 3)),
                          out / "kb.sqlite")
    train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios], out / "tok")
    p = people[0]
    wrong = "1900" if p.facts["born_year"] != "1900" else "1901"
    texts = {"true": " ".join(W.sentence(p.name, a, v) for a, v in p.facts.items()),
             "mixed": " ".join([W.sentence(p.name, "born_year", wrong), W.sentence(p.name, "hometown", p.facts["hometown"]),
                                W.sentence(p.name, "occupation", W.ABSTAIN_VALUE)]),
             "abstain": W.sentence(p.name, "occupation", W.ABSTAIN_VALUE), "blank": ""}
    checklist = [W.sentence(p.name, "hometown", p.facts["hometown"]), W.sentence(p.name, "born_year", p.facts["born_year"])]
    columns = {"ground_truth": [p.facts] * 4, "topic": [p.name] * 4, "checklist": [checklist] * 4}
    return str(kb), str(out / "tok"), p, texts, columns


def score(bios, spec):
    kb, tok, p, texts, columns = bios
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    completions = list(texts.values())
    ids = [t(c, add_special_tokens=False)["input_ids"] for c in completions]
    reward = build_reward({**spec, "store_path": kb}, tok)
    return reward([W.prompt_for(p.name)] * 4, completions, completion_ids=ids, is_end=[True] * 4, **columns), ids


def test_klcf_checklist_recall_plus_truthfulness(bios):
    out, _ = score(bios, {"name": "lab_klcf"})
    # true: 2/2 checklist items + 6/6 true claims; mixed: home town covered (the year is wrong) + 1 of 2 claims
    # true (the abstention is no claim); abstain: nothing covered, no claims -> 0 (KLCF: silence is not precision 1)
    assert list(out.scores[:3]) == pytest.approx([2.0, 1.0, 0.0])
    assert list(out.components["n_claims"][:3]) == [6, 2, 0]
    assert math.isnan(out.scores[3])  # blank: abstained, not scored


@pytest.mark.parametrize("setting, scores, abstain_sign", [
    ({"fact_weight": 0.0, "outside_mask": 1, "step_labels": "binary"}, [1.0, 0.25, 0.0], -1),
    ({"fact_weight": 1.0, "outside_mask": 0, "step_labels": "three_way"}, [2.0, 0.25, 0.0], 0),
])
def test_fspo_answer_f1_and_step_signs(bios, setting, scores, abstain_sign):
    out, ids = score(bios, {"name": "lab_fspo", **setting})
    # answer = token F1 of the stated values vs the six gold values: mixed states 2 values, 1 right ->
    # P 1/2, R 1/6, F1 1/4; the paper setting adds the mean step score (mixed: (-1 + 1 + 0) / 3 = 0)
    assert list(out.scores[:3]) == pytest.approx(scores)
    signs = out.token_signs[1]
    assert len(signs) == len(ids[1])
    # word-level tokens: each word, and the final "." apart: 7 per sentence here
    n1, n2 = (len(W.sentence("A B", attr, "v").split()) + 1 for attr in ("born_year", "hometown"))
    assert set(signs[:n1]) == {-1}  # the wrong sentence, every token (FSPO signs whole steps)
    assert set(signs[n1 : n1 + n2]) == {1}
    assert set(signs[n1 + n2 :]) == {abstain_sign}  # binary: unsupported; three-way: neutral


def test_knowrl_format_correctness_and_facts(bios):
    out, _ = score(bios, {"name": "lab_knowrl"})
    # true: format +1, every slot CORRECT (+2), FActScore 1 with 6 claims (no penalty at gamma 6) -> 4
    # mixed: +1, slots (-1 wrong, +2, +1 unknown, -1 x3 unanswered)/6 = -1/6, fact 0.5 * exp(1 - 6/2)
    # abstain: +1, (1 - 5)/6, no claims -> fact 0
    assert list(out.scores[:3]) == pytest.approx([4.0, 1 - 1 / 6 + 0.5 * math.exp(-2), 1 - 4 / 6])
    gated, _ = score(bios, {"name": "lab_knowrl", "combine": "gated"})
    assert list(gated.scores[:3]) == pytest.approx([3.0, 1 - 1 / 6, 1 - 4 / 6])  # r_correct alone unless every slot is wrong


def test_knowrl_format_fails_on_a_repeated_slot_or_a_cut_response(bios):
    kb, tok, p, _, columns = bios
    reward = build_reward({"name": "lab_knowrl", "store_path": kb}, tok)
    twice = " ".join([W.sentence(p.name, "hometown", p.facts["hometown"])] * 2)
    one = W.sentence(p.name, "hometown", p.facts["hometown"])
    out = reward([W.prompt_for(p.name)] * 3, [twice, one, one], is_end=[True, True, False],
                 ground_truth=columns["ground_truth"][:3], topic=columns["topic"][:3])
    assert list(out.components["format"]) == [-1.0, 1.0, -1.0]


def test_rlfh_dense_rewards_on_each_sentence_end(bios):
    out, ids = score(bios, {"name": "lab_rlfh"})
    correct = 0.45 * 1.0 + 1.2 * math.log(1.0 + 1)  # Correct at informativeness 4, plus r_info of a 1-statement sentence
    wrong = -1.7 * 1.0 + 1.2 * math.log(1.0 + 1)
    assert out.scores[1] == pytest.approx(correct + wrong, abs=1e-5)
    assert out.scores[0] == pytest.approx(6 * correct, abs=1e-5)
    assert out.scores[2] == pytest.approx(0.0)  # the abstention sentence has no statement: default 0
    dense = out.token_rewards[1]
    nonzero = np.flatnonzero(dense)
    assert len(nonzero) == 2 and dense[nonzero[0]] == pytest.approx(wrong, abs=1e-5)
    assert float(dense.sum()) == pytest.approx(out.scores[1], abs=1e-5)


def test_factalign_labels_at_k6(bios):
    out, _ = score(bios, {"name": "lab_factalign"})
    assert list(out.scores[:3]) == pytest.approx([1.0, 0.25, 0.0])  # f1@6
    assert list(out.components["label"][:3]) == [1.0, 0.0, 0.0]  # f1@6 > 0.75
    assert out.sentence_labels[1] == [False, True]  # the abstention sentence has no fact: no label


def test_coverage_judge_and_abstention_sentences():
    judge = KBCoverageJudge()
    said = "Ab Cd was born in 1931. Ab Cd spoke Rul."
    assert judge.check_batch([said, said], ["Ab Cd spoke Rul.", "Ab Cd was born in 1932."]) == [(True, None), (False, None)]
    is_abstention = get_world("synthetic").is_abstention
    assert is_abstention("Ab Cd spoke unknown.") and not is_abstention("Ab Cd spoke Rul.")
    assert W.parse_sentence("Ab Cd worked as a unknown.") == ("Ab Cd", "occupation", "unknown")
    assert W.parse_sentence("Ab Cd was") is None


def test_reward_options_are_checked_without_a_store():
    check_reward_options({"name": "lab_fspo", "fact_weight": 1.0, "step_labels": "three_way"})
    with pytest.raises(FactualityInputError, match="step_labels"):
        check_reward_options({"name": "lab_fspo", "step_labels": "four_way"})
    with pytest.raises(RegistryError, match="gamma"):
        check_reward_options({"name": "lab_klcf", "gamma": 3})
    with pytest.raises(RegistryError, match="bogus"):
        check_reward_options({"name": "lab_slots", "bogus": 1})
