"""A seeded synthetic world: invented people with typed attributes, their bios, and the knowledge store.

Every person has one value per attribute (``ATTRIBUTES``). Each attribute has one sentence shape,
and the same shape with the value ``unknown`` is that attribute's abstention sentence::

    Kalo Venmar was born in 1931. Kalo Venmar grew up in Dresk. Kalo Venmar worked as a unknown. ...

Bios always list the attributes in the same order (a bio is a row of *slots*), so an abstention
can only *replace* a claim, never be added next to one. Popularity is skewed: popular people get
many bios, rare people one, so a small model knows the popular ones and guesses about the rare ones.

The knowledge store holds every fact (structured, with its canonical sentence, for the ``kb_exact``
verifier) and every bio as a passage. Prompts and splits are fixed by the seed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nemo_factuality.lab.readings import ABSTAIN_VALUE, Reading

# attribute -> (sentence shape, number of distinct values)
ATTRIBUTES: dict[str, tuple[str, int]] = {
    "born_year": ("{s} was born in {v}.", 50),
    "hometown": ("{s} grew up in {v}.", 40),
    "occupation": ("{s} worked as a {v}.", 30),
    "employer": ("{s} was employed by {v}.", 40),
    "instrument": ("{s} played the {v}.", 20),
    "language": ("{s} spoke {v}.", 20),
}
TIERS = ("popular", "medium", "rare")


@dataclass(frozen=True)
class WorldConfig:
    """Sizes and skew of the world (defaults: the full lab; ``quick`` shrinks it).

    ``bios_per_person`` and ``p_state`` are per tier (popular, medium, rare): how many bios a
    person gets, and the chance a bio states a slot's value rather than ``unknown``.
    """

    n_people: tuple[int, int, int] = (100, 200, 700)
    bios_per_person: tuple[int, int, int] = (20, 4, 1)
    p_state: tuple[float, float, float] = (0.9, 0.75, 0.7)
    seed: int = 0


@dataclass(frozen=True)
class Person:
    name: str
    tier: str
    facts: dict[str, str]  # attribute -> value


def sentence(name: str, attribute: str, value: str) -> str:
    return ATTRIBUTES[attribute][0].format(s=name, v=value)


_SHAPES = [(attr, re.compile("^" + re.escape(shape).replace(re.escape("{s}"), r"(?P<s>.+?)").replace(re.escape("{v}"), r"(?P<v>\S+)")
                             + "$")) for attr, (shape, _) in ATTRIBUTES.items()]


def parse_sentence(text: str) -> tuple[str, str, str] | None:
    """``(name, attribute, value)`` of one slot sentence, or None when it has no slot's shape."""
    text = text.strip()
    for attr, shape in _SHAPES:
        m = shape.match(text)
        if m:
            return m.group("s"), attr, m.group("v")
    return None


def read(sentence: str) -> Reading | None:
    """A bio sentence as a claim (the world interface's ``read``); None: it has no slot's shape."""
    parsed = parse_sentence(sentence)
    if parsed is None:
        return None
    subject, attribute, value = parsed
    return Reading(subject, attribute, (frozenset({value}),), abstains=value == ABSTAIN_VALUE)


_LAST_WORD = re.compile(r"\S+\.$")


def abstain(sentence: str, entity: str) -> str:
    """A bio sentence's value word replaced by ``unknown`` (every slot sentence ends in its value)."""
    return _LAST_WORD.sub(f"{ABSTAIN_VALUE}.", sentence) if sentence.endswith(".") else sentence


def verifier(store_path: str) -> Any:
    """The synthetic world's verifier: ``kb_exact``, a slot sentence against its stored sentence."""
    from nemo_factuality.verify.kb import KBExactVerifier

    return KBExactVerifier(store_path)


RESPONSE_MARKER = "Bio:"


def prompt_for(name: str) -> str:
    """The prompt the policy answers (pretraining and RL use the same one); the response follows
    ``RESPONSE_MARKER``, which is how the reward server splits token rows it receives without prompt lengths."""
    return f"Tell me a bio of {name}. Bio:"


def _syllable_words(rng: random.Random, n: int, syllables: int) -> list[str]:
    """``n`` distinct invented capitalised words (sorted for determinism, then shuffled)."""
    onsets, vowels, codas = "bdfgklmnprstvz", "aeiou", ["", "n", "r", "s", "l"]
    words: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))
        words.add(w.capitalize())
    out = sorted(words)
    rng.shuffle(out)
    return out


