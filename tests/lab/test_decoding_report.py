"""The learned-temperature check, the validation-tuned references, the multi-seed report, its margins' paired
bootstrap over held-out people, and its plots."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch

from nemo_factuality.lab import world as W
from nemo_factuality.lab.bootstrap import margin_interval, paired_bootstrap, paired_people, verdict
from nemo_factuality.lab.decoding import effective_temperature
from nemo_factuality.lab.policy import PolicyConfig, build_policy, encode_docs, pretrain, train_tokenizer
from nemo_factuality.lab.report import aggregate, render_markdown, summary

CFG = W.WorldConfig(n_people=(3, 3, 4), bios_per_person=(4, 2, 1), seed=5)


@pytest.fixture(scope="module")
def tiny():
    people = W.make_people(CFG)
    bios = W.make_bios(people, CFG)
    tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios])
    model = build_policy(len(tok), PolicyConfig(hidden=32, layers=1, heads=2, intermediate=64), 1, tok)
    ids, mask = encode_docs(tok, bios)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pretraining logs its loss without a tensor-to-float UserWarning
        pretrain(model, ids, mask, budget_s=60, max_steps=20, batch_size=8, seed=1)
    return people, model.eval(), tok


def test_effective_temperature_recovers_a_scaled_final_norm(tiny):
    people, base, tok = tiny
    abstain = tok.convert_tokens_to_ids(W.ABSTAIN_VALUE)
    names = [p.name for p in people[:4]]
    for scale in (2.0, 0.5):
        trained = copy.deepcopy(base)
        with torch.no_grad():
            trained.get_decoder().norm.weight.mul_(scale)  # every logit times `scale`: temperature 1/scale
            trained.get_output_embeddings().weight[abstain] += 3.0  # the abstention row is left out of the fit
        assert effective_temperature(base, trained, tok, names, n=2, abstain_id=abstain, seed=0) == pytest.approx(1 / scale, rel=1e-4)
    assert effective_temperature(base, base, tok, names, n=1, abstain_id=abstain, seed=0) == pytest.approx(1.0, rel=1e-5)


def test_the_threshold_is_tuned_at_greedy_too(tiny, tmp_path):
    """The decode-time threshold applies to greedy responses as to samples: tune_references picks one for each
    decoding on the validation entities, and keeps every reference's validation scores for the report's picks."""
    from nemo_factuality.lab.decoding import TUNE_METRIC, tune_references

    people, model, tok = tiny
    bios = W.make_bios(people, CFG)
    paths = W.write_world(tmp_path / "world", people, bios, W.split_people(people, (1, 1, 1), (1, 1, 1), 5))
    kb = W.build_world_kb(paths, tmp_path / "kb.sqlite")
    names, tiers = [p.name for p in people], {p.name: p.tier for p in people}
    thresholds = (0.2, 0.5, 0.99)
    tuning = tune_references(model, tok, names, tiers, kb, n=2, temperatures=(0.5,), thresholds=thresholds, seed=0)
    sweep = tuning["greedy_threshold_sweep"]
    assert set(sweep) == {"0.2", "0.5", "0.99"} and tuning["greedy_threshold"] in thresholds
    assert sweep[f"{tuning['greedy_threshold']:g}"][TUNE_METRIC] == max(v[TUNE_METRIC] for v in sweep.values())
    validation = tuning["validation"]
    assert set(validation) == {"t1", "greedy", "tuned_temperature", "tuned_threshold", "greedy_threshold"}
    assert validation["greedy_threshold"] == sweep[f"{tuning['greedy_threshold']:g}"]
    assert validation["t1"] == tuning["temperature_sweep"]["1"]
    # a threshold only turns answers into abstentions: at τ = 0.99 the greedy responses abstain at least as often
    assert sweep["0.99"]["abstain_rate"] >= validation["greedy"]["abstain_rate"]


# Every policy's held-out people in the report fixtures: the same per-person offsets around its FActScore, 4
# responding responses each, so a margin is the same on every person and its interval is that margin exactly.
_OFFSETS = (-0.03, -0.01, 0.01, 0.03)


def _block(fs: float, claims: float = 4.0) -> dict:
    tier = {"factscore": fs, "claims_per_response": claims, "abstain_rate": 0.2, "precision": fs}
    return {**tier, "safe_f1": fs - 0.1, "factscore_gamma10": fs / 2, "respond_ratio": 1.0, "n_responses": 120,
            "per_tier": {t: dict(tier) for t in W.TIERS},
            "per_person": {f"person {i}": {"score_sum": 4 * (fs + o), "responding": 4} for i, o in enumerate(_OFFSETS)}}


def _seed(base_t1: float, greedy: float, after: dict[str, tuple[float, float]], *,
          val: dict[str, tuple[float, float]] | None = None, ref_val: dict[str, float] | None = None,
          greedy_threshold: float | None = None, best_step: int = 40) -> dict:
    """One seed's results as run_lab returns them. ``val``: a method's validation FActScore at (T=1, greedy) when
    it differs from its held-out one; ``ref_val``: the same for the references (by report key)."""
    heldout = {"t1": _block(base_t1), "greedy": _block(greedy), "tuned_temperature": _block(greedy - 0.01),
               "tuned_threshold": _block(base_t1 + 0.1, 3.0),
               "greedy_threshold": _block(greedy + 0.005 if greedy_threshold is None else greedy_threshold, 3.5)}
    scores = {k: b["factscore"] for k, b in heldout.items()} | (ref_val or {})
    tuning = {"temperature": 0.5, "threshold": 0.4, "greedy_threshold": 0.3,
              "validation": {k: {"factscore": v, "safe_f1": v - 0.1} for k, v in scores.items()}}
    base = {"heldout": heldout, "rl_prompts": {"t1": _block(base_t1)}, "validation": {"t1": _block(base_t1), "greedy": _block(greedy)}}
    methods = {}
    for name, (t1, gr) in after.items():
        v1, vg = (val or {}).get(name, (t1, gr))
        methods[name] = {"heldout": {"t1": _block(t1), "greedy": _block(gr), "base_at_t_eff": _block(t1 - 0.05)},
                         "rl_prompts": {"t1": _block(t1)}, "validation": {"t1": _block(v1), "greedy": _block(vg)},
                         "effective_temperature": 0.8,
                         "training": {"steps": 80, "best_step": best_step, "val_reward_base": 0.1, "val_reward_best": 0.3,
                                      "policy_samples_budget": 5120,
                                      "val": [{"step": k, "val/reward": 0.1 + 0.004 * k} for k in (0, 20, 40, 60, 80)],
                                      "timings": {"train": {"wall_s": 10.0, "cpu_s": 8.0}}}}
    return {"context": {"base_blocks": base, "tuning": tuning}, "methods": methods}


def _report(results: dict[int, dict], names: list[str], world: str = "synthetic") -> dict:
    report = aggregate(results, names, world)
    report["summary"] = summary(report)
    report.update(config={"eval_samples": 4, "jobs": 2, "threads": 1, "trainable": "calibration"},
                  timings={"total": {"wall_s": 60.0, "cpu_s": 100.0}})
    return report


def test_report_aggregates_seeds_and_says_what_training_beats():
    results = {0: _seed(0.60, 0.84, {"klcf": (0.75, 0.86), "rlfh": (0.70, 0.80)}),
               1: _seed(0.58, 0.82, {"klcf": (0.77, 0.85), "rlfh": (0.66, 0.81)})}
    report = aggregate(results, ["klcf", "rlfh"])
    klcf = report["methods"]["klcf"]
    assert klcf["heldout"]["after"]["factscore"] == pytest.approx(0.76)
    assert klcf["sd"]["heldout"]["after"]["factscore"] == pytest.approx(np.std([0.75, 0.77], ddof=1))
    assert klcf["gain"]["t1"]["per_seed"] == pytest.approx([15.0, 19.0])
    assert klcf["gain"]["t1"]["mean"] == pytest.approx(17.0) and klcf["gain"]["t1"]["sd"] == pytest.approx(math.sqrt(8))
    assert klcf["gain"]["greedy"]["mean"] == pytest.approx(2.5)
    assert klcf["gain"]["over_base_at_t_eff"]["mean"] == pytest.approx(5.0)
    assert report["references"]["tuned_threshold"]["factscore"] == pytest.approx(0.69)
    report["summary"] = s = summary(report)
    # T=1: klcf 76 beats the threshold reference (69) on both seeds (+5, +9); greedy: the thresholded greedy base
    # (83.5) has the better validation score, klcf is +1.5 and +2.5 over it, rlfh below it
    assert s["t1"]["best_method"] == "klcf" and s["t1"]["best_reference"] == "tuned_threshold"
    assert s["t1"]["margin"]["mean"] == pytest.approx(7.0) and s["t1"]["margin"]["verdict"] == "beats"
    assert s["greedy"]["best_reference"] == "greedy_threshold" and s["greedy"]["margin"]["mean"] == pytest.approx(2.0)
    assert s["greedy"]["beaten_by"] == ["klcf"] and s["aim_met"]
    report.update(config={"eval_samples": 4, "jobs": 2, "threads": 1, "trainable": "abstention"}, timings={"total": {"wall_s": 60.0, "cpu_s": 100.0}})
    md = render_markdown(report)
    # the margin ± its sd over seeds [its interval over the held-out people: here the same gain on every person]
    assert "| **klcf** (grpo) | 76.0 ± 1.4 | +17.0 ± 2.8 [+17.0, +17.0] | 85.5 ± 0.7 | +2.5 ± 0.7 [+2.5, +2.5] |" in md
    assert "| *base, T=1 + tuned threshold* | 69.0 ± 1.4 |" in md
    assert "| *base, greedy + tuned threshold* |  | | 83.5 ± 1.4 |" in md  # a greedy reference: the greedy column
    assert md.count("| **rlfh**") == 3  # the held-out, per-tier and validation tables


def test_the_best_method_and_reference_are_picked_on_validation_and_reported_held_out():
    """rlfh has the best held-out score but klcf the best validation score: klcf is the pick, and its held-out
    number is what the report compares; likewise the plain T=1 base beats the threshold on validation here."""
    val = {"klcf": (0.80, 0.85), "rlfh": (0.70, 0.80)}
    results = {s: _seed(0.60, 0.84, {"klcf": (0.70 + d, 0.83), "rlfh": (0.78 + d, 0.86)}, val=val,
                        ref_val={"t1": 0.75, "tuned_threshold": 0.65}) for s, d in ((1, 0.0), (2, 0.01))}
    s = _report(results, ["klcf", "rlfh"])["summary"]
    t1 = s["t1"]
    assert t1["best_method"] == "klcf" and t1["best_method_validation_factscore"] == pytest.approx(80.0)
    assert t1["best_method_factscore"] == pytest.approx(70.5)  # held-out, not the validation number
    assert t1["best_reference"] == "t1" and t1["best_reference_factscore"] == pytest.approx(60.0)
    assert t1["margin"]["per_seed"] == pytest.approx([10.0, 11.0])
    assert s["greedy"]["best_method"] == "klcf" and s["greedy"]["best_method_factscore"] == pytest.approx(83.0)


def test_greedy_has_a_thresholded_reference_that_every_method_faces():
    """A method that beats the greedy base by abstaining more can still fall behind the greedy base with a
    threshold: the report's greedy comparison and its per-method threshold line both say so."""
    results = {s: _seed(0.60, 0.82 + d, {"knowrl": (0.62 + d, 0.86 + d)}, greedy_threshold=0.90 + 2 * d)
               for s, d in ((1, 0.0), (2, 0.01), (3, -0.01))}
    report = _report(results, ["knowrl"])
    s = report["summary"]
    assert s["against_base"]["greedy"]["knowrl"]["verdict"] == "beats"  # +4 on every seed over the greedy base
    assert s["greedy"]["best_reference"] == "greedy_threshold"
    knowrl = s["greedy"]["against_threshold"]["knowrl"]
    assert knowrl["per_seed"] == pytest.approx([-4.0, -5.0, -3.0]) and knowrl["verdict"] == "falls behind"
    md = render_markdown(report)
    assert "base, greedy + tuned threshold: no, behind, for knowrl (-4.0 ± 1.0 [-4.0, -4.0])." in md
    assert report["references"]["greedy_threshold"]["factscore"] == pytest.approx(0.90)


