"""The lab's world, knowledge store and slot reward, checked through the real pipeline (kb_exact)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nemo_factuality.lab import world as W
from nemo_factuality.lab.policy import train_tokenizer
from nemo_factuality.lab.reward import LabRewardConfig, build_lab_reward
from nemo_factuality.registry import REWARDS
from nemo_factuality.types import FactualityInputError

CFG = W.WorldConfig(n_people=(4, 6, 10), bios_per_person=(5, 2, 1), seed=3)


@pytest.fixture(scope="module")
def lab_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab_world")
    people = W.make_people(CFG)
    bios = W.make_bios(people, CFG)
    splits = W.split_people(people, (1, 1, 2), (1, 2, 3), seed=3)
    paths = W.write_world(out / "world", people, bios, splits)
    kb = W.build_world_kb(paths, out / "kb.sqlite")
    tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios], out / "tok")
    return people, bios, splits, kb, tok


def test_world_is_seeded_skewed_and_split(lab_world):
    people, bios, splits, _, _ = lab_world
    assert [p.name for p in W.make_people(CFG)] == [p.name for p in people]
    assert W.make_bios(people, CFG) == bios
    assert len(bios) == 4 * 5 + 6 * 2 + 10 * 1
    assert len({p.name for p in people}) == len(people)
    sets = [set(splits.rl), set(splits.val), set(splits.heldout)]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert set.union(*sets) == {p.name for p in people}
    assert len(splits.heldout) == 6 and len(splits.val) == 4
    # Every bio is the full row of slots in order, each a value or the abstention sentence.
    for b in bios:
        sentences = b["response"].split(". ")
        assert len(sentences) == len(W.ATTRIBUTES)
        assert all(s.startswith(b["name"]) for s in sentences)


def test_tokenizer_round_trips_bios(lab_world):
    _, bios, _, _, tok = lab_world
    for b in bios[:10]:
        ids = tok(b["response"], add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == b["response"]
        assert tok.unk_token_id not in ids
    assert tok(b["prompt"])["input_ids"][0] == tok.bos_token_id


def test_slot_reward_through_kb_exact(lab_world):
    people, _, _, kb, tok = lab_world
    reward = REWARDS.build({"name": "lab_slots", "store_path": str(kb), "tokenizer": tok, "wrong_penalty": 2.0})
    p, q = people[0], people[1]
    wrong_year = str(int(p.facts["born_year"]) + 1) if p.facts["born_year"] != "1949" else "1900"
    true_bio = " ".join(W.sentence(p.name, a, v) for a, v in p.facts.items())
    mixed = " ".join([W.sentence(p.name, "born_year", wrong_year), W.sentence(p.name, "hometown", p.facts["hometown"]),
                      W.sentence(p.name, "occupation", W.ABSTAIN_VALUE)])
    other = W.sentence(p.name, "hometown", q.facts["hometown"]) if q.facts["hometown"] != p.facts["hometown"] else "Nonsense here."
    completions = [true_bio, mixed, other, ""]
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
    out = reward([W.prompt_for(p.name)] * 4, completions, completion_ids=ids)
    assert out.scores[0] == pytest.approx(6 / 6)
    assert out.scores[1] == pytest.approx((1 - 2.0) / 6)  # one true, one wrong, one abstention (0)
    assert out.scores[2] == pytest.approx(-2.0 / 6)
    assert out.scores[3] == 0.0 and out.components["claims"][3] == 0
    assert list(out.components["abstained"][:2]) == [0, 1]
    assert math.isnan(out.components["precision"][3])
    # Signs sit on each sentence's value token: -1 on the wrong year, +1 on the true town, 0 elsewhere
    # (the name and template words, the abstention).
    signs = out.token_signs[1]
    assert len(signs) == len(ids[1])
    periods = [j for j, t in enumerate(ids[1]) if t == tok.convert_tokens_to_ids(".")]
    assert signs[periods[0] - 1] == -1 and signs[periods[1] - 1] == 1
    assert list(signs).count(-1) == 1 and list(signs).count(1) == 1
    # Dense: each sentence's slot reward on its value token.
    dense = out.token_rewards[1]
    assert dense[periods[0] - 1] == pytest.approx(-2.0 / 6) and dense.sum() == pytest.approx((1 - 2.0) / 6)
    whole = build_lab_reward(str(kb), tokenizer=tok, wrong_penalty=2.0, sign_scope="sentence")
    signs = whole([W.prompt_for(p.name)], [mixed], completion_ids=[ids[1]]).token_signs[0]
    assert set(signs[: periods[0] + 1]) == {-1} and signs[-1] == 0


def test_precision_mode_and_bad_config(lab_world):
    people, _, _, kb, _ = lab_world
    p = people[0]
    reward = build_lab_reward(str(kb), mode="precision")
    text = W.sentence(p.name, "hometown", p.facts["hometown"]) + " " + W.sentence(p.name, "born_year", W.ABSTAIN_VALUE)
    out = reward(["q", "q"], [text, W.sentence(p.name, "born_year", W.ABSTAIN_VALUE)])
    assert list(out.scores) == [1.0, 0.0]  # an all-abstention response earns nothing under precision-only
    assert out.token_signs is None  # no tokenizer: no token outputs
    with pytest.raises(FactualityInputError, match="mode"):
        LabRewardConfig(mode="recall")
    with pytest.raises(FactualityInputError, match="completions"):
        reward(["q"], ["a", "b"])
    assert np.isfinite(out.scores).all()