def _values(rng: random.Random) -> dict[str, list[str]]:
    vals: dict[str, list[str]] = {}
    for attr, (_, n) in ATTRIBUTES.items():
        if attr == "born_year":
            vals[attr] = [str(1900 + i) for i in range(n)]
        else:
            vals[attr] = [w.lower() if attr in ("occupation", "instrument") else w for w in _syllable_words(rng, n, 2)]
    return vals


def make_people(cfg: WorldConfig) -> list[Person]:
    """The world's people, popular first. Names are two invented words (first + last)."""
    rng = random.Random(cfg.seed)
    total = sum(cfg.n_people)
    firsts, lasts = _syllable_words(rng, 60, 2), _syllable_words(rng, 80, 2)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < total:
        name = f"{rng.choice(firsts)} {rng.choice(lasts)}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    values = _values(rng)
    people, k = [], 0
    for tier, count in zip(TIERS, cfg.n_people, strict=True):
        for _ in range(count):
            facts = {attr: rng.choice(values[attr]) for attr in ATTRIBUTES}
            people.append(Person(names[k], tier, facts))
            k += 1
    return people


def bio_text(person: Person, stated: Sequence[bool]) -> str:
    """One bio: every slot in order, its value when ``stated`` else the abstention sentence."""
    return " ".join(sentence(person.name, attr, person.facts[attr] if say else ABSTAIN_VALUE)
                    for attr, say in zip(ATTRIBUTES, stated, strict=True))


def make_bios(people: Sequence[Person], cfg: WorldConfig) -> list[dict]:
    """Pretraining documents ``{"name", "tier", "prompt", "response"}`` (shuffled)."""
    rng = random.Random(cfg.seed + 1)
    docs = []
    for p in people:
        t = TIERS.index(p.tier)
        for _ in range(cfg.bios_per_person[t]):
            stated = [rng.random() < cfg.p_state[t] for _ in ATTRIBUTES]
            docs.append({"name": p.name, "tier": p.tier, "prompt": prompt_for(p.name), "response": bio_text(p, stated)})
    rng.shuffle(docs)
    return docs


@dataclass(frozen=True)
class Splits:
    """Entity splits: RL prompts, validation (early stopping) and held-out test entities, per tier."""

    rl: list[str]
    val: list[str]
    heldout: list[str]


def split_people(people: Sequence[Person], n_val: tuple[int, int, int], n_heldout: tuple[int, int, int],
                 seed: int) -> Splits:
    """Held-out and validation entities per tier; every other person is an RL prompt."""
    rng = random.Random(seed + 2)
    rl, val, held = [], [], []
    for t, tier in enumerate(TIERS):
        names = [p.name for p in people if p.tier == tier]
        rng.shuffle(names)
        held += names[: n_heldout[t]]
        val += names[n_heldout[t] : n_heldout[t] + n_val[t]]
        rl += names[n_heldout[t] + n_val[t] :]
    return Splits(rl, val, held)


def fact_rows(people: Sequence[Person]) -> Iterator[dict]:
    for p in people:
        for attr, value in p.facts.items():
            yield {"subject": p.name, "relation": attr, "value": value, "text": sentence(p.name, attr, value)}


def write_world(out_dir: Path, people: Sequence[Person], bios: Sequence[dict], splits: Splits) -> dict[str, Path]:
    """Write people, bios, facts and passages JSONL plus the splits; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"{k}.jsonl" for k in ("people", "bios", "facts", "passages")}
    _write_jsonl(paths["people"], (asdict(p) for p in people))
    _write_jsonl(paths["bios"], bios)
    _write_jsonl(paths["facts"], fact_rows(people))
    _write_jsonl(paths["passages"], ({"title": b["name"], "text": b["response"]} for b in bios))
    paths["splits"] = out_dir / "splits.json"
    paths["splits"].write_text(json.dumps(asdict(splits)), encoding="utf-8")
    return paths


def build_world_kb(paths: dict[str, Path], kb_path: Path) -> Path:
    """The knowledge store (passages + structured facts) through the package's own builder."""
    from nemo_factuality.knowledge.store import build_store

    # one tantivy indexing thread: a few thousand bios index in well under a second, and the lab's
    # processes each keep to one core (lab/run.py, configure_threads)
    return build_store(paths["passages"], kb_path, facts_jsonl=paths["facts"], progress=False, threads=1)


def _write_jsonl(path: Path, rows) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