def _people(scores: list[float], responding: int | list[int] = 4, prefix: str = "p") -> dict:
    """A per-person table from each person's FActScore (0-1) and responding responses."""
    counts = [responding] * len(scores) if isinstance(responding, int) else responding
    return {f"{prefix}{i}": {"score_sum": fs * n, "responding": n}
            for i, (fs, n) in enumerate(zip(scores, counts, strict=True))}


def _interval(after: dict, before: dict) -> tuple[float, float]:
    return paired_bootstrap([paired_people(after, before)])


def test_a_gain_of_ten_points_on_every_person_is_an_interval_of_exactly_ten():
    base = [0.2, 0.5, 0.55, 0.7, 0.9, 0.35]
    raised = [b + 0.1 for b in base]
    up, down = _interval(_people(raised), _people(base)), _interval(_people(base), _people(raised))
    assert up == pytest.approx((10.0, 10.0)) and verdict(up) == "beats"
    assert down == pytest.approx((-10.0, -10.0)) and verdict(down) == "falls behind"
    same = _interval(_people(base), _people(base))
    assert same == (0.0, 0.0) and verdict(same) == "within noise"


def test_half_the_people_up_ten_and_half_down_ten_is_within_noise():
    base = [0.3, 0.6, 0.5, 0.4, 0.7, 0.45, 0.55, 0.35] * 5
    after = [b + (0.1 if i % 2 else -0.1) for i, b in enumerate(base)]
    low, high = _interval(_people(after), _people(base))
    # every resample's margin is a mean of per-person margins of ±10: inside [-10, 10], and here 0 is inside it
    assert -10.0 <= low < 0.0 < high <= 10.0
    assert verdict((low, high)) == "within noise"


