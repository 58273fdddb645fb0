"""The lab report: ``report.json`` (schema below), ``report.md`` and plots, over one or more seeds.

``report.json``::

    {"seeds": [0, ...],
     "methods": {NAME: {"title", "stage",
                        "heldout":    {"before": BLOCK, "after": BLOCK,                 # T=1: base, trained
                                       "before_greedy": BLOCK, "after_greedy": BLOCK,   # greedy: base, trained
                                       "base_at_t_eff": BLOCK},                         # the base at the trained T_eff
                        "rl_prompts": {"before": BLOCK, "after": BLOCK},                # T=1, entities trained on
                        "validation": {"before", "after", "before_greedy", "after_greedy"},   # model selection's entities
                        "effective_temperature": float,
                        "gain": {"t1": G, "greedy": G, "rl_prompts_t1": G, "over_base_at_t_eff": G},   # FActScore points
                        "sd": {"heldout": {...}, "rl_prompts": {...}},                  # sd over seeds of every BLOCK value
                        "training": [per seed: steps, best_step, val rewards, policy_samples_budget, timings]}},
     "references": {"t1": BLOCK, "greedy": BLOCK, "tuned_temperature": BLOCK, "tuned_threshold": BLOCK,  # base, held-out
                    "greedy_threshold": BLOCK,                        # greedy with the threshold tuned at greedy
                    "sd": {...}, "validation": {KEY: scores at the pick, on validation entities},
                    "factscore_per_seed": {KEY: [...]}, "tuning": [per seed: the validation sweeps and picks]},
     "summary": {"headline": [the first sentences of report.md], "seeds", "development_seed",
                 "against_base": {"t1" | "greedy": {NAME: M}},            # each method vs the base, same decoding
                 "t1" | "greedy": {"best_method", "best_reference" (both picked on validation FActScore), their
                                   validation and held-out FActScore, "margin": M, "beaten_by",
                                   "against_threshold": {NAME: M}},      # each method vs the thresholded base
                 "aim_met", "tuned_temperature_factscore"},
     "timings": {...}, "config": {...}}

    BLOCK = {"factscore" (0-1, gamma=0), "factscore_gamma10", "safe_f1@6", "precision", "claims_per_response",
             "abstain_rate", "respond_ratio", "n_responses", "per_tier": {tier: ...}}   (means over seeds)
    G = {"mean", "sd", "per_seed"}
    M = {"mean", "sd", "per_seed" (FActScore points, paired by seed), "verdict": "beats" | "falls behind" | "within noise"}

A margin is "within noise" unless it is larger than its sd over seeds; with one seed there is no spread to
judge it by, so every margin is within noise.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation.report import to_json_safe
from nemo_factuality.lab.methods import METHODS
from nemo_factuality.lab.world import TIERS

REFERENCES = {"t1": "base, T=1", "greedy": "base, greedy", "tuned_temperature": "base, tuned temperature",
              "tuned_threshold": "base, T=1 + tuned threshold", "greedy_threshold": "base, greedy + tuned threshold"}
GREEDY_REFERENCES = ("greedy", "greedy_threshold")
# Each decoding: its label, the methods' held-out block, the references decoded the same way (the thresholded
# one last). The tuned temperature is not among them: it changes the decoding it is compared at.
DECODINGS = (("t1", "T=1", "after", ("t1", "tuned_threshold")),
             ("greedy", "greedy", "after_greedy", ("greedy", "greedy_threshold")))
DEVELOPMENT_SEED = 0  # its held-out numbers were looked at while the lab was designed (docs/lab.md)


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


def _gain(pairs: Sequence[tuple[dict, dict]]) -> dict[str, Any]:
    per_seed = [100 * (a["factscore"] - b["factscore"]) for b, a in pairs]
    return {"mean": statistics.fmean(per_seed), "sd": statistics.stdev(per_seed) if len(per_seed) > 1 else None,
            "per_seed": per_seed}


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


def aggregate(results: dict[int, dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    seeds = sorted(results)
    out: dict[str, Any] = {"seeds": seeds, "methods": {}}
    refs = [results[s]["context"]["base_blocks"]["heldout"] for s in seeds]
    tuning = [results[s]["context"]["tuning"] for s in seeds]
    mean, sd = _mean_sd(refs)
    out["references"] = {**mean, "sd": sd, "validation": _mean_sd([t["validation"] for t in tuning])[0],
                         "factscore_per_seed": {k: [r[k]["factscore"] for r in refs] for k in refs[0]}, "tuning": tuning}
    for name in methods:
        per_seed = [method_seed_blocks(results[s]["context"], results[s]["methods"][name]) for s in seeds]
        mean, sd = _mean_sd(per_seed)
        h = [p["heldout"] for p in per_seed]
        out["methods"][name] = {
            "title": METHODS[name].title, "stage": METHODS[name].stage, **mean,
            "sd": {k: sd[k] for k in ("heldout", "rl_prompts", "validation", "effective_temperature")},
            "gain": {"t1": _gain([(x["before"], x["after"]) for x in h]),
                     "greedy": _gain([(x["before_greedy"], x["after_greedy"]) for x in h]),
                     "rl_prompts_t1": _gain([(p["rl_prompts"]["before"], p["rl_prompts"]["after"]) for p in per_seed]),
                     "over_base_at_t_eff": _gain([(x["base_at_t_eff"], x["after"]) for x in h])},
            "factscore_per_seed": {when: [x[when]["factscore"] for x in h] for when in ("after", "after_greedy")},
            "training": [{k: v for k, v in results[s]["methods"][name]["training"].items() if k != "val"} for s in seeds],
        }
    return out


def verdict(mean: float, sd: float | None) -> str:
    """"beats" or "falls behind" only when the margin is larger than its sd over seeds; one seed has no sd."""
    if sd is None or abs(mean) <= sd:
        return "within noise"
    return "beats" if mean > 0 else "falls behind"


def _margin(after: Sequence[float], before: Sequence[float]) -> dict[str, Any]:
    """FActScore points of ``after`` over ``before``, paired by seed, with the verdict."""
    per_seed = [100 * (a - b) for a, b in zip(after, before, strict=True)]
    sd = statistics.stdev(per_seed) if len(per_seed) > 1 else None
    mean = statistics.fmean(per_seed)
    return {"mean": mean, "sd": sd, "per_seed": per_seed, "verdict": verdict(mean, sd)}


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What training beats and what it does not, at matched decoding (FActScore points, means over seeds).

    The best method and the best reference of each decoding are picked on the *validation* entities (their
    validation FActScore) and compared on held-out ones; picking them on held-out scores would compare the
    luckiest of each. ``headline`` holds the first sentences of ``report.md``."""
    refs, methods = report["references"], report["methods"]
    fs = lambda b: 100 * b["factscore"]  # noqa: E731
    out: dict[str, Any] = {"seeds": report["seeds"], "development_seed": DEVELOPMENT_SEED in report["seeds"],
                           "against_base": {}}
    for decoding, _, after, ref_keys in DECODINGS:
        gain = {m: methods[m]["gain"][decoding] for m in methods}
        out["against_base"][decoding] = {m: {**g, "verdict": verdict(g["mean"], g["sd"])} for m, g in gain.items()}
        best = max(methods, key=lambda m: methods[m]["validation"][after]["factscore"])
        ref = max(ref_keys, key=lambda k: refs["validation"][k]["factscore"])
        over = {m: _margin(methods[m]["factscore_per_seed"][after], refs["factscore_per_seed"][ref]) for m in methods}
        sd = methods[best]["sd"]["heldout"][after]["factscore"]
        out[decoding] = {"best_method": best, "best_method_validation_factscore": fs(methods[best]["validation"][after]),
                         "best_method_factscore": fs(methods[best]["heldout"][after]),
                         "best_method_sd_points": None if sd is None else 100 * sd,
                         "best_reference": ref, "best_reference_validation_factscore": fs(refs["validation"][ref]),
                         "best_reference_factscore": fs(refs[ref]), "margin": over[best],
                         "beaten_by": [m for m in methods if over[m]["verdict"] == "beats"],
                         "against_threshold": {m: _margin(methods[m]["factscore_per_seed"][after],
                                                          refs["factscore_per_seed"][ref_keys[-1]]) for m in methods}}
    out["aim_met"] = all(out[d]["margin"]["verdict"] == "beats" for d, *_ in DECODINGS)
    out["tuned_temperature_factscore"] = fs(refs["tuned_temperature"])
    out["headline"] = headline_sentences(out)
    return out


