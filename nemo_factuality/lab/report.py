"""The lab report: ``report.json`` (schema below), ``report.md`` and plots.

``report.json``::

    {"heldout":    {"before": BLOCK, "after": BLOCK},      # entities RL never saw
     "rl_prompts": {"before": BLOCK, "after": BLOCK},      # entities RL trained on (same tier mix)
     "references": {"greedy": BLOCK, "threshold_tau0.5": BLOCK},   # no-training baselines, held-out
     "variants":   {"rl_precision_only": {"heldout": BLOCK, ...}, ...},   # --compare
     "summary":    {"heldout_factscore_gain_points", "heldout_claims_change", ...},
     "training", "timings", "config"}

    BLOCK = {"factscore" (0-1, gamma=0), "factscore_gamma10", "safe_f1@6", "precision",
             "claims_per_response", "abstain_rate", "respond_ratio", "n_responses", "per_tier": {tier: ...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation.report import to_json_safe
from nemo_factuality.lab.world import TIERS

_COLS = ("factscore", "safe_f1@6", "precision", "claims_per_response", "abstain_rate")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Change in held-out and RL-prompt FActScore (points) and claims per response (fraction)."""
    out = {}
    for key in ("heldout", "rl_prompts"):
        b, a = report[key]["before"], report[key]["after"]
        out[f"{key}_factscore_gain_points"] = 100 * (a["factscore"] - b["factscore"])
        out[f"{key}_claims_change"] = a["claims_per_response"] / b["claims_per_response"] - 1
    out["target_met"] = out["heldout_factscore_gain_points"] >= 10 and out["heldout_claims_change"] >= -0.25
    return out


def _fmt(x: Any) -> str:
    return "–" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rows = [("held-out, before RL", report["heldout"]["before"]), ("held-out, after RL", report["heldout"]["after"])]
    rows += [(f"held-out, reference: {k}", v) for k, v in report["references"].items()]
    rows += [(f"held-out, after {k}", v["heldout"]) for k, v in report["variants"].items()]
    rows += [("RL prompts, before RL", report["rl_prompts"]["before"]), ("RL prompts, after RL", report["rl_prompts"]["after"])]
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = ["# Factuality lab", "",
             f"Held-out FActScore (γ=0) change: **{s['heldout_factscore_gain_points']:+.1f} points**, claims per response "
             f"{100 * s['heldout_claims_change']:+.1f}% (target: ≥ +10 points with ≥ −25% claims: "
             f"{'met' if s['target_met'] else 'not met'}). RL prompts: {s['rl_prompts_factscore_gain_points']:+.1f} points, "
             f"claims {100 * s['rl_prompts_claims_change']:+.1f}%.", "",
             "| set | " + " | ".join(_COLS) + " |", "|---" * (len(_COLS) + 1) + "|"]
    for name, block in _rows(report):
        lines.append(f"| {name} | " + " | ".join(_fmt(block.get(c)) for c in _COLS) + " |")
    lines += ["", "## Per popularity tier (held-out, FActScore / claims per response / abstain rate)", "",
              "| tier | before | after | greedy | threshold |", "|---|---|---|---|---|"]
    refs = list(report["references"].values())
    for tier in TIERS:
        cells = []
        for block in [report["heldout"]["before"], report["heldout"]["after"], *refs]:
            t = block["per_tier"].get(tier, {})
            cells.append(" / ".join(_fmt(t.get(c)) for c in ("factscore", "claims_per_response", "abstain_rate")))
        lines.append(f"| {tier} | " + " | ".join(cells) + " |")
    lines += ["", "## Time", "", "| phase | wall s | CPU s |", "|---|---|---|"]
    for name, t in report["timings"].items():
        lines.append(f"| {name} | {t['wall_s']:.0f} | {t['cpu_s']:.0f} |")
    lines += ["", "Abstention sentences (`... unknown.`) are not claims: FActScore is the mean precision of the",
              "responses that make at least one claim; abstain rate is the share of slots answered `unknown`.",
              "Each evaluation folder under `eval/` holds the `nemo-factuality eval` report it came from.", ""]
    return "\n".join(lines)


def write_plots(report: dict[str, Any], curves: dict[str, Any], plots: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, info in curves.items():
        ax.plot([r["step"] for r in info["train"]], [r["reward/score"] for r in info["train"]], alpha=0.5, label=f"{name} train")
        ax.plot([r["step"] for r in info["val"]], [r["val/lab_reward"] for r in info["val"]], marker="o", label=f"{name} val")
    ax.set_xlabel("RL step")
    ax.set_ylabel("lab reward")
    ax.legend(fontsize=7)
    ax.set_title("Reward curves")
    fig.tight_layout()
    fig.savefig(plots / "reward_curves.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, block in _rows(report):
        pts = [(t["claims_per_response"], t["precision"]) for t in block["per_tier"].values()]
        ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set_xlabel("claims per response (per tier)")
    ax.set_ylabel("precision")
    ax.legend(fontsize=6)
    ax.set_title("Precision vs claims, popular → rare")
    fig.tight_layout()
    fig.savefig(plots / "precision_vs_claims.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    blocks = [("before", report["heldout"]["before"]), ("after", report["heldout"]["after"]),
              *report["references"].items()]
    width = 0.8 / len(blocks)
    for k, (name, block) in enumerate(blocks):
        ys = [(block["per_tier"].get(t, {}).get("factscore") or 0.0) for t in TIERS]
        ax.bar([i + k * width for i in range(len(TIERS))], ys, width=width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(TIERS))], TIERS)
    ax.set_ylabel("FActScore (held-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots / "per_tier.png")
    plt.close(fig)


def write_report(report: dict[str, Any], curves: dict[str, Any], out: Path) -> None:
    report["summary"] = summary(report)
    safe = to_json_safe(report)
    (out / "report.json").write_text(json.dumps(safe, indent=2), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(safe), encoding="utf-8")
    write_plots(safe, curves, out / "plots")