def test_the_interval_is_paired_by_person():
    """Per-person scores from 0 to 1, the method 5 points above the base on every person: drawing the same people
    for both sides gives exactly +5; an unpaired draw would add each person's difficulty twice (tens of points).
    People differ in how many responses responded, and the two tables list them in different orders."""
    rng = np.random.default_rng(7)
    base = list(rng.uniform(0.0, 0.9, size=60))
    counts = list(rng.integers(1, 5, size=60))
    before = _people(base, [int(n) for n in counts])
    after = dict(reversed(list(_people([b + 0.05 for b in base], [int(n) for n in counts]).items())))
    assert _interval(after, before) == pytest.approx((5.0, 5.0))
    assert margin_interval([after], [before]) == pytest.approx((5.0, 5.0))
    with pytest.raises(ValueError, match="same people"):
        paired_people(after, _people(base[:-1], [int(n) for n in counts[:-1]]))


def test_the_interval_lies_between_the_extreme_person_margins_and_moves_with_the_method():
    """With as many responding responses everywhere, a resample's margin is the mean of its people's margins:
    never beyond the smallest and largest person margin. Adding d points on every person moves both bounds by d;
    raising one person can lower neither bound."""
    rng = np.random.default_rng(3)
    base = rng.uniform(0.1, 0.8, size=30)
    after = np.clip(base + rng.normal(0.02, 0.1, size=30), 0, 1)
    low, high = _interval(_people(list(after)), _people(list(base)))
    per_person = 100 * (after - base)
    assert per_person.min() <= low <= high <= per_person.max()
    shifted = _interval(_people(list(after + 0.05)), _people(list(base)))
    assert shifted == pytest.approx((low + 5.0, high + 5.0))
    raised = after.copy()
    raised[int(np.argmin(per_person))] += 0.3
    new_low, new_high = _interval(_people(list(raised)), _people(list(base)))
    assert new_low >= low and new_high >= high


