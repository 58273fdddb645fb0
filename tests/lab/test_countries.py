"""The countries world (``lab/countries.py``): its facts, the reader and verifier with aliases, abstentions, tiers and
splits, the decode-time threshold and the sentence confidences; expectations from countryinfo's own data and by hand."""

import math

import pytest

from nemo_factuality.lab import countries as C
from nemo_factuality.lab import world as W
from nemo_factuality.lab.readings import is_correct
from nemo_factuality.lab.worlds import abstain_response, get_world
from nemo_factuality.types import Label


@pytest.fixture(scope="module")
def by_name():
    return {c.name: c for c in C.make_countries()}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, by_name):
    from nemo_factuality.knowledge.store import build_store

    names = ["France", "Ukraine", "Ivory Coast", "Bhutan", "Tuvalu", "Syria", "Peru", "Brazil", "Japan", "Mexico"]
    countries = [by_name[n] for n in names]
    out = tmp_path_factory.mktemp("countries")
    paths = C.write_world(out / "world", countries, W.Splits(names, [], []))
    return C.CountryVerifier(str(build_store(paths["passages"], out / "kb.sqlite", facts_jsonl=paths["facts"],
                                             progress=False, threads=1)))


def test_facts_come_from_countryinfo_with_codes_named(by_name):
    # countryinfo: France capital Paris, region Europe / Western Europe, languages ["fr"], currencies ["EUR"]
    assert by_name["France"].facts == {"capital": ["Paris"], "region": ["Europe", "Western Europe"],
                                       "languages": ["French"], "currency": ["Euro"]}
    # Bhutan: ["dz"] → Dzongkha, ["BTN", "INR"] → Ngultrum, Indian Rupee; Switzerland's fund codes (CHE, CHW) left out
    assert by_name["Bhutan"].facts["languages"] == ["Dzongkha"]
    assert by_name["Bhutan"].facts["currency"] == ["Ngultrum", "Indian Rupee"]
    assert by_name["Switzerland"].facts["currency"] == ["Swiss Franc"]
    assert C.EXAMPLE not in by_name  # the prompt's worked example is in no split


@pytest.mark.parametrize("country,sentence,label", [
    ("Ukraine", "The capital of Ukraine is Kiev.", Label.SUPPORTED),  # another spelling
    ("Ukraine", "The capital of Ukraine is Kyiv.", Label.SUPPORTED),
    ("Ivory Coast", "The currency of Côte d'Ivoire is the West African CFA franc.", Label.SUPPORTED),  # accents, long name
    ("Ivory Coast", "Ivory Coast is in West Africa.", Label.SUPPORTED),  # Western Africa as people say it
    ("Ivory Coast", "The currency of Ivory Coast is the euro.", Label.NOT_SUPPORTED),  # another country's currency
    ("France", "The currency of France is the euro.", Label.SUPPORTED),
    ("France", "France pays in EUR, its currency.", Label.SUPPORTED),  # the ISO 4217 code
    ("France", "People in France speak French.", Label.SUPPORTED),  # the language code fr, named
    ("Bhutan", "The capital of Bhutan is Lumbe.", Label.NOT_SUPPORTED),  # invented: no known capital
    ("Bhutan", "The official language of Bhutan is Tibetan.", Label.NOT_SUPPORTED),
    ("Bhutan", "The currency of Bhutan is the Bhutanese kyrangam.", Label.NOT_SUPPORTED),
    ("Brazil", "The capital of Brazil is Rio de Janeiro.", Label.NOT_SUPPORTED),
    ("Tuvalu", "The currency of Tuvalu is the New Zealand dollar.", Label.NOT_SUPPORTED),
    ("Tuvalu", "The currency of Tuvalu is the Australian dollar.", Label.SUPPORTED),
    ("Tuvalu", "The currency of Tuvalu is the dollar.", Label.SUPPORTED),  # ambiguous, one meaning is Tuvalu's
    ("Peru", "The currency of Peru is the peso.", Label.NOT_SUPPORTED),  # ambiguous, no meaning is Peru's
    ("Syria", "Syria is a sovereign state in North Africa.", Label.NOT_SUPPORTED),
    ("Syria", "Syria is in the Middle East.", Label.SUPPORTED),
    ("Mexico", "Mexico is in North America.", Label.SUPPORTED),
    ("Japan", "It is located in Eastern Asia.", Label.SUPPORTED),  # a pronoun: the country asked about
    ("Japan", "Japan is famous for sushi.", Label.NOT_ENOUGH_INFO),  # none of the four attributes
    ("Japan", "I don't know the currency of Japan.", Label.IRRELEVANT),  # an abstention asserts nothing
    ("Japan", "I'm not sure about its capital.", Label.IRRELEVANT),
])
def test_verifier_aliases_and_abstentions(verifier, country, sentence, label):
    got, why = verifier.judge(sentence, country)
    assert got is label, (sentence, why)


