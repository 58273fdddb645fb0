"""Human-readable views of an evaluation report: a markdown summary and a precision plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation.report import EvalRecord, precision_points


def _f(x: Any) -> str:
    return "–" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


MAX_CELL_CHARS = 80


def table_cell(name: str) -> str:
    """A group name as one markdown table cell: one line, ``|`` escaped, at most ``MAX_CELL_CHARS`` (report.json keeps it whole)."""
    one_line = " ".join(name[: MAX_CELL_CHARS + 1].split())
    short = one_line if len(one_line) <= MAX_CELL_CHARS else one_line[: MAX_CELL_CHARS - 1] + "…"
    return short.replace("|", "\\|")


def render_markdown(report: dict[str, Any]) -> str:
    """One table row per group with the headline number of each metric."""
    opts = report["options"]
    ks, gammas, hk = opts["k"], opts["gamma"], opts["hallulens_k"]
    head = ["group", "n", "abstained", "claims/resp", "SAFE P"] + [f"F1@{k}" for k in ks]
    head += [f"FActScore γ={g:g}" for g in gammas] + ["respond", "VeriScore F1@Kmed", f"LongWiki F1@{hk}"]
    lines = ["# Factuality evaluation", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, g in report["groups"].items():
        fs = g["factscore"]
        row = [table_cell(name), g["n_records"], g["n_abstained"], g["claims_per_response"], g["safe"]["precision"]]
        row += [g["safe"][f"f1@{k}"] for k in ks]
        row += [fs[f"gamma{int(x) if float(x).is_integer() else x}"]["score"] for x in gammas]
        first = next(iter(fs.values()))
        row += [first["respond_ratio"], g["veriscore"]["f1@K_median"], g["hallulens"][f"f1@{hk}"]]
        lines.append("| " + " | ".join(_f(x) for x in row) + " |")
    lines += ["", "SAFE excludes irrelevant claims; FActScore counts them as not supported and treats responses",
              "with no claims as abstentions; VeriScore uses each group as its domain (upper-median K).", ""]
    return "\n".join(lines)


# Legend cost grows with the number and length of its labels (matplotlib lays out every glyph):
# past these caps groups are drawn together as "other" and names are shortened.
MAX_PLOTTED_GROUPS = 10
MAX_LEGEND_CHARS = 40


def legend_label(name: str) -> str:
    """A group name as a legend entry: one line, at most ``MAX_LEGEND_CHARS``, ``$`` kept literal (no mathtext)."""
    one_line = " ".join(name[: MAX_LEGEND_CHARS + 1].split())
    short = one_line if len(one_line) <= MAX_LEGEND_CHARS else one_line[: MAX_LEGEND_CHARS - 1] + "…"
    return short.replace("$", r"\$")


def plotted_groups(records: Sequence[EvalRecord]) -> list[tuple[str, list[EvalRecord]]]:
    """``(legend label, records)`` per plotted series: the first ``MAX_PLOTTED_GROUPS`` groups (first-seen
    order), then one "other (N groups)" series for the rest."""
    groups: dict[str, list[EvalRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    names = list(groups)
    series = [(legend_label(n), groups[n]) for n in names[:MAX_PLOTTED_GROUPS]]
    rest = names[MAX_PLOTTED_GROUPS:]
    if rest:
        series.append((f"other ({len(rest)} groups)", [r for n in rest for r in groups[n]]))
    return series


def render_plot(records: Sequence[EvalRecord], path: Path) -> None:
    """Scatter of SAFE precision against claims per response, one colour per group (PNG).

    Cost is linear in the number of records whatever the groups: at most ``MAX_PLOTTED_GROUPS`` + 1
    series, legend labels of at most ``MAX_LEGEND_CHARS`` characters.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    series = plotted_groups(records)
    for k, (label, members) in enumerate(series):
        pts = precision_points(members)
        if pts:
            xs, ys = zip(*pts, strict=True)
            # Claim counts are integers: shift each group a little so overlapping groups stay visible.
            shift = (k - (len(series) - 1) / 2) * 0.08
            other = k == MAX_PLOTTED_GROUPS
            ax.scatter([x + shift for x in xs], ys, label=label, alpha=0.7, color="grey" if other else None)
    ax.set_xlabel("claims per response")
    ax.set_ylabel("precision (S / (S + NS))")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Precision vs. claims per response")
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with open(path, "wb") as fh:  # explicit handle: the temp name has no .png suffix
        fig.savefig(fh, format="png")
    plt.close(fig)
