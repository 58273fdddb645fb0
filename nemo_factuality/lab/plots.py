"""The lab's plots (``DIR/plots``), drawn to be read at a glance: every point and bar is labelled on the
axes or beside it, and text is at least ``FONT`` points.

* ``methods.png``: methods × metrics on held-out entities (FActScore at T=1 and greedy, SAFE F1@K, claims per
  response, abstain rate), the no-training references first; error bars are the sd over seeds.
* ``precision_vs_claims.png``: one point per policy at T=1 (claims per response, precision), error bars both ways.
* ``per_tier.png``: held-out FActScore per popularity tier, per policy.
* ``validation_curves.png``: each method's own validation reward over its training steps, one panel per method,
  with the step model selection kept marked on each curve.

With one seed there is no spread to draw: no error bars at all (not bars of width 0), and the titles say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_factuality.lab.world import TIERS
from nemo_factuality.lab.worlds import get_world

FONT = 10
_METRICS = (("factscore", "after", "FActScore, T=1 (%)", 100), ("factscore", "after_greedy", "FActScore, greedy (%)", 100),
            ("safe_f1", "after", "SAFE F1@{k}, T=1 (%)", 100), ("claims_per_response", "after", "claims per response, T=1", 1),
            ("abstain_rate", "after", "abstained slots, T=1 (%)", 100))
_REF_FOR = {"after": "t1", "after_greedy": "greedy"}


def _policies(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(label, kind, blocks by decoding, sds by decoding) for the base references and each method."""
    refs = report["references"]
    out = [("base", "reference", {"after": refs["t1"], "after_greedy": refs["greedy"]},
            {"after": refs["sd"]["t1"], "after_greedy": refs["sd"]["greedy"]}),
           ("base + τ", "reference", {"after": refs["tuned_threshold"], "after_greedy": refs.get("greedy_threshold")},
            {"after": refs["sd"]["tuned_threshold"], "after_greedy": refs["sd"].get("greedy_threshold")})]
    for name, m in report["methods"].items():
        out.append((name, "method", m["heldout"], m["sd"]["heldout"]))
    return out


def _value(blocks: dict[str, Any], sds: dict[str, Any], when: str, key: str, scale: float) -> tuple[float, float]:
    block = blocks.get(when)
    if block is None or block.get(key) is None:
        return float("nan"), 0.0
    sd = (sds.get(when) or {}).get(key)
    return scale * block[key], scale * (sd or 0.0)


def figures(report: dict[str, Any], curves: dict[str, list[list[dict]]]) -> dict[str, Any]:
    """The lab's figures by file name (matplotlib ``Figure`` objects; the caller saves and closes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT, "legend.fontsize": FONT, "xtick.labelsize": FONT, "ytick.labelsize": FONT})
    policies, spread = _policies(report), len(report["seeds"]) > 1
    k = get_world(report.get("world", "synthetic")).slots
    selected = {name: [t["best_step"] for t in m["training"]] for name, m in report["methods"].items()}
    return {"methods.png": _methods(plt, policies, spread, k), "precision_vs_claims.png": _precision_vs_claims(plt, policies, spread),
            "per_tier.png": _per_tier(plt, policies, report["seeds"]),
            "validation_curves.png": _curves(plt, report["seeds"], curves, selected)}


_COLOURS = {"reference": "#9e9e9e", "method": "#1f77b4"}


def _seeds_note(seeds: list[int]) -> str:
    return f"mean over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"


def _methods(plt: Any, policies: list, spread: bool, k: int) -> Any:
    fig, axes = plt.subplots(1, len(_METRICS), figsize=(4.2 * len(_METRICS), 5.2), dpi=110)
    for ax, (key, when, title, scale) in zip(axes, _METRICS, strict=True):
        bars = [(label, *_value(blocks, sds, when, key, scale), _COLOURS[kind]) for label, kind, blocks, sds in policies]
        bars = [b for b in bars if b[1] == b[1]]  # a policy with no block at this decoding has no bar
        ax.bar(range(len(bars)), [b[1] for b in bars], yerr=[b[2] for b in bars] if spread else None,
               color=[b[3] for b in bars], capsize=4)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=60, ha="right")
        ax.set_title(title.format(k=k))
        ax.grid(axis="y", alpha=0.3)
    bars_are = "error bars: sd over seeds" if spread else "one seed: no spread over seeds, so no error bars"
    fig.suptitle(f"Held-out entities: no-training references (grey) and trained methods (blue); {bars_are}")
    fig.tight_layout()
    return fig


def _precision_vs_claims(plt: Any, policies: list, spread: bool) -> Any:
    fig, ax = plt.subplots(figsize=(8, 6), dpi=110)
    for label, kind, blocks, sds in policies:
        x, xe = _value(blocks, sds, "after", "claims_per_response", 1)
        y, ye = _value(blocks, sds, "after", "precision", 100)
        marker = "o" if kind == "method" else "s"
        if spread:
            ax.errorbar(x, y, xerr=xe, yerr=ye, fmt=marker, color=_COLOURS[kind], capsize=3, ms=7)
        else:
            ax.plot([x], [y], marker, color=_COLOURS[kind], ms=7)
        ax.annotate(label, (x, y), xytext=(6, 4), textcoords="offset points", fontsize=FONT)
    ax.set_xlabel("claims per responding response (T=1)")
    ax.set_ylabel("precision of claims, % (T=1)")
    ax.set_title("Held-out precision vs claims: up and to the right is better" +
                 ("" if spread else "\n(one seed: no error bars)"))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _per_tier(plt: Any, policies: list, seeds: list[int]) -> Any:
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    width = 0.8 / len(policies)
    for k, (label, _, blocks, _) in enumerate(policies):
        tiers = blocks["after"]["per_tier"]
        ys = [100 * ((tiers.get(t) or {}).get("factscore") or 0.0) for t in TIERS]
        ax.bar([i + k * width for i in range(len(TIERS))], ys, width=width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(TIERS))], TIERS)
    ax.set_ylabel("held-out FActScore, T=1 (%)")
    ax.set_title(f"Held-out FActScore per popularity tier at T=1, per policy ({_seeds_note(seeds)})")
    ax.legend(ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=FONT)
    fig.tight_layout()
    return fig


def _curves(plt: Any, seeds: list[int], curves: dict[str, list[list[dict]]], selected: dict[str, list[int]]) -> Any:
    """One panel per method; a star on each seed's curve at the step model selection kept (0: the base)."""
    cols = min(max(len(curves), 1), 4)
    rows = -(-max(len(curves), 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), dpi=110, squeeze=False)
    for ax, (name, per_seed) in zip(axes.flat, curves.items(), strict=False):
        for seed, log, best in zip(seeds, per_seed, selected[name], strict=True):
            (line,) = ax.plot([r["step"] for r in log], [r["val/reward"] for r in log], marker="o", ms=4, label=f"seed {seed}")
            at_best = [r["val/reward"] for r in log if r["step"] == best]
            if at_best:
                ax.plot([best], at_best[:1], marker="*", ms=16, linestyle="none", color=line.get_color(),
                        markeredgecolor="black", label=f"seed {seed}: selected, step {best}")
        ax.set_title(f"{name}: validation reward")
        ax.set_xlabel("step")
        ax.legend(fontsize=FONT)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    fig.suptitle("Each method's own reward on the validation entities; ★ the step model selection kept")
    fig.tight_layout()
    return fig


def write_plots(report: dict[str, Any], curves: dict[str, list[list[dict]]], plots: Path) -> None:
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    for name, fig in figures(report, curves).items():
        fig.savefig(plots / name)
        plt.close(fig)