def test_verifier_reads_the_country_from_the_prompt_and_names_the_fact(verifier):
    from nemo_factuality.interfaces import VerifyItem
    from nemo_factuality.types import Claim

    item = VerifyItem(Claim(0, "Its capital is Paris."), (), C.prompt_for("France"), "Its capital is Paris.", None)
    (verdict,) = verifier.verify_batch([item])
    assert verdict.label is Label.SUPPORTED and verdict.evidence == ("capital of France: Paris",)


def test_abstention_detection_through_the_world():
    world = get_world("countries")
    assert world.is_abstention("I don't know the currency of Tuvalu.")
    assert world.is_abstention(C.abstain_sentence("Tuvalu", "languages"))
    assert C.abstain_sentence("Tuvalu", "languages") == "I don't know the language of Tuvalu."
    assert not world.is_abstention("The currency of Tuvalu is the Australian dollar.")
    assert not world.is_abstention("Tuvalu is famous.")


def test_readings_against_the_gold_column(by_name):
    gold = C.gold_column(by_name["Switzerland"])
    assert gold["languages"] == "German|French|Italian"
    assert is_correct(C.read("People in Switzerland speak German and French."), gold["languages"])
    assert not is_correct(C.read("People in Switzerland speak German and Dutch."), gold["languages"])  # one is wrong


def test_tiers_are_population_terciles(by_name):
    tiers = {t: [c for c in by_name.values() if c.tier == t] for t in C.TIERS}
    assert by_name["China"].tier == "popular" and by_name["India"].tier == "popular" and by_name["Tuvalu"].tier == "rare"
    assert min(c.population for c in tiers["popular"]) > max(c.population for c in tiers["medium"])
    assert min(c.population for c in tiers["medium"]) > max(c.population for c in tiers["rare"])
    assert abs(len(tiers["popular"]) - len(tiers["rare"])) <= 2


def test_splits_fixed_by_the_seed_and_disjoint():
    countries = C.make_countries()
    a, b = (W.split_people(countries, (6, 6, 6), (12, 12, 12), seed=3) for _ in range(2))
    c = W.split_people(countries, (6, 6, 6), (12, 12, 12), seed=4)
    assert a == b and a.heldout != c.heldout
    assert len(a.heldout) == 36 and len(a.val) == 18 and len(a.rl) == len(countries) - 54
    assert not (set(a.heldout) & set(a.val) or set(a.heldout) & set(a.rl) or set(a.val) & set(a.rl))
    tiers = {x.name: x.tier for x in countries}
    assert [sum(tiers[n] == t for n in a.heldout) for t in C.TIERS] == [12, 12, 12]


def test_prompt_and_chat():
    assert C.entity_of(C.prompt_for("Côte d'Ivoire")) == "Côte d'Ivoire" and C.entity_of("Tell me a bio of X. Bio:") is None
    chat = C.messages_for("Laos")
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user"] and chat[-1]["content"] == C.prompt_for("Laos")


def test_threshold_declines_low_confidence_sentences():
    world = get_world("countries")
    text = "The capital of Laos is Laoistan. Laos is in South-eastern Asia. Laos is lovely."
    # confidences per sentence: the invented capital and the unreadable last sentence fall below 0.5
    out = abstain_response(world, text, "Laos", [0.3, 0.9, 0.2], 0.5)
    assert out == "I don't know the capital of Laos. Laos is in South-eastern Asia."


def test_sentence_confidences_by_hand():
    from nemo_factuality.lab.real_policy import sentence_confidences

    text = "Ab cd. Ef."
    # tokens "Ab", " cd", ".", " Ef", "." end at 2, 5, 6, 9, 10; the first sentence holds the first three
    ends, lps = [2, 5, 6, 9, 10], [-0.1, -0.2, -0.3, -1.0, -2.0]
    got = sentence_confidences(text, ends, lps)
    assert got == pytest.approx([math.exp(-0.2), math.exp(-1.5)], abs=1e-12)


def test_method_rewards_read_country_answers(by_name):
    from nemo_factuality.lab.method_rewards import KBCoverageJudge, slot_grades

    world = get_world("countries")
    gold = C.gold_column(by_name["France"])
    answer = ("The capital of France is Paris. It is in Western Europe. I don't know the currency of France. "
              "The official language of France is German.")
    grades, well_formed = slot_grades(world, answer, "France", gold)
    assert grades == {"capital": "CORRECT", "region": "CORRECT", "languages": "INCORRECT", "currency": "NOT_ATTEMPTED"}
    assert well_formed
    # a second capital sentence, or a sentence about none of the attributes, is not a well-formed profile
    assert not slot_grades(world, "The capital of France is Paris. Its capital is Lyon.", "France", gold)[1]
    assert not slot_grades(world, "France is lovely.", "France", gold)[1]
    judge = KBCoverageJudge(world)
    items = ["The capital of France is Paris.", "France is in Western Europe.", "The currency of France is the euro."]
    # covered: the same fact in other words; not covered: an abstention, or the attribute with another value
    said = [judge.check_batch(["Paris is the capital of France. I don't know the currency of France."], [item])[0][0]
            for item in items]
    assert said == [True, False, False]
