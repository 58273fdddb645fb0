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


def _block(fs: float, claims: float = 4.0) -> dict:
    tier = {"factscore": fs, "claims_per_response": claims, "abstain_rate": 0.2, "precision": fs}
    return {**tier, "safe_f1@6": fs - 0.1, "factscore_gamma10": fs / 2, "respond_ratio": 1.0, "n_responses": 120,
            "per_tier": {t: dict(tier) for t in W.TIERS}}


def _seed(base_t1: float, greedy: float, after: dict[str, tuple[float, float]]) -> dict:
    base = {"heldout": {"t1": _block(base_t1), "greedy": _block(greedy), "tuned_temperature": _block(greedy - 0.01),
                        "tuned_threshold": _block(base_t1 + 0.1, 3.0)},
            "rl_prompts": {"t1": _block(base_t1)}, "validation": {"t1": _block(base_t1), "greedy": _block(greedy)}}
    methods = {}
    for name, (t1, gr) in after.items():
        methods[name] = {"heldout": {"t1": _block(t1), "greedy": _block(gr), "base_at_t_eff": _block(t1 - 0.05)},
                         "rl_prompts": {"t1": _block(t1)}, "validation": {"t1": _block(t1), "greedy": _block(gr)},
                         "effective_temperature": 0.8,
                         "training": {"steps": 80, "best_step": 40, "val_reward_base": 0.1, "val_reward_best": 0.3,
                                      "policy_samples_budget": 5120, "val": [{"step": 0, "val/reward": 0.1}],
                                      "timings": {"train": {"wall_s": 10.0, "cpu_s": 8.0}}}}
    return {"context": {"base_blocks": base, "tuning": {"temperature": 0.5, "threshold": 0.4}}, "methods": methods}


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
    # T=1: klcf 76 beats the threshold reference (69); greedy: klcf 85.5 beats base greedy (83), rlfh does not
    assert s["t1"]["best_method"] == "klcf" and s["t1"]["best_reference"] == "tuned_threshold"
    assert s["t1"]["margin_points"] == pytest.approx(7.0) and s["greedy"]["beaten_by"] == ["klcf"] and s["aim_met"]
    report.update(config={"eval_samples": 4, "jobs": 2, "threads": 1, "trainable": "abstention"}, timings={"total": {"wall_s": 60.0, "cpu_s": 100.0}})
    md = render_markdown(report)
    assert "| **klcf** (grpo) | 76.0 ± 1.4 | +17.0 ± 2.8 | 85.5 ± 0.7 | +2.5 ± 0.7 |" in md
    assert "| *base, T=1 + tuned threshold* | 69.0 ± 1.4 |" in md
    assert md.count("| **rlfh**") == 3  # the held-out, per-tier and validation tables


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