def test_the_interval_is_a_95_percent_one():
    """Many people: the bootstrap interval of a mean approaches the normal one, mean ± 1.96 standard errors
    (computed here from the per-person margins alone), up to the resampling's own error (~0.06 standard errors)."""
    rng = np.random.default_rng(11)
    base = rng.uniform(0.2, 0.6, size=400)
    after = base + rng.normal(0.03, 0.1, size=400)
    per_person = 100 * (after - base)
    se = per_person.std(ddof=0) / np.sqrt(per_person.size)
    low, high = _interval(_people(list(after)), _people(list(base)))
    assert low == pytest.approx(per_person.mean() - 1.96 * se, abs=0.25 * se)
    assert high == pytest.approx(per_person.mean() + 1.96 * se, abs=0.25 * se)
    assert _interval(_people(list(after)), _people(list(base))) == (low, high)  # a fixed generator: the same report


def test_seeds_hold_out_their_own_people_and_their_margins_are_averaged():
    """Each seed is its own world with its own people: each is resampled on its own, and the interval is that of
    the mean over seeds (+10 on every person of one seed, +20 on every person of the other: exactly +15)."""
    one, two = [0.2, 0.4, 0.6], [0.3, 0.5, 0.7, 0.1]
    interval = margin_interval([_people([x + 0.1 for x in one], prefix="a"), _people([x + 0.2 for x in two], prefix="b")],
                               [_people(one, prefix="a"), _people(two, prefix="b")])
    assert interval == pytest.approx((15.0, 15.0))


