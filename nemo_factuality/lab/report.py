"""The lab report: ``report.json`` (schema below), ``report.md`` and plots, over one or more seeds.

``report.json``::

    {"world": "synthetic" | "countries", "seeds": [0, ...],
     "methods": {NAME: {"title", "stage",
                        "heldout":    {"before": BLOCK, "after": BLOCK,                 # T=1: base, trained
                                       "before_greedy": BLOCK, "after_greedy": BLOCK,   # greedy: base, trained
                                       "base_at_t_eff": BLOCK},                         # the base at the trained T_eff
                        "rl_prompts": {"before": BLOCK, "after": BLOCK},                # T=1, entities trained on
                        "validation": {"before", "after", "before_greedy", "after_greedy"},   # model selection's entities
                        "effective_temperature": float,
                        "gain": {"t1": M, "greedy": M, "rl_prompts_t1": M, "over_base_at_t_eff": M},   # FActScore points
                        "sd": {"heldout": {...}, "rl_prompts": {...}},                  # sd over seeds of every BLOCK value
                        "factscore_per_seed": {"after" | "after_greedy": [...]},
                        "per_person": {"after" | "after_greedy": [per seed: PEOPLE]},   # what the margins pair
                        "training": [per seed: steps, best_step, val rewards, policy_samples_budget, timings]}},
     "references": {"t1": BLOCK, "greedy": BLOCK, "tuned_temperature": BLOCK, "tuned_threshold": BLOCK,  # base, held-out
                    "greedy_threshold": BLOCK,                        # greedy with the threshold tuned at greedy
                    "sd": {...}, "validation": {KEY: scores at the pick, on validation entities},
                    "factscore_per_seed": {KEY: [...]}, "per_person": {KEY: [per seed: PEOPLE]},
                    "tuning": [per seed: the validation sweeps and picks]},
     "summary": {"headline": [the first sentences of report.md], "world", "seeds", "development_seed",
                 "heldout_entities": [per seed: how many] | None, "interval": {"method", "resamples", "level"},
                 "against_base": {"t1" | "greedy": {NAME: M}},            # each method vs the base, same decoding
                 "t1" | "greedy": {"best_method", "best_reference" (both picked on validation FActScore), their
                                   validation and held-out FActScore, "margin": M, "beaten_by",
                                   "against_threshold": {NAME: M}},      # each method vs the thresholded base
                 "aim_met", "tuned_temperature_factscore"},
     "timings": {...}, "config": {...}}

    BLOCK = {"factscore" (0-1, gamma=0), "factscore_gamma10", "safe_f1" (SAFE F1@K, K = the world's slots: 6 | 4),
             "precision", "claims_per_response", "hallucinated_per_response",
             "abstain_rate", "respond_ratio", "n_responses", "per_tier": {tier: ...}}   (means over seeds)
    PEOPLE = {entity: {"score_sum", "responding"}}   (``evaluate.per_person_scores``; also in each seed's
             report.json, as the held-out and RL-prompt blocks' "per_person")
    M = {"mean", "sd" (over seeds; None for one), "per_seed" (FActScore points, paired by seed),
         "interval": [low, high] | None, "verdict": "beats" | "falls behind" | "within noise"}

Every margin has an interval: the 95% percentile interval of a paired bootstrap over the held-out entities
(``lab/bootstrap.py``: 2000 resamples, a fixed seed). It "beats" when the whole interval is above 0, "falls
behind" when it is below, and is "within noise" otherwise; so one seed can decide a margin. The interval is the
held-out entities' sampling noise only; the sd over seeds (several seeds) is reported beside it, not used for the
verdict. The words (people or countries, the development seed's story) are the world's (``lab/worlds.py``).
Results without per-person scores (from before they were kept) give no interval: "within noise".
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation.report import to_json_safe
from nemo_factuality.lab.bootstrap import LEVEL, RESAMPLES, margin_interval, verdict
from nemo_factuality.lab.methods import METHODS
from nemo_factuality.lab.world import TIERS
from nemo_factuality.lab.worlds import DEVELOPMENT_SEED, LabWorld, get_world

REFERENCES = {"t1": "base, T=1", "greedy": "base, greedy", "tuned_temperature": "base, tuned temperature",
              "tuned_threshold": "base, T=1 + tuned threshold", "greedy_threshold": "base, greedy + tuned threshold"}
GREEDY_REFERENCES = ("greedy", "greedy_threshold")
# Each decoding: its label, the methods' held-out block, the references decoded the same way (the thresholded
# one last). The tuned temperature is not among them: it changes the decoding it is compared at.
DECODINGS = (("t1", "T=1", "after", ("t1", "tuned_threshold")),
             ("greedy", "greedy", "after_greedy", ("greedy", "greedy_threshold")))
PER_PERSON = "per_person"


# ---------------------------------------------------------------------------------------------- aggregation
def _mean_sd(blocks: Sequence[Any]) -> tuple[Any, Any]:
    """Mean and sd over seeds of every number in same-shaped nested dicts (None where a seed has no value)."""
    first = blocks[0]
    if isinstance(first, dict):
        pairs = {k: _mean_sd([b.get(k) for b in blocks]) for k in first}
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}
    values = [float(b) for b in blocks if isinstance(b, (int, float)) and b == b]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _num(x: float | None) -> float:
    """A score, NaN where there is none (no response responded: FActScore is undefined, stored as null)."""
    return float("nan") if x is None else float(x)


def _rank(x: float | None) -> float:
    """Picking the best on validation: a score that does not exist never wins."""
    return -float("inf") if x is None or x != x else float(x)


def _scores_only(tree: Any) -> Any:
    """``tree`` without its per-person tables: they are paired by the margins, never averaged over seeds (each
    seed holds out different people)."""
    if isinstance(tree, dict):
        return {k: _scores_only(v) for k, v in tree.items() if k != PER_PERSON}
    return tree


def margin(after: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """FActScore points of ``after`` over ``before``: one block (its ``factscore`` and, when kept, ``per_person``)
    per seed on each side, paired by seed and, for the interval, by held-out person. The verdict comes from the
    interval; the sd over seeds is reported beside it."""
    per_seed = [100 * (_num(a["factscore"]) - _num(b["factscore"])) for a, b in zip(after, before, strict=True)]
    interval = margin_interval([a.get(PER_PERSON) for a in after], [b.get(PER_PERSON) for b in before])
    return {"mean": statistics.fmean(per_seed), "sd": statistics.stdev(per_seed) if len(per_seed) > 1 else None,
            "per_seed": per_seed, "interval": None if interval is None else list(interval), "verdict": verdict(interval)}


def _seed_blocks(part: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """``{"factscore", "per_person"}`` per seed for ``key`` of a method or of the references: ``margin``'s input."""
    scores = part["factscore_per_seed"][key]
    people = part.get(PER_PERSON, {}).get(key) or [None] * len(scores)
    return [{"factscore": f, PER_PERSON: p} for f, p in zip(scores, people, strict=True)]