def _points(m: dict[str, Any]) -> str:
    return f"{m['mean']:+.1f}" + (f" ± {m['sd']:.1f}" if m["sd"] is not None else "")


def _by_verdict(margins: dict[str, dict[str, Any]]) -> str:
    """``yes for a (+9.1 ± 1.3); within noise for b (+0.4 ± 2.0); no, behind, for c (−5.3 ± 2.2)``."""
    words = {"beats": "yes for", "within noise": "within noise for", "falls behind": "no, behind, for"}
    parts = []
    for v, word in words.items():
        names = [f"{m} ({_points(x)})" for m, x in margins.items() if x["verdict"] == v]
        if names:
            parts.append(f"{word} {', '.join(names)}")
    return "; ".join(parts)


def headline_sentences(s: dict[str, Any]) -> list[str]:
    """The report's first sentences: did training reduce hallucination against the base at the same decoding, did
    it beat the no-training references, and is the seed the development seed."""
    seeds = s["seeds"]
    one_seed = " (one seed: no spread over seeds, so every margin is within noise)" if len(seeds) == 1 else ""
    against_base = " ".join(f"At {label}: {_by_verdict(s['against_base'][d])}." for d, label, *_ in DECODINGS)
    lines = [f"**Did training reduce hallucination (raise held-out FActScore) against the base at the same decoding?**"
             f"{one_seed} {against_base}"]
    refs = []
    for d, label, *_ in DECODINGS:
        x = s[d]
        refs.append(f"at {label}, {x['best_method']} ({x['best_method_factscore']:.1f}) against "
                    f"{REFERENCES[x['best_reference']]} ({x['best_reference_factscore']:.1f}): {_points(x['margin'])} points, "
                    f"{x['margin']['verdict']}")
    aim = "met" if s["aim_met"] else "not met"
    lines.append(f"**Did it beat the no-training references?** The best method against the best reference, both picked "
                 f"on validation: {'; '.join(refs)}. The aim (beat it at both decodings by more than the spread) is {aim}.")
    if s["development_seed"]:
        lines.append(f"**Seed {DEVELOPMENT_SEED} is the development seed**: its held-out numbers were looked at while the "
                     "lab was designed, so they are not a fresh test" + (" (the other seeds are)." if len(seeds) > 1 else "."))
    else:
        lines.append(f"Seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}: fresh, not the development seed "
                     f"({DEVELOPMENT_SEED}), whose held-out numbers were looked at while the lab was designed.")
    return lines