def test_a_verdict_needs_the_whole_interval_on_one_side_of_zero():
    assert verdict((0.1, 3.0)) == "beats" and verdict((-3.0, -0.1)) == "falls behind"
    assert verdict((-1.0, 1.0)) == "within noise" and verdict((0.0, 2.0)) == "within noise"
    assert verdict(None) == "within noise"  # no per-person scores (results from before they were kept)
    assert margin_interval([None], [_people([0.5])]) is None


def test_one_seed_can_beat_and_the_first_line_says_what_one_seed_can_tell():
    """One seed, +0.3 points on every held-out person: the interval is [+0.3, +0.3], so it beats the base; the
    margin's sd over seeds does not exist and is not needed."""
    one_seed = _report({4: _seed(0.60, 0.84, {"klcf": (0.603, 0.90)})}, ["klcf"])
    s = one_seed["summary"]
    klcf = s["against_base"]["t1"]["klcf"]
    assert klcf["sd"] is None and klcf["interval"] == pytest.approx([0.3, 0.3]) and klcf["verdict"] == "beats"
    lines = [x for x in render_markdown(one_seed).splitlines() if x.strip()]
    assert lines[1].startswith("**What one seed can tell:** each margin comes with a 95% paired bootstrap interval "
                               "[in brackets] over the 4 held-out people (2000 resamples")
    assert "the held-out people's sampling noise" in lines[1] and "only more seeds measure that" in lines[1]
    assert "At T=1: yes for klcf (+0.3 [+0.3, +0.3])." in lines[2]
    several = _report({s: _seed(0.60, 0.84, {"klcf": (0.70, 0.80)}) for s in (1, 2)}, ["klcf"])
    assert several["summary"]["headline"][0].startswith("**What 2 seeds can tell:**")
    assert "the ± is the sd over seeds" in several["summary"]["headline"][0]


def test_results_without_per_person_scores_have_no_interval():
    results = {4: _seed(0.60, 0.84, {"klcf": (0.70, 0.90)})}
    for blocks in (results[4]["context"]["base_blocks"]["heldout"], results[4]["methods"]["klcf"]["heldout"]):
        for block in blocks.values():
            block.pop("per_person")
    s = _report(results, ["klcf"])["summary"]
    assert s["heldout_entities"] is None and s["t1"]["margin"]["interval"] is None
    assert {m["verdict"] for d in ("t1", "greedy") for m in s["against_base"][d].values()} == {"within noise"}
    assert "no per-person scores" in s["headline"][0]


