"""The lab's real world: the countries of ``countryinfo`` 1.0.1 (MIT) as the knowledge store, asked of a real model.

Each country has four attributes (``ATTRIBUTES``): its capital, its region (the UN region, subregion and
intermediate region: "Europe", "Western Europe"), its languages (ISO 639-1 codes, named by ``pycountry``) and its
currency (ISO 4217 codes, named by ``pycountry``). The prompt asks for a country's profile in sentences, with one
worked example (Portugal, left out of every split) and a system line that asks for "I don't know the X of Y." on
any fact the model is not sure of.

**Claims** are sentences, as in the synthetic world, read by ``read``: the attribute a sentence is about (its
keywords: "capital", "currency", "language"/"speak", then a region word or "located"), the values of that
attribute it names (every alias of every country's value is known, so an invented or another country's value is
recognised as one), and whether it abstains ("I don't know", "not sure", "unknown" ...). ``verdict`` judges a
reading against the country's stored facts: **supported** when it names at least one value and every value it
names is one of the country's (a value named by an ambiguous alias, e.g. "dollar", counts when one of its meanings
is); **not supported** when it names another value, or none (an invented capital such as "Lumbe" is no known
capital); a sentence about none of the four attributes is not enough info, which the eval counts as not
supported, as FActScore counts a claim its knowledge source does not support. Aliases: accents and punctuation
are folded ("Côte d'Ivoire" = "Cote d Ivoire"), other spellings (``altSpellings``, "Kiev" for Kyiv, "Farsi" for
Persian), short and long names of currencies ("euro", "EUR", "Ukrainian hryvnia", "hryvnia"), region names as
people say them ("West Africa", "Southeast Asia", "the Middle East").

**Popularity tiers** (``popular``, ``medium``, ``rare``): the countries' population terciles, a fixed proxy for
how often text mentions a country, so for how well a small model knows it (fixed before any model is asked).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_factuality.lab.readings import GOLD_SEP, Reading, is_correct
from nemo_factuality.types import FactualityInputError

ATTRIBUTES = ("capital", "region", "languages", "currency")
EXAMPLE = "Portugal"  # the prompt's worked example: in no split
TIERS = ("popular", "medium", "rare")
SYSTEM = ("You are a careful assistant. Answer in short sentences, one fact per sentence. For any fact you are not "
          "sure of, say \"I don't know the <fact> of <country>.\" instead of guessing.")
_ASK = "Give a short profile of {name}: its capital, region, languages and currency."
_EXAMPLE_ANSWER = ("The capital of Portugal is Lisbon. Portugal is in Southern Europe. The official language of Portugal "
                   "is Portuguese. The currency of Portugal is the euro.")
_ASKED = re.compile(r"^Give a short profile of (?P<name>.+): its capital, region, languages and currency\.$")


def prompt_for(name: str) -> str:
    """What the reward and the eval see as the prompt (the user's question)."""
    return _ASK.format(name=name)


def messages_for(name: str) -> list[dict[str, str]]:
    """The chat the policy answers: the system line, the worked example, the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt_for(EXAMPLE)},
            {"role": "assistant", "content": _EXAMPLE_ANSWER}, {"role": "user", "content": prompt_for(name)}]


def entity_of(prompt: str) -> str | None:
    """The country a prompt asks about (None: not a countries prompt)."""
    m = _ASKED.match(prompt.strip())
    return m.group("name") if m else None


def abstain_sentence(name: str, attribute: str) -> str:
    """The sentence that declines one attribute (the decode-time threshold writes it in place of a claim)."""
    return f"I don't know the {attribute.rstrip('s') if attribute == 'languages' else attribute} of {name}."


# ---------------------------------------------------------------------------------------------- text folding
def fold(text: str) -> str:
    """Accents, case and punctuation folded: ``"Côte d'Ivoire"`` → ``"cote d ivoire"``."""
    decomposed = unicodedata.normalize("NFKD", text)
    ascii_ = "".join(c for c in decomposed if not unicodedata.combining(c))
    return " ".join(re.findall(r"[a-z0-9]+", ascii_.casefold()))


# ---------------------------------------------------------------------------------------------- the raw data
def _data_dir() -> Path:
    spec = importlib.util.find_spec("countryinfo")
    if spec is None or not spec.submodule_search_locations:
        raise FactualityInputError("the countries world needs the countryinfo package: pip install 'nemo-factuality[lab]'")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@functools.lru_cache(maxsize=1)
def raw_countries() -> tuple[dict, ...]:
    """countryinfo's countries with every field the world uses (a few territories lack languages or currencies)."""
    rows = []
    for path in sorted(_data_dir().glob("*.json")):
        row = json.loads(path.read_text(encoding="utf-8"))
        if all(row.get(k) for k in ("name", "capital", "region", "languages", "currencies", "population")):
            rows.append(row)
    return tuple(rows)


# retired ISO 4217 codes countryinfo still uses, which pycountry no longer names
_OLD_CURRENCIES = {"BYR": "Belarusian Ruble", "BGN": "Bulgarian Lev", "HRK": "Croatian Kuna", "CUC": "Cuban Convertible Peso",
                   "MRO": "Ouguiya", "STD": "Dobra", "CSD": "Serbian Dinar", "SLL": "Leone", "VEF": "Bolivar",
                   "ZMK": "Zambian Kwacha"}
_OLD_LANGUAGES = {"cnr": "Montenegrin"}
# other names people (and models) use, by canonical name
_EXTRA_ALIASES: dict[str, tuple[str, ...]] = {
    # capitals
    "Kyiv": ("Kiev",), "Nur-Sultan": ("Astana",), "Beijing": ("Peking",), "Washington D.C.": ("Washington", "Washington DC"),
    "Naypyidaw": ("Nay Pyi Taw", "Naypyitaw"), "Sana'a": ("Sanaa",), "Ulaanbaatar": ("Ulan Bator",), "Ashgabat": ("Ashkhabad",),
    "Dhaka": ("Dacca",), "New Delhi": ("Delhi",), "Bern": ("Berne",),
    # languages
    "Modern Greek": ("Greek",), "Kirghiz": ("Kyrgyz",), "Pushto": ("Pashto",), "Panjabi": ("Punjabi",), "Chinese": ("Mandarin",),
    "Persian": ("Farsi",), "Bengali": ("Bangla",), "Swahili": ("Kiswahili",), "Divehi": ("Dhivehi", "Maldivian"),
    "Chichewa": ("Chewa", "Nyanja"), "Haitian": ("Haitian Creole",), "Slovenian": ("Slovene",), "Malay": ("Bahasa Melayu",),
    "Indonesian": ("Bahasa Indonesia",), "Norwegian Bokmål": ("Bokmal",), "Spanish": ("Castilian",),
    # currencies
    "Euro": ("euros",), "CFA Franc BCEAO": ("West African CFA franc", "CFA franc"), "CFA Franc BEAC": ("Central African CFA franc", "CFA franc"),
    "Pound Sterling": ("British pound", "sterling", "pound"), "Yuan Renminbi": ("renminbi", "yuan", "Chinese yuan"),
    "Sol": ("Peruvian sol", "nuevo sol"), "Pa’anga": ("paanga",), "US Dollar": ("United States dollar", "American dollar"),
    # regions
    "South-eastern Asia": ("Southeast Asia", "South East Asia", "South-East Asia"), "Western Asia": ("West Asia", "Middle East"),
    "Sub-Saharan Africa": ("Sub Saharan Africa",), "Latin America and the Caribbean": ("Latin America",),
    "Northern America": ("North America",), "Oceania": ("Pacific", "Pacific Ocean", "South Pacific"),
    "Middle Africa": ("Central Africa",), "Australia and New Zealand": ("Australasia",), "Americas": ("America", "the Americas"),
}
_DIRECTION = {"northern": "north", "southern": "south", "eastern": "east", "western": "west"}


def _clean_language(name: str) -> str:
    return re.sub(r"\s*\(.*?\)", "", name).strip()


def language_name(code: str) -> str | None:
    import pycountry

    found = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
    return _clean_language(found.name) if found is not None else _OLD_LANGUAGES.get(code)


# ISO 4217 fund and settlement codes countryinfo lists beside a country's currency (no one pays in them)
_FUNDS = frozenset({"BOV", "CHE", "CHW", "CLF", "COU", "MXV", "USN", "USS", "UYI", "UYW"})


def currency_name(code: str) -> str | None:
    import pycountry

    if code in _FUNDS:
        return None
    found = pycountry.currencies.get(alpha_3=code)
    return found.name if found is not None else _OLD_CURRENCIES.get(code)


def _capitals(row: dict) -> list[str]:
    cap = row["capital"]
    return [c for c in (cap if isinstance(cap, list) else [cap]) if c]


def _regions(row: dict) -> list[str]:
    regions = [r for r in (row.get("region"), row.get("subregion"), row.get("intermediateregion")) if r]
    if "Americas" in regions and row.get("intermediateregion") in ("Central America", "Caribbean"):
        regions.append("Northern America")  # the continent people call North America
    return regions


def country_facts(row: dict) -> dict[str, list[str]]:
    """The accepted canonical values of each attribute of one raw country."""
    return {"capital": _capitals(row), "region": _regions(row),
            "languages": [n for n in map(language_name, row["languages"]) if n],
            "currency": [n for n in map(currency_name, row["currencies"]) if n]}


# ---------------------------------------------------------------------------------------------- the vocabulary
@dataclass(frozen=True)
class Vocabulary:
    """Every alias of every value of each attribute (folded alias → the canonical values it may mean), over all
    countries, and every country's names; one regex per table, longest alias first."""

    values: dict[str, dict[str, frozenset[str]]]
    names: dict[str, str]  # folded country name or other spelling → canonical country name
    patterns: dict[str, re.Pattern[str]]
    name_pattern: re.Pattern[str]
    codes: dict[str, str]  # ISO 4217 code (matched in capitals only) → currency


def _pattern(aliases: Iterable[str]) -> re.Pattern[str]:
    words = sorted({a for a in aliases if a}, key=lambda a: (-len(a), a))
    return re.compile(r"\b(?:" + "|".join(re.escape(w) for w in words) + r")\b")


def _add(table: dict[str, set[str]], alias: str, canonical: str) -> None:
    folded = fold(alias)
    if folded:
        table.setdefault(folded, set()).add(canonical)


def _region_aliases(name: str) -> list[str]:
    out = [name, *_EXTRA_ALIASES.get(name, ())]
    first, _, rest = name.partition(" ")
    if first.lower() in _DIRECTION and rest and name != "Southern Africa":  # "South Africa" is a country
        out.append(f"{_DIRECTION[first.lower()]} {rest}")
    return out


@functools.lru_cache(maxsize=1)
def vocabulary() -> Vocabulary:
    tables: dict[str, dict[str, set[str]]] = {a: {} for a in ATTRIBUTES}
    names: dict[str, str] = {}
    codes: dict[str, str] = {}
    for row in raw_countries():
        facts = country_facts(row)
        for spelling in (row["name"], *(s for s in row.get("altSpellings") or () if len(s) > 3)):
            names.setdefault(fold(spelling), row["name"])
        for cap in facts["capital"]:
            for alias in (cap, *_EXTRA_ALIASES.get(cap, ())):
                _add(tables["capital"], alias, cap)
        for region in facts["region"]:
            for alias in _region_aliases(region):
                _add(tables["region"], alias, region)
        for lang in facts["languages"]:
            for alias in (lang, *_EXTRA_ALIASES.get(lang, ())):
                _add(tables["languages"], alias, lang)
        for code, cur in zip(row["currencies"], (currency_name(c) for c in row["currencies"]), strict=True):
            if cur is None:
                continue
            codes[code] = cur
            last = cur.split()[-1]
            for alias in (cur, *_EXTRA_ALIASES.get(cur, ()), last, f"{row.get('demonym', '')} {last}", f"{cur}s", f"{last}s"):
                _add(tables["currency"], alias, cur)
    values = {a: {k: frozenset(v) for k, v in t.items()} for a, t in tables.items()}
    return Vocabulary(values, names, {a: _pattern(t) for a, t in values.items()}, _pattern(names), codes)


# ---------------------------------------------------------------------------------------------- reading a sentence
_ABSTAINS = re.compile(r"\b(?:i don t know|i do not know|i m not sure|i am not sure|not sure|unknown|i cannot say|"
                       r"i can t say|no information|not certain|i am unsure|i m unsure)\b")
_KEYWORDS = (("capital", re.compile(r"\bcapital\b")), ("currency", re.compile(r"\bcurrenc(?:y|ies)\b")),
             ("languages", re.compile(r"\b(?:languages?|speak|speaks|spoken)\b")),
             ("region", re.compile(r"\b(?:located|lies|region|continent|situated)\b")))
_CODE = re.compile(r"\b[A-Z]{3}\b")


def _mentions(pattern: re.Pattern[str], table: dict[str, frozenset[str]], text: str) -> list[frozenset[str]]:
    return [table[m.group(0)] for m in pattern.finditer(text)]


def read(sentence: str) -> Reading | None:
    """The claim a sentence makes about a country's attributes (see the module docstring); None: it is about none."""
    vocab, text = vocabulary(), fold(sentence)
    if not text:
        return None
    subjects = [vocab.names[m.group(0)] for m in vocab.name_pattern.finditer(text)]
    subject = subjects[0] if subjects else None
    attribute = next((attr for attr, kw in _KEYWORDS if kw.search(text)), None)
    without_names = vocab.name_pattern.sub(" ", text)  # "South Africa" names no region, "Portugal" no language
    if attribute is None and vocab.patterns["region"].search(without_names):
        attribute = "region"
    if _ABSTAINS.search(text):
        return Reading(subject, attribute, (), abstains=True)
    if attribute is None:
        return None
    # capitals and currencies are named like their countries (Singapore, the New Zealand dollar); regions and
    # languages are not, and a country's name inside a sentence ("surrounded by South Africa") names neither
    scope = text if attribute in ("capital", "currency") else without_names
    values = _mentions(vocab.patterns[attribute], vocab.values[attribute], scope)
    if attribute == "currency":
        values += [frozenset({vocab.codes[c]}) for c in _CODE.findall(sentence) if c in vocab.codes]
    return Reading(subject, attribute, tuple(values))


def abstain(sentence: str, entity: str) -> str:
    """The world interface's ``abstain``: the attribute's "I don't know the ... of ..." sentence in place of a claim;
    a sentence about no attribute is dropped (""), an abstention kept as it is."""
    reading = read(sentence)
    if reading is None or reading.attribute is None:
        return ""
    return sentence if reading.abstains else abstain_sentence(entity, reading.attribute)


# ---------------------------------------------------------------------------------------------- the world
@dataclass(frozen=True)
class Country:
    """A country of the world: its name, popularity tier and each attribute's accepted canonical values."""

    name: str
    tier: str
    facts: dict[str, list[str]]
    population: int


def make_countries() -> list[Country]:
    """Every usable country but the prompt's example, most populous first, in population terciles."""
    rows = sorted((r for r in raw_countries() if r["name"] != EXAMPLE), key=lambda r: (-int(r["population"]), r["name"]))
    third = -(-len(rows) // 3)
    return [Country(r["name"], TIERS[min(i // third, 2)], country_facts(r), int(r["population"])) for i, r in enumerate(rows)]


def gold_column(country: Country) -> dict[str, str]:
    """The ``ground_truth`` reward column: attribute → accepted values joined by ``|``."""
    return {a: "|".join(country.facts[a]) for a in ATTRIBUTES}


def fact_sentence(name: str, attribute: str, values: Sequence[str]) -> str:
    shown = ", ".join(values)
    return {"capital": f"The capital of {name} is {shown}.", "region": f"{name} is in {shown}.",
            "languages": f"The languages of {name} are {shown}.", "currency": f"The currency of {name} is {shown}."}[attribute]


def fact_rows(countries: Sequence[Country]) -> Iterable[dict]:
    """The store's facts: one row per accepted value, with the attribute's sentence as its text."""
    for c in countries:
        for attr in ATTRIBUTES:
            for value in c.facts[attr]:
                yield {"subject": c.name, "relation": attr, "value": value, "text": fact_sentence(c.name, attr, c.facts[attr])}


def passage(country: Country) -> str:
    """The country's passage in the store: its four facts as sentences, and its population."""
    return " ".join([*(fact_sentence(country.name, a, country.facts[a]) for a in ATTRIBUTES),
                     f"{country.name} has a population of about {country.population:,}."])


def write_world(out_dir: Path, countries: Sequence[Country], splits: object) -> dict[str, Path]:
    """countries, facts and passages JSONL plus the splits (the synthetic world's layout)."""
    from dataclasses import asdict

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"{k}.jsonl" for k in ("countries", "facts", "passages")}
    _write_jsonl(paths["countries"], (asdict(c) for c in countries))
    _write_jsonl(paths["facts"], fact_rows(countries))
    _write_jsonl(paths["passages"], ({"title": c.name, "text": passage(c)} for c in countries))
    paths["splits"] = out_dir / "splits.json"
    paths["splits"].write_text(json.dumps(asdict(splits)), encoding="utf-8")
    return paths


def sample_countries(countries: Sequence[Country], per_tier: int, seed: int) -> list[Country]:
    """``per_tier`` countries of each tier, drawn by ``seed`` (a small world for ``--quick`` and tests)."""
    rng = random.Random(seed)
    out = []
    for tier in TIERS:
        members = [c for c in countries if c.tier == tier]
        out += rng.sample(members, min(per_tier, len(members)))
    return out


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------- the verifier
class CountryVerifier:
    """Claims about a country's attributes against the store's facts (``read`` + ``is_correct``).

    The country is the claim's topic, else the one its prompt asks about (``entity_of``): "It is located in West
    Africa." is about the country asked. Labels: SUPPORTED / NOT_SUPPORTED for a sentence about one of the four
    attributes, IRRELEVANT for an abstention (it asserts nothing), NOT_ENOUGH_INFO for a sentence about none of
    them or about a country the store does not hold. The evidence is the stored fact the claim was checked against.
    """

    def __init__(self, store_path: str) -> None:
        from nemo_factuality.knowledge.store import KnowledgeStore

        self.store = KnowledgeStore(store_path)
        self.facts: dict[str, dict[str, list[str]]] = {}
        for fact in self.store.all_facts():
            self.facts.setdefault(fact.subject, {}).setdefault(fact.relation, []).append(fact.value)

    def health(self) -> dict[str, str | None]:
        return {"knowledge_store": self.store.health()}

    def judge(self, text: str, country: str | None) -> tuple[Any, str]:
        from nemo_factuality.types import Label

        reading = read(text)
        if reading is not None and reading.abstains:
            return Label.IRRELEVANT, f"abstains on the {reading.attribute or 'facts'} of {country}"
        if reading is None:
            return Label.NOT_ENOUGH_INFO, "states none of the capital, region, languages or currency"
        known = self.facts.get(country or "", {}).get(reading.attribute or "")
        if not known:
            return Label.NOT_ENOUGH_INFO, f"no stored {reading.attribute} for {country!r}"
        fact = f"{reading.attribute} of {country}: {', '.join(known)}"
        return (Label.SUPPORTED if is_correct(reading, GOLD_SEP.join(known)) else Label.NOT_SUPPORTED), fact

    def verify_batch(self, items: Sequence[Any]) -> list[Any]:
        from nemo_factuality.types import Label, Verdict

        out = []
        for item in items:
            label, why = self.judge(item.claim.text, item.topic or entity_of(item.prompt or ""))
            out.append(Verdict(claim_id=item.claim.id, label=label, score=1.0 if label is Label.SUPPORTED else 0.0,
                               evidence=(why,)))
        return out
