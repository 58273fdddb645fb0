"""Human-readable views of an evaluation report: a markdown summary and a precision plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from nemo_factuality.evaluation.report import EvalRecord, precision_points


def _f(x: Any) -> str:
    return "–" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def render_markdown(report: dict[str, Any]) -> str:
    """One table row per group with the headline number of each metric."""
    opts = report["options"]
    ks, gammas, hk = opts["k"], opts["gamma"], opts["hallulens_k"]
    head = ["group", "n", "abstained", "claims/resp", "SAFE n", "SAFE P"] + [f"F1@{k}" for k in ks]
    head += [f"FActScore γ={g:g}" for g in gammas] + ["respond", "VeriScore F1@Kmed", f"LongWiki F1@{hk}"]
    lines = ["# Factuality evaluation", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, g in report["groups"].items():
        fs = g["factscore"]
        row = [name, g["n_records"], g["n_abstained"], g["claims_per_response"], g["safe"]["n_items"],
               g["safe"]["precision"]]
        row += [g["safe"][f"f1@{k}"] for k in ks]
        row += [fs[f"gamma{int(x) if float(x).is_integer() else x}"]["score"] for x in gammas]
        first = next(iter(fs.values()))
        row += [first["respond_ratio"], g["veriscore"]["f1@K_median"], g["hallulens"][f"f1@{hk}"]]
        lines.append("| " + " | ".join(_f(x) for x in row) + " |")
    lines += ["", "SAFE excludes irrelevant claims from P and R and averages over the SAFE n responses with at least",
              "one claim (all irrelevant: F1 = 0, as SAFE's own evaluation counts them); FActScore counts irrelevant",
              "claims as not supported and treats responses",
              "with no claims as abstentions; VeriScore uses each group as its domain (upper-median K).", ""]
    return "\n".join(lines)


def render_plot(records: Sequence[EvalRecord], path: Path) -> None:
    """Scatter of SAFE precision against claims per response, one colour per group (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    groups: dict[str, list[EvalRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    for k, (name, members) in enumerate(groups.items()):
        pts = precision_points(members)
        if pts:
            xs, ys = zip(*pts)
            # Claim counts are integers: shift each group a little so overlapping groups stay visible.
            shift = (k - (len(groups) - 1) / 2) * 0.08
            ax.scatter([x + shift for x in xs], ys, label=name, alpha=0.7)
    ax.set_xlabel("claims per response")
    ax.set_ylabel("precision (S / (S + NS))")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Precision vs. claims per response")
    if len(groups) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with open(path, "wb") as fh:  # explicit handle: the temp name has no .png suffix
        fig.savefig(fh, format="png")
    plt.close(fig)