def test_the_first_sentences_answer_the_questions_and_name_the_development_seed():
    fresh = _report({4: _seed(0.60, 0.84, {"klcf": (0.70, 0.80), "knowrl": (0.72, 0.86)})}, ["klcf", "knowrl"])
    lines = [x for x in render_markdown(fresh).splitlines() if x.strip()]
    assert lines[1].startswith("**What one seed can tell:**")
    assert lines[2].startswith("**Did training reduce hallucination (raise held-out FActScore) against the base at the "
                               "same decoding?** At T=1:")
    assert ("At T=1: yes for klcf (+10.0 [+10.0, +10.0]), knowrl (+12.0 [+12.0, +12.0]). At greedy: yes for knowrl "
            "(+2.0 [+2.0, +2.0]); no, behind, for klcf (-4.0 [-4.0, -4.0]).") in lines[2]
    assert lines[3].startswith("**Did it beat the no-training references?** The best method against the best reference, "
                               "both picked on validation: at T=1, knowrl (72.0) against base, T=1 + tuned threshold (70.0): "
                               "+2.0 [+2.0, +2.0] points, beats;")
    assert lines[3].endswith("is met.")
    assert lines[4] == ("Seed 4: fresh worlds of invented people that no design decision looked at, not the development "
                        "seed (0), which is not a fresh test: its held-out numbers were looked at while the lab was designed.")
    several = _report({s: _seed(0.60, 0.84, {"klcf": (0.70 + d, 0.80)}) for s, d in ((0, 0.0), (1, 0.02), (2, 0.01))}, ["klcf"])
    first = several["summary"]["headline"]
    assert ("At T=1: yes for klcf (+11.0 ± 1.0 [+11.0, +11.0]). At greedy: no, behind, for klcf "
            "(-4.0 ± 0.0 [-4.0, -4.0]).") in first[1]
    assert first[3] == ("**Seed 0 is the development seed**, not a fresh test: its held-out numbers were looked at while "
                        "the lab was designed. Seeds 1, 2: fresh worlds of invented people that no design decision looked at.")
    alone = _report({0: _seed(0.60, 0.84, {"klcf": (0.70, 0.80)})}, ["klcf"])["summary"]["headline"]
    assert alone[3] == ("**Seed 0 is the development seed**, not a fresh test: its held-out numbers were looked at while "
                        "the lab was designed.")


def test_the_countries_worlds_report_speaks_of_countries():
    """The same sentences in the countries world's words: its nouns (and their possessive), its development seed's
    story and what its other seeds are."""
    results = {4: _seed(0.60, 0.84, {"klcf": (0.603, 0.90)})}
    lines = [x for x in render_markdown(_report(results, ["klcf"], "countries")).splitlines() if x.strip()]
    assert lines[1].startswith("**What one seed can tell:** each margin comes with a 95% paired bootstrap interval "
                               "[in brackets] over the 4 held-out countries (2000 resamples of the countries, the same "
                               "countries for the method and its baseline)")
    assert ("The interval measures the held-out countries' sampling noise (would the margin hold for other countries "
            "like these?)") in lines[1]
    tuned = ("the countries world (its prompt, aliases and run sizes) was built and tuned on its runs, their held-out "
             "answers read")
    others = ("other held-out countries drawn from the same countries the world was tuned on (a few may have been seed "
              "0's held-out countries too)")
    assert lines[4] == f"Seed 4: {others}, not the development seed (0), which is not a fresh test: {tuned}."
    several = _report({s: _seed(0.60, 0.84, {"klcf": (0.70, 0.80)}) for s in (0, 1)}, ["klcf"], "countries")
    assert several["summary"]["headline"][3] == (f"**Seed 0 is the development seed**, not a fresh test: {tuned}. "
                                                 f"Seed 1: {others}.")
    for blocks in (results[4]["context"]["base_blocks"]["heldout"], results[4]["methods"]["klcf"]["heldout"]):
        for block in blocks.values():
            block.pop("per_person")
    assert _report(results, ["klcf"], "countries")["summary"]["headline"][0] == (
        "**What one seed can tell:** these results carry no per-country scores (they predate them), so no margin has an "
        "interval over the held-out countries and every margin is within noise.")