# ---------------------------------------------------------------------------------------------- markdown
def _pm(mean: float | None, sd: float | None, scale: float = 100.0, digits: int = 1) -> str:
    if mean is None:
        return "–"
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * sd:.{digits}f}" if sd is not None else "")


def _signed(g: dict[str, Any]) -> str:
    return f"{g['mean']:+.1f}" + (f" ± {g['sd']:.1f}" if g["sd"] is not None else "")


def _arrow(a: float | None, b: float | None) -> str:
    return f"{a:.3f} → {b:.3f}" if a is not None and b is not None else "–"


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the headline, held-out per policy, per tier, validation, training, time."""
    sections = (_headline, _heldout_table, _tier_table, _validation_table, _training_table, _footer)
    return "\n".join(line for section in sections for line in section(report))


def _headline(report: dict[str, Any]) -> list[str]:
    refs, s, seeds = report["references"], report["summary"], report["seeds"]
    lines = ["# Factuality lab: the methods on one world", ""]
    for sentence in s["headline"]:
        lines += [sentence, ""]
    lines += [f"Seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}" + (" (mean ± sd over seeds)" if len(seeds) > 1 else "") +
              f". Held-out: {round(refs['t1']['n_responses'] / report['config']['eval_samples'])} people no method trained on "
              "or was selected on, each policy scored once per decoding. FActScore (γ=0) and SAFE F1@6 in %.", ""]
    for d, label, *_ in DECODINGS:
        x = s[d]
        lines.append(f"* **{label}**: picked on validation, the method {x['best_method']} (validation "
                     f"{x['best_method_validation_factscore']:.1f}, held-out {x['best_method_factscore']:.1f}) and the reference "
                     f"{REFERENCES[x['best_reference']]} (validation {x['best_reference_validation_factscore']:.1f}, held-out "
                     f"{x['best_reference_factscore']:.1f}): {_points(x['margin'])} points, {x['margin']['verdict']}; methods "
                     f"beyond the spread above that reference: {', '.join(x['beaten_by']) or 'none'}.")
    lines.append("* **Against the base with the decode-time threshold at the same decoding** (τ tuned on validation at each): " +
                 " ".join(f"{REFERENCES[keys[-1]]}: {_by_verdict(s[d]['against_threshold'])}." for d, _, _, keys in DECODINGS))
    temps = ", ".join(f"{t['temperature']:g}" for t in refs["tuning"])
    return lines + [f"* The base at the temperature tuned on validation (T = {temps}) scores {s['tuned_temperature_factscore']:.1f}.", ""]


def _heldout_table(report: dict[str, Any]) -> list[str]:
    refs, methods = report["references"], report["methods"]
    lines = ["| policy | FActScore T=1 | Δ T=1 | FActScore greedy | Δ greedy | claims/resp | abstain % | SAFE F1@6 | "
             "T_eff | base at T_eff | Δ over it |", "|" + "---|" * 11]
    for key, label in REFERENCES.items():
        b, sd = refs[key], refs["sd"][key]
        fs = _pm(b["factscore"], sd["factscore"])
        t1, greedy = ("", fs) if key in GREEDY_REFERENCES else (fs, "")
        lines.append(f"| *{label}* | {t1} | | {greedy} | | {_pm(b['claims_per_response'], sd['claims_per_response'], 1, 2)} | "
                     f"{_pm(b['abstain_rate'], sd['abstain_rate'])} | {_pm(b['safe_f1@6'], sd['safe_f1@6'])} | | | |")
    for name, m in methods.items():
        h, sd, g = m["heldout"], m["sd"]["heldout"], m["gain"]
        after = {key: _pm(h["after"][key], sd["after"][key], *((1, 2) if key == "claims_per_response" else ()))
                 for key in ("factscore", "claims_per_response", "abstain_rate", "safe_f1@6")}
        lines.append(f"| **{name}** ({m['stage']}) | {after['factscore']} | {_signed(g['t1'])} | "
                     f"{_pm(h['after_greedy']['factscore'], sd['after_greedy']['factscore'])} | {_signed(g['greedy'])} | "
                     f"{after['claims_per_response']} | {after['abstain_rate']} | {after['safe_f1@6']} | "
                     f"{_pm(m['effective_temperature'], m['sd']['effective_temperature'], 1, 2)} | "
                     f"{_pm(h['base_at_t_eff']['factscore'], sd['base_at_t_eff']['factscore'])} | {_signed(g['over_base_at_t_eff'])} |")
    return lines


def _tier_table(report: dict[str, Any]) -> list[str]:
    refs = report["references"]
    lines = ["", "## Per popularity tier (held-out, T=1: FActScore % / claims per response / abstain %)", "",
             "| policy | " + " | ".join(TIERS) + " |", "|---" * (len(TIERS) + 1) + "|"]
    rows = [(f"*{REFERENCES['t1']}*", refs["t1"]), (f"*{REFERENCES['tuned_threshold']}*", refs["tuned_threshold"])]
    rows += [(f"**{name}**", m["heldout"]["after"]) for name, m in report["methods"].items()]
    for label, block in rows:
        cells = []
        for tier in TIERS:
            t = block["per_tier"].get(tier) or {}
            cells.append(f"{_pm(t.get('factscore'), None)} / {_pm(t.get('claims_per_response'), None, 1, 2)} / "
                         f"{_pm(t.get('abstain_rate'), None, 100, 0)}")
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
        lines.append(f"| {name} | {m['title']} | {_signed(m['gain']['rl_prompts_t1'])} | {'/'.join(str(x['steps']) for x in tr)} | "
                     f"{'/'.join(str(x['best_step']) for x in tr)} | "
                     f"{' ; '.join(_arrow(x['val_reward_base'], x['val_reward_best']) for x in tr)} | "
                     f"{tr[0]['policy_samples_budget']} | {wall:.0f} | {cpu:.0f} |")
    return lines


def _footer(report: dict[str, Any]) -> list[str]:
    t, c = report["timings"]["total"], report["config"]
    return ["", f"Whole run: {t['wall_s'] / 60:.1f} min wall, {t['cpu_s'] / 60:.1f} min CPU ({c['jobs']} worker process(es), "
            f"{c['threads']} torch thread(s) each; trainable: {c['trainable']}).", "",
            "Δ: FActScore points over the base at the same decoding. T_eff: the trained policy's effective temperature",
            "(its logits regressed on the base's, lab/decoding.py); \"base at T_eff\" samples the *base* at that temperature,",
            "so \"Δ over it\" is what training adds beyond a learned temperature. The tuned references were picked on the",
            "validation entities by SAFE F1@6; the best method and the best reference of each decoding by validation",
            "FActScore. A margin is within noise unless it is larger than its sd over seeds (one seed: always). Abstention",
            "sentences (`... unknown.`) are not claims. Each evaluation folder under `seed<N>/eval/` holds the",
            "`nemo-factuality eval` report it came from.", ""]


def write_report(cfg: Any, results: dict[int, dict[str, Any]], out: Path, total: dict[str, float]) -> dict[str, Any]:
    from nemo_factuality.lab.plots import write_plots

    for seed, res in results.items():
        seed_report = {"seed": seed, "base": res["context"]["base_blocks"], "tuning": res["context"]["tuning"],
                       "methods": {n: {**method_seed_blocks(res["context"], r), "training": r["training"]}
                                   for n, r in res["methods"].items()},
                       "timings": res["context"]["timings"]}
        (Path(res["context"]["dir"]) / "report.json").write_text(json.dumps(to_json_safe(seed_report), indent=2), encoding="utf-8")
    report = aggregate(results, cfg.methods)
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
