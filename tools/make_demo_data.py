"""Regenerate the packaged demo data (invented entities; deterministic): passages, facts, eval records."""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "nemo_factuality" / "data"
FIRST = ["Ada", "Boris", "Cleo", "Dario", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev"]
LAST = ["Varga", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Petrov", "Alves", "Novak", "Haddad", "Brandt"]
TOWNS = ["Ostrava", "Tampere", "Ghent", "Porto", "Kraków", "Lyon", "Bergen", "Graz"]
JOBS = ["astronomer", "violinist", "architect", "chemist", "novelist", "cartographer"]
RELATIONS = {
    "born_year": "{s} was born in {v}.",
    "birthplace": "{s} grew up in {v}.",
    "occupation": "{s} worked as a {v}.",
    "award_year": "{s} received the Halden Prize in {v}.",
}


def _wrong_value(rng: random.Random, rel: str, value: str) -> str:
    if rel in ("born_year", "award_year"):
        return str(int(value) + rng.choice([-7, 3, 11]))
    pool = TOWNS if rel == "birthplace" else JOBS
    return rng.choice([x for x in pool if x != value])


def main() -> None:
    rng = random.Random(7)
    people = [f"{first} {last}" for first, last in zip(FIRST, rng.sample(LAST * 2, len(FIRST)))]
    facts, passages, records = [], [], []
    for p in people:
        vals = {"born_year": str(rng.randint(1890, 1990)), "birthplace": rng.choice(TOWNS),
                "occupation": rng.choice(JOBS), "award_year": str(rng.randint(1950, 2020))}
        for rel, v in vals.items():
            facts.append({"subject": p, "relation": rel, "value": v, "text": RELATIONS[rel].format(s=p, v=v)})
        passages.append({"title": p, "text": " ".join(RELATIONS[r].format(s=p, v=v) for r, v in vals.items())})
        passages.append({"title": p, "text": f"{p} is remembered for careful work and for mentoring students."})
        for style in ("careful", "bold", "hedging"):
            sents = []
            for rel, v in vals.items():
                roll = rng.random()
                if style == "careful" and roll < 0.85 or style == "bold" and roll < 0.55 or style == "hedging" and roll < 0.6:
                    sents.append(RELATIONS[rel].format(s=p, v=v))
                elif style == "hedging" and roll < 0.9:
                    sents.append(RELATIONS[rel].format(s=p, v="unknown"))
                else:
                    wrong = _wrong_value(rng, rel, v)
                    sents.append(RELATIONS[rel].format(s=p, v=wrong))
            if style == "bold":
                sents.append(f"{p} also climbed Mount Halden twice.")  # unverifiable: not in the store
            response = " ".join(sents) if not (style == "hedging" and rng.random() < 0.2) else "I'm sorry, I don't know who that is."
            records.append({"id": f"{p.replace(' ', '_')}-{style}", "prompt": f"Tell me a bio of {p}.",
                            "response": response, "topic": p, "domain": style})
    for name, rows in (("demo_facts.jsonl", facts), ("demo_passages.jsonl", passages), ("demo_eval.jsonl", records)):
        with open(OUT / name, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(f"{len(facts)} facts, {len(passages)} passages, {len(records)} records")


if __name__ == "__main__":
    main()