def _curve_stars(ax) -> list[tuple[float, float]]:
    return [(x, y) for line in ax.get_lines() if line.get_marker() == "*" for x, y in zip(*line.get_data(), strict=True)]


@pytest.mark.parametrize("seeds", [(4,), (1, 2)])
def test_plots_draw_error_bars_only_over_several_seeds(seeds):
    from matplotlib.container import BarContainer, ErrorbarContainer

    from nemo_factuality.lab.plots import figures

    results = {s: _seed(0.60 + 0.01 * s, 0.84, {"klcf": (0.75, 0.86)}, best_step=20 * s) for s in seeds}
    report = _report(results, ["klcf"])
    figs = figures(report, {"klcf": [results[s]["methods"]["klcf"]["training"]["val"] for s in seeds]})
    methods_fig = figs["methods.png"]
    bars = [c for ax in methods_fig.axes for c in ax.containers if isinstance(c, BarContainer)]
    precision_ax = figs["precision_vs_claims.png"].axes[0]
    errorbars = [c for c in precision_ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 5  # one bar set per metric panel
    if len(seeds) == 1:
        assert all(b.errorbar is None for b in bars) and errorbars == []
        assert "no error bars" in methods_fig._suptitle.get_text() and "no error bars" in precision_ax.get_title()
    else:
        assert all(b.errorbar is not None for b in bars) and len(errorbars) == 3  # base, base + τ, klcf
        assert "sd over seeds" in methods_fig._suptitle.get_text()
    curves_ax = figs["validation_curves.png"].axes[0]
    # a star on each seed's curve at the step model selection kept, and the legend names it
    assert _curve_stars(curves_ax) == [(20 * s, pytest.approx(0.1 + 0.08 * s)) for s in seeds]
    assert [t.get_text() for t in curves_ax.get_legend().get_texts()][1] == f"seed {seeds[0]}: selected, step {20 * seeds[0]}"
    tier_title = figs["per_tier.png"].axes[0].get_title()
    assert tier_title.startswith("Held-out FActScore per popularity tier at T=1")
    assert tier_title.endswith("(seed 4)" if len(seeds) == 1 else "(mean over seeds 1, 2)")


def test_plots_are_readable(tmp_path):
    from matplotlib.container import BarContainer

    from nemo_factuality.lab.plots import figures

    results = {0: _seed(0.60, 0.84, {"klcf": (0.75, 0.86), "rlfh": (0.70, 0.80)}),
               1: _seed(0.58, 0.82, {"klcf": (0.77, 0.85), "rlfh": (0.66, 0.81)})}
    report = aggregate(results, ["klcf", "rlfh"])
    curves = {m: [results[s]["methods"][m]["training"]["val"] for s in (0, 1)] for m in ("klcf", "rlfh")}
    figs = figures(report, curves)
    assert set(figs) == {"methods.png", "precision_vs_claims.png", "per_tier.png", "validation_curves.png"}
    for name, fig in figs.items():
        for ax in fig.axes:
            legend = ax.get_legend()
            for text in (legend.get_texts() if legend else []):
                assert text.get_fontsize() >= 9, name
            for label in ax.get_xticklabels():
                assert label.get_fontsize() >= 9, name
        fig.savefig(tmp_path / name)
    methods_ax = figs["methods.png"].axes[0]
    assert [t.get_text() for t in methods_ax.get_xticklabels()] == ["base", "base + τ", "klcf", "rlfh"]
    bars = next(c for c in methods_ax.containers if isinstance(c, BarContainer))
    assert len(bars) == 4 and len(bars.errorbar.lines[2][0].get_segments()) == 4  # a bar and an error bar per policy
    greedy_ax = figs["methods.png"].axes[1]  # the threshold reference has a greedy bar too
    assert [t.get_text() for t in greedy_ax.get_xticklabels()] == ["base", "base + τ", "klcf", "rlfh"]
