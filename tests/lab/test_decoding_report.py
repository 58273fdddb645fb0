"""The learned-temperature check, the validation-tuned references, the multi-seed report and its plots."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch

from nemo_factuality.lab import world as W
from nemo_factuality.lab.decoding import effective_temperature
from nemo_factuality.lab.policy import PolicyConfig, build_policy, encode_docs, pretrain, train_tokenizer
from nemo_factuality.lab.report import aggregate, render_markdown, summary, verdict

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


def _block(fs: float, claims: float = 4.0) -> dict:
    tier = {"factscore": fs, "claims_per_response": claims, "abstain_rate": 0.2, "precision": fs}
    return {**tier, "safe_f1@6": fs - 0.1, "factscore_gamma10": fs / 2, "respond_ratio": 1.0, "n_responses": 120,
            "per_tier": {t: dict(tier) for t in W.TIERS}}


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
              "validation": {k: {"factscore": v, "safe_f1@6": v - 0.1} for k, v in scores.items()}}
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


def _report(results: dict[int, dict], names: list[str]) -> dict:
    report = aggregate(results, names)
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
    assert "| **klcf** (grpo) | 76.0 ± 1.4 | +17.0 ± 2.8 | 85.5 ± 0.7 | +2.5 ± 0.7 |" in md
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
    assert "base, greedy + tuned threshold: no, behind, for knowrl (-4.0 ± 1.0)." in md
    assert report["references"]["greedy_threshold"]["factscore"] == pytest.approx(0.90)


def test_a_margin_is_within_noise_unless_larger_than_its_spread():
    assert verdict(0.3, None) == "within noise"  # one seed: no spread to judge by
    assert verdict(25.0, None) == "within noise"
    assert verdict(0.3, 0.5) == "within noise" and verdict(-0.5, 0.5) == "within noise"
    assert verdict(0.6, 0.5) == "beats" and verdict(-0.6, 0.5) == "falls behind"
    one_seed = _report({4: _seed(0.60, 0.84, {"klcf": (0.603, 0.90)})}, ["klcf"])
    s = one_seed["summary"]
    assert s["against_base"]["t1"]["klcf"]["verdict"] == "within noise"  # +0.3 on one seed is not "beats"
    assert s["t1"]["margin"]["verdict"] == "within noise" and s["t1"]["beaten_by"] == [] and not s["aim_met"]
    assert "beats" not in render_markdown(one_seed).split("## Per popularity tier")[0]


def test_the_first_sentences_answer_the_questions_and_name_the_development_seed():
    fresh = _report({4: _seed(0.60, 0.84, {"klcf": (0.70, 0.80), "knowrl": (0.72, 0.86)})}, ["klcf", "knowrl"])
    lines = [x for x in render_markdown(fresh).splitlines() if x.strip()]
    assert lines[1].startswith("**Did training reduce hallucination (raise held-out FActScore) against the base at the "
                               "same decoding?** (one seed: no spread over seeds, so every margin is within noise)")
    assert "At T=1: within noise for klcf (+10.0), knowrl (+12.0). At greedy: within noise for klcf (-4.0), knowrl (+2.0)." in lines[1]
    assert lines[2].startswith("**Did it beat the no-training references?** The best method against the best reference, "
                               "both picked on validation: at T=1, knowrl (72.0) against base, T=1 + tuned threshold (70.0): "
                               "+2.0 points, within noise;")
    assert lines[2].endswith("is not met.")
    assert lines[3] == ("Seed 4: fresh, not the development seed (0), whose held-out numbers were looked at while the lab "
                        "was designed.")
    several = _report({s: _seed(0.60, 0.84, {"klcf": (0.70 + d, 0.80)}) for s, d in ((0, 0.0), (1, 0.02), (2, 0.01))}, ["klcf"])
    first = several["summary"]["headline"]
    assert "At T=1: yes for klcf (+11.0 ± 1.0). At greedy: no, behind, for klcf (-4.0 ± 0.0)." in first[0]
    assert first[2].startswith("**Seed 0 is the development seed**") and first[2].endswith("(the other seeds are).")


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