def method_seed_blocks(ctx: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """One seed's blocks of one method, in the report's shape."""
    base = ctx["base_blocks"]
    return {"heldout": {"before": base["heldout"]["t1"], "after": result["heldout"]["t1"],
                        "before_greedy": base["heldout"]["greedy"], "after_greedy": result["heldout"]["greedy"],
                        "base_at_t_eff": result["heldout"]["base_at_t_eff"]},
            "rl_prompts": {"before": base["rl_prompts"]["t1"], "after": result["rl_prompts"]["t1"]},
            "validation": {"before": base["validation"]["t1"], "after": result["validation"]["t1"],
                           "before_greedy": base["validation"]["greedy"], "after_greedy": result["validation"]["greedy"]},
            "effective_temperature": result["effective_temperature"]}


def aggregate(results: dict[int, dict[str, Any]], methods: Sequence[str], world: str = "synthetic") -> dict[str, Any]:
    seeds = sorted(results)
    out: dict[str, Any] = {"world": world, "seeds": seeds, "methods": {}}
    refs = [results[s]["context"]["base_blocks"]["heldout"] for s in seeds]
    tuning = [results[s]["context"]["tuning"] for s in seeds]
    mean, sd = _mean_sd([_scores_only(r) for r in refs])
    out["references"] = {**mean, "sd": sd, "validation": _mean_sd([t["validation"] for t in tuning])[0],
                         "factscore_per_seed": {k: [r[k]["factscore"] for r in refs] for k in refs[0]},
                         PER_PERSON: {k: [r[k].get(PER_PERSON) for r in refs] for k in refs[0]}, "tuning": tuning}
    for name in methods:
        per_seed = [method_seed_blocks(results[s]["context"], results[s]["methods"][name]) for s in seeds]
        mean, sd = _mean_sd([_scores_only(p) for p in per_seed])
        h = {when: [p["heldout"][when] for p in per_seed] for when in per_seed[0]["heldout"]}  # one block per seed
        rl = {when: [p["rl_prompts"][when] for p in per_seed] for when in ("before", "after")}
        out["methods"][name] = {
            "title": METHODS[name].title, "stage": METHODS[name].stage, **mean,
            "sd": {k: sd[k] for k in ("heldout", "rl_prompts", "validation", "effective_temperature")},
            "gain": {"t1": margin(h["after"], h["before"]), "greedy": margin(h["after_greedy"], h["before_greedy"]),
                     "rl_prompts_t1": margin(rl["after"], rl["before"]),
                     "over_base_at_t_eff": margin(h["after"], h["base_at_t_eff"])},
            "factscore_per_seed": {when: [x["factscore"] for x in h[when]] for when in ("after", "after_greedy")},
            PER_PERSON: {when: [x.get(PER_PERSON) for x in h[when]] for when in ("after", "after_greedy")},
            "training": [{k: v for k, v in results[s]["methods"][name]["training"].items() if k != "val"} for s in seeds],
        }
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What training beats and what it does not, at matched decoding (FActScore points, means over seeds).

    The best method and the best reference of each decoding are picked on the *validation* entities (their
    validation FActScore) and compared on held-out ones; picking them on held-out scores would compare the
    luckiest of each. ``headline`` holds the first sentences of ``report.md``."""
    refs, methods, world = report["references"], report["methods"], world_of(report)
    fs = lambda b: 100 * _num(b["factscore"])  # noqa: E731
    people = refs.get(PER_PERSON, {}).get("t1") or [None]
    out: dict[str, Any] = {"world": world.name, "seeds": report["seeds"],
                           "development_seed": DEVELOPMENT_SEED in report["seeds"],
                           "heldout_entities": None if None in people else [len(p) for p in people],
                           "interval": {"method": f"paired bootstrap over held-out {world.entities}",
                                        "resamples": RESAMPLES, "level": LEVEL},
                           "against_base": {}}
    for decoding, _, after, ref_keys in DECODINGS:
        out["against_base"][decoding] = {m: methods[m]["gain"][decoding] for m in methods}
        best = max(methods, key=lambda m: _rank(methods[m]["validation"][after]["factscore"]))
        ref = max(ref_keys, key=lambda k: _rank(refs["validation"][k]["factscore"]))
        over = {m: margin(_seed_blocks(methods[m], after), _seed_blocks(refs, ref)) for m in methods}
        sd = methods[best]["sd"]["heldout"][after]["factscore"]
        out[decoding] = {"best_method": best, "best_method_validation_factscore": fs(methods[best]["validation"][after]),
                         "best_method_factscore": fs(methods[best]["heldout"][after]),
                         "best_method_sd_points": None if sd is None else 100 * sd,
                         "best_reference": ref, "best_reference_validation_factscore": fs(refs["validation"][ref]),
                         "best_reference_factscore": fs(refs[ref]), "margin": over[best],
                         "beaten_by": [m for m in methods if over[m]["verdict"] == "beats"],
                         "against_threshold": {m: margin(_seed_blocks(methods[m], after), _seed_blocks(refs, ref_keys[-1]))
                                               for m in methods}}
    out["aim_met"] = all(out[d]["margin"]["verdict"] == "beats" for d, *_ in DECODINGS)
    out["tuned_temperature_factscore"] = fs(refs["tuned_temperature"])
    out["headline"] = headline_sentences(out)
    return out


def _points(m: dict[str, Any]) -> str:
    """``+9.1 ± 1.3 [+6.0, +12.2]``: the margin, its sd over seeds (several seeds) and its interval (when kept)."""
    interval = m.get("interval")
    return (f"{m['mean']:+.1f}" + (f" ± {m['sd']:.1f}" if m["sd"] is not None else "")
            + (f" [{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else ""))


def _by_verdict(margins: dict[str, dict[str, Any]]) -> str:
    """``yes for a (+9.1 [+6.0, +12.2]); within noise for b (+0.4 [-2.1, +3.0]); no, behind, for c (-5.3 [-8.0, -2.4])``."""
    words = {"beats": "yes for", "within noise": "within noise for", "falls behind": "no, behind, for"}
    parts = []
    for v, word in words.items():
        names = [f"{m} ({_points(x)})" for m, x in margins.items() if x["verdict"] == v]
        if names:
            parts.append(f"{word} {', '.join(names)}")
    return "; ".join(parts)


def world_of(report: dict[str, Any]) -> LabWorld:
    """The world a report is about (reports from before the countries world name none: the synthetic one)."""
    return get_world(report.get("world", "synthetic"))


def _possessive(noun: str) -> str:
    """``people`` → ``people's``, ``countries`` → ``countries'``."""
    return noun + ("'" if noun.endswith("s") else "'s")


def reading_sentence(s: dict[str, Any]) -> str:
    """The report's first sentence: what the margins' intervals measure, and what this many seeds cannot tell."""
    world = get_world(s.get("world", "synthetic"))
    seeds, n, ents = s["seeds"], s.get("heldout_entities"), world.entities
    label = "one seed" if len(seeds) == 1 else f"{len(seeds)} seeds"
    if n is None:
        return (f"**What {label} can tell:** these results carry no per-{world.entity} scores (they predate them), so no "
                f"margin has an interval over the held-out {ents} and every margin is within noise.")
    held = (f"the {n[0]}" if len(set(n)) == 1 else "the") + f" held-out {ents}" + ("" if len(seeds) == 1 else " of each seed")
    interval = (f"each margin comes with a {LEVEL:.0%} paired bootstrap interval [in brackets] over {held} ({RESAMPLES} "
                f"resamples of the {ents}, the same {ents} for the method and its baseline); it \"beats\" or \"falls "
                "behind\" only when its whole interval is above or below 0, else it is within noise")
    if len(seeds) == 1:
        return (f"**What one seed can tell:** {interval}. The interval measures the held-out {_possessive(ents)} sampling noise "
                f"(would the margin hold for other {ents} like these?), not the training run's: another seed (splits, "
                "initialisation, samples) can move a margin further, and only more seeds measure that (`--seeds 0,1,2`).")
    return (f"**What {label} can tell:** {interval}. The interval is the {_possessive(ents)} sampling noise only; the ± is the sd "
            "over seeds (how far another training run moves a margin), reported beside it but not part of the verdict: a "
            "margin no larger than its sd over seeds is unsettled whatever its verdict.")


def headline_sentences(s: dict[str, Any]) -> list[str]:
    """The report's first sentences: what the margins can tell, did training reduce hallucination against the base
    at the same decoding, did it beat the no-training references, and is the seed the development seed."""
    seeds = s["seeds"]
    against_base = " ".join(f"At {label}: {_by_verdict(s['against_base'][d])}." for d, label, *_ in DECODINGS)
    lines = [reading_sentence(s),
             f"**Did training reduce hallucination (raise held-out FActScore) against the base at the same decoding?** "
             f"{against_base}"]
    refs = []
    for d, label, *_ in DECODINGS:
        x = s[d]
        refs.append(f"at {label}, {x['best_method']} ({x['best_method_factscore']:.1f}) against "
                    f"{REFERENCES[x['best_reference']]} ({x['best_reference_factscore']:.1f}): {_points(x['margin'])} points, "
                    f"{x['margin']['verdict']}")
    aim = "met" if s["aim_met"] else "not met"
    lines.append(f"**Did it beat the no-training references?** The best method against the best reference, both picked "
                 f"on validation: {'; '.join(refs)}. The aim (beat it at both decodings, the interval above 0) is {aim}.")
    lines.append(development_sentence(get_world(s.get("world", "synthetic")), seeds))
    return lines


def development_sentence(world: LabWorld, seeds: Sequence[int]) -> str:
    """The headline's last sentence: whether the seeds include the world's development seed, in its words
    (``LabWorld.development`` follows a colon after the development seed, so its "its" is that seed's;
    ``LabWorld.other_seeds`` a colon after the other seeds)."""
    others = [x for x in seeds if x != DEVELOPMENT_SEED]
    rest = f"Seed{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}: {world.other_seeds}"
    if DEVELOPMENT_SEED in seeds:
        return (f"**Seed {DEVELOPMENT_SEED} is the development seed**, not a fresh test: {world.development}."
                + (f" {rest}." if others else ""))
    return f"{rest}, not the development seed ({DEVELOPMENT_SEED}), which is not a fresh test: {world.development}."


# ---------------------------------------------------------------------------------------------- markdown
def _pm(mean: float | None, sd: float | None, scale: float = 100.0, digits: int = 1) -> str:
    if mean is None:
        return "–"
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * sd:.{digits}f}" if sd is not None else "")


def _arrow(a: float | None, b: float | None) -> str:
    return f"{a:.3f} → {b:.3f}" if a is not None and b is not None else "–"


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the headline, held-out per policy, per tier, validation, training, time."""
    sections = (_headline, _heldout_table, _tier_table, _validation_table, _training_table, _footer)
    return "\n".join(line for section in sections for line in section(report))


def _headline(report: dict[str, Any]) -> list[str]:
    refs, s, seeds, world = report["references"], report["summary"], report["seeds"], world_of(report)
    lines = ["# Factuality lab: the methods on one world", ""]
    for sentence in s["headline"]:
        lines += [sentence, ""]
    lines += [f"Seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}" + (" (mean ± sd over seeds)" if len(seeds) > 1 else "") +
              f". Held-out: {round(refs['t1']['n_responses'] / report['config']['eval_samples'])} {world.entities} no method "
              f"trained on or was selected on, each policy scored once per decoding. FActScore (γ=0) and SAFE F1@{world.slots} "
              f"(K = a {world.entity}'s {world.slots} slots) in %; a margin's [low, high]: its {LEVEL:.0%} paired bootstrap "
              f"interval over the held-out {world.entities}.", ""]
    for d, label, *_ in DECODINGS:
        x = s[d]
        lines.append(f"* **{label}**: picked on validation, the method {x['best_method']} (validation "
                     f"{x['best_method_validation_factscore']:.1f}, held-out {x['best_method_factscore']:.1f}) and the reference "
                     f"{REFERENCES[x['best_reference']]} (validation {x['best_reference_validation_factscore']:.1f}, held-out "
                     f"{x['best_reference_factscore']:.1f}): {_points(x['margin'])} points, {x['margin']['verdict']}; methods "
                     f"whose interval over that reference is above 0: {', '.join(x['beaten_by']) or 'none'}.")
    lines.append("* **Against the base with the decode-time threshold at the same decoding** (τ tuned on validation at each): " +
                 " ".join(f"{REFERENCES[keys[-1]]}: {_by_verdict(s[d]['against_threshold'])}." for d, _, _, keys in DECODINGS))
    temps = ", ".join(f"{t['temperature']:g}" for t in refs["tuning"])
    return lines + [f"* The base at the temperature tuned on validation (T = {temps}) scores {s['tuned_temperature_factscore']:.1f}.", ""]


def _heldout_table(report: dict[str, Any]) -> list[str]:
    refs, methods = report["references"], report["methods"]
    lines = ["| policy | FActScore T=1 | Δ T=1 | FActScore greedy | Δ greedy | claims/resp | hallucinated/resp | abstain % | "
             f"SAFE F1@{world_of(report).slots} | T_eff | base at T_eff | Δ over it |", "|" + "---|" * 12]
    for key, label in REFERENCES.items():
        b, sd = refs[key], refs["sd"][key]
        fs = _pm(b["factscore"], sd["factscore"])
        t1, greedy = ("", fs) if key in GREEDY_REFERENCES else (fs, "")
        lines.append(f"| *{label}* | {t1} | | {greedy} | | {_pm(b['claims_per_response'], sd['claims_per_response'], 1, 2)} | "
                     f"{_pm(b.get('hallucinated_per_response'), sd.get('hallucinated_per_response'), 1, 2)} | "
                     f"{_pm(b['abstain_rate'], sd['abstain_rate'])} | {_pm(b['safe_f1'], sd['safe_f1'])} | | | |")
    for name, m in methods.items():
        h, sd, g = m["heldout"], m["sd"]["heldout"], m["gain"]
        after = {key: _pm(h["after"].get(key), sd["after"].get(key), *((1, 2) if "per_response" in key else ()))
                 for key in ("factscore", "claims_per_response", "hallucinated_per_response", "abstain_rate", "safe_f1")}
        lines.append(f"| **{name}** ({m['stage']}) | {after['factscore']} | {_points(g['t1'])} | "
                     f"{_pm(h['after_greedy']['factscore'], sd['after_greedy']['factscore'])} | {_points(g['greedy'])} | "
                     f"{after['claims_per_response']} | {after['hallucinated_per_response']} | {after['abstain_rate']} | {after['safe_f1']} | "
                     f"{_pm(m['effective_temperature'], m['sd']['effective_temperature'], 1, 2)} | "
                     f"{_pm(h['base_at_t_eff']['factscore'], sd['base_at_t_eff']['factscore'])} | {_points(g['over_base_at_t_eff'])} |")
    return lines


def _tier_table(report: dict[str, Any]) -> list[str]:
    refs = report["references"]
    lines = ["", "## Per popularity tier (held-out, T=1: FActScore % / claims per response / hallucinated claims per "
             "response / abstain %)", "",
             "| policy | " + " | ".join(TIERS) + " |", "|---" * (len(TIERS) + 1) + "|"]
    rows = [(f"*{REFERENCES['t1']}*", refs["t1"]), (f"*{REFERENCES['tuned_threshold']}*", refs["tuned_threshold"])]
    rows += [(f"**{name}**", m["heldout"]["after"]) for name, m in report["methods"].items()]
    for label, block in rows:
        cells = []
        for tier in TIERS:
            t = block["per_tier"].get(tier) or {}
            cells.append(f"{_pm(t.get('factscore'), None)} / {_pm(t.get('claims_per_response'), None, 1, 2)} / "
                         f"{_pm(t.get('hallucinated_per_response'), None, 1, 2)} / {_pm(t.get('abstain_rate'), None, 100, 0)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _validation_table(report: dict[str, Any]) -> list[str]:
    methods = report["methods"]
    lines = ["", "## Validation entities (what model selection and the design choices looked at)", "",
             "| policy | FActScore T=1 | FActScore greedy | claims/resp T=1 | abstain % T=1 |", "|---|---|---|---|---|"]
    base = next(iter(methods.values()))["validation"]
    lines.append(f"| *base* | {_pm(base['before']['factscore'], None)} | {_pm(base['before_greedy']['factscore'], None)} | "
                 f"{_pm(base['before']['claims_per_response'], None, 1, 2)} | {_pm(base['before']['abstain_rate'], None)} |")
    for name, m in methods.items():
        v, sd = m["validation"], m["sd"]["validation"]
        lines.append(f"| **{name}** | {_pm(v['after']['factscore'], sd['after']['factscore'])} | "
                     f"{_pm(v['after_greedy']['factscore'], sd['after_greedy']['factscore'])} | "
                     f"{_pm(v['after']['claims_per_response'], sd['after']['claims_per_response'], 1, 2)} | "
                     f"{_pm(v['after']['abstain_rate'], sd['after']['abstain_rate'])} |")
    return lines


def _training_table(report: dict[str, Any]) -> list[str]:
    lines = ["", "## Training (model selection on the validation entities only)", "",
             "| method | title | RL-prompt FActScore Δ (T=1) | steps run | best step | val reward base → best | policy samples | "
             "wall s | CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        tr = m["training"]
        wall = sum(t["wall_s"] for x in tr for t in x["timings"].values()) / len(tr)
        cpu = sum(t["cpu_s"] for x in tr for t in x["timings"].values()) / len(tr)
        lines.append(f"| {name} | {m['title']} | {_points(m['gain']['rl_prompts_t1'])} | {'/'.join(str(x['steps']) for x in tr)} | "
                     f"{'/'.join(str(x['best_step']) for x in tr)} | "
                     f"{' ; '.join(_arrow(x['val_reward_base'], x['val_reward_best']) for x in tr)} | "
                     f"{tr[0]['policy_samples_budget']} | {wall:.0f} | {cpu:.0f} |")
    return lines


def _footer(report: dict[str, Any]) -> list[str]:
    t, c, world = report["timings"]["total"], report["config"], world_of(report)
    ents = world.entities
    return ["", f"Whole run: {t['wall_s'] / 60:.1f} min wall, {t['cpu_s'] / 60:.1f} min CPU ({c['jobs']} worker process(es), "
            f"{c['threads']} torch thread(s) each; trainable: {c['trainable']}).", "",
            "Δ: FActScore points over the base at the same decoding. T_eff: the trained policy's effective temperature",
            "(its logits regressed on the base's, lab/decoding.py); \"base at T_eff\" samples the *base* at that temperature,",
            "so \"Δ over it\" is what training adds beyond a learned temperature. The tuned references were picked on the",
            f"validation entities by SAFE F1@{world.slots}; the best method and the best reference of each decoding by validation",
            f"FActScore. A margin's [low, high] is the {LEVEL:.0%} percentile interval of {RESAMPLES} paired bootstrap resamples",
            f"of the held-out {ents} (the same {ents} for both sides; each seed's own {ents}, the margins averaged over",
            "seeds; lab/bootstrap.py): \"beats\" when it is above 0, \"falls behind\" when below, else within noise. It is",
            f"the {_possessive(ents)} sampling noise, not the seed-to-seed spread (± sd, several seeds only). Abstention sentences",
            "are not claims. Each evaluation folder under `seed<N>/eval/` holds the `nemo-factuality eval` report it came",
            f"from and its `claims.jsonl`; each seed's `report.json` its per-{world.entity} FActScore terms.", ""]


def write_report(cfg: Any, results: dict[int, dict[str, Any]], out: Path, total: dict[str, float]) -> dict[str, Any]:
    from nemo_factuality.lab.plots import write_plots

    for seed, res in results.items():
        seed_report = {"seed": seed, "base": res["context"]["base_blocks"], "tuning": res["context"]["tuning"],
                       "methods": {n: {**method_seed_blocks(res["context"], r), "training": r["training"]}
                                   for n, r in res["methods"].items()},
                       "timings": res["context"]["timings"]}
        (Path(res["context"]["dir"]) / "report.json").write_text(json.dumps(to_json_safe(seed_report), indent=2), encoding="utf-8")
    report = aggregate(results, cfg.methods, cfg.world_name)
    report["summary"] = summary(report)
    timings: dict[str, Any] = {"total": total}
    for res in results.values():
        timings.update(res["context"]["timings"])
        for r in res["methods"].values():
            timings.update(r["training"]["timings"])
    report["timings"] = timings
    report["config"] = asdict(cfg)
    report = to_json_safe(report)
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    curves = {n: [results[s]["methods"][n]["training"]["val"] for s in sorted(results)] for n in cfg.methods}
    write_plots(report, curves, out / "plots")
    return report
