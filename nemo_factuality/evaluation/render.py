"""Human-readable views of an evaluation report: a markdown summary and a precision plot."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

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
    head = ["group", "n", "abstained", "claims/resp", "SAFE n", "SAFE P"] + [f"F1@{k}" for k in ks]
    head += [f"FActScore γ={g:g}" for g in gammas] + ["respond", "VeriScore F1@Kmed", f"LongWiki F1@{hk}"]
    lines = ["# Factuality evaluation", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, g in report["groups"].items():
        fs = g["factscore"]
        row = [table_cell(name), g["n_records"], g["n_abstained"], g["claims_per_response"], g["safe"]["n_items"],
               g["safe"]["precision"]]
        row += [g["safe"][f"f1@{k}"] for k in ks]
        row += [fs[f"gamma{int(x) if float(x).is_integer() else x}"]["score"] for x in gammas]
        first = next(iter(fs.values()))
        row += [first["respond_ratio"], g["veriscore"]["f1@K_median"], g["hallulens"][f"f1@{hk}"]]
        lines.append("| " + " | ".join(_f(x) for x in row) + " |")
    empty = report["groups"].get("all", {}).get("n_empty", 0)
    if empty:
        lines += ["", f"**{empty} of {report['groups']['all']['n_records']} responses are empty** (blank): they count as "
                  "abstentions above; a generation step that produced nothing reads as a model that always abstains."]
    lines += ["", "SAFE excludes irrelevant claims from P and R and averages over the SAFE n responses with at least one",
              "claim (all irrelevant: F1 = 0, as SAFE's own evaluation counts them). FActScore counts irrelevant claims",
              "as not supported and treats responses with no claims as abstentions; VeriScore uses each group as its",
              "domain (upper-median K).", ""]
    return "\n".join(lines)


def _group_records(records: Sequence[EvalRecord]) -> dict[str, list[EvalRecord]]:
    groups: dict[str, list[EvalRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return groups


def point_counts(points: Sequence[tuple[float, float]]) -> Counter:
    """``{(x, y): how many}``: identical points (common with integer claim counts) are drawn once."""
    return Counter((round(x, 6), round(y, 6)) for x, y in points)


def group_label(name: str, members: Sequence[EvalRecord]) -> str:
    """Legend text: group size, abstentions, and responses with no S/NS claim (no precision, so not plotted)."""
    abstained = sum(1 for r in members if not r.claims)
    unplotted = len(members) - abstained - len(precision_points(members))
    return f"{name}: n={len(members)}, {abstained} abstained" + (f", {unplotted} without S/NS" if unplotted else "")


@dataclass
class _Marker:
    """One drawn marker; its count (when > 1) is written on it, or beside it, once the layout is final."""

    ax: Any
    x: float
    y: float
    n: int
    radius_pt: float
    color: Any


def _bubbles(ax, points: list[tuple[float, float]], x_of, color, label: str, area: Callable[[int], float],
             markers_out: list[_Marker]) -> None:
    """One marker per distinct (x, y) with ``area(count)``, each recorded in ``markers_out``."""
    counts = point_counts(points)
    xs = [x_of(x) for x, _ in counts]
    ax.scatter(xs, [y for _, y in counts], s=[area(n) for n in counts.values()], color=color, alpha=0.55,
               edgecolors="black", linewidths=0.5, label=label)
    markers_out += [_Marker(ax, x_of(x), y, n, math.sqrt(area(n)) / 2, color) for (x, y), n in counts.items()]


# Where a count goes when its marker's centre is taken (by another count, or by a neighbouring marker that
# overlaps this one): above, below, right, left, the corners, each just outside the marker (offsets in units
# of its radius + a gap), then the same eight spots twice as far out.
_RING = ((0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (-1, 1), (1, -1), (-1, -1))
_LABEL_SPOTS = ((0, 0), *_RING, *((2 * dx, 2 * dy) for dx, dy in _RING))


@dataclass(frozen=True)
class _Disc:
    """A marker's circle in pixels: a count may sit on its own marker and on no other."""

    x: float
    y: float
    r: float

    def hits(self, box) -> bool:
        nearest_x, nearest_y = min(max(self.x, box.x0), box.x1), min(max(self.y, box.y0), box.y1)
        return (nearest_x - self.x) ** 2 + (nearest_y - self.y) ** 2 < self.r**2

    @property
    def extents(self) -> tuple[float, float, float, float]:
        return self.x - self.r, self.y - self.r, self.x + self.r, self.y + self.r


class _BoxGrid:
    """What a count must not overprint (the counts written so far, every marker, the mean bars), bucketed in a
    pixel grid: an overlap test looks at a few cells, so placing N counts costs O(N), not O(N²)."""

    def __init__(self, cell: float = 32.0) -> None:
        self.cell, self.cells = cell, {}

    def _keys(self, extents) -> list[tuple[int, int]]:
        c, (x0, y0, x1, y1) = self.cell, extents
        return [(i, j) for i in range(int(x0 // c), int(x1 // c) + 1) for j in range(int(y0 // c), int(y1 // c) + 1)]

    def overlaps(self, box, own: _Disc | None = None) -> bool:
        """Does ``box`` touch anything but ``own`` (the count's own marker)?"""
        return any(other is not own and (other.hits(box) if isinstance(other, _Disc) else box.overlaps(other))
                   for key in self._keys(box.extents) for other in self.cells.get(key, ()))

    def add(self, item) -> None:
        for key in self._keys(item.extents):
            self.cells.setdefault(key, []).append(item)


def _disc(fig, m: _Marker) -> _Disc:
    x, y = m.ax.transData.transform((m.x, m.y))
    return _Disc(float(x), float(y), m.radius_pt * fig.dpi / 72)


def _bar_box(ax, x0: float, x1: float, y: float) -> Any:
    from matplotlib.transforms import Bbox

    return Bbox(ax.transData.transform([(x0, y), (x1, y)])).padded(1)  # the bar is 2 pt thick


class WrittenCount(NamedTuple):
    text: str
    box: tuple[float, float, float, float]  # pixels (x0, y0, x1, y1)
    marker: int  # the index of its marker in ``PlotLayout.markers``


class PlotLayout(NamedTuple):
    """Where ``render_plot`` put things, in pixels (origin bottom left)."""

    counts: list[WrittenCount]
    markers: list[tuple[float, float, float]]  # each marker's circle (x, y, radius)
    bars: list[tuple[float, float, float, float]]  # each mean bar's box


def _write_counts(fig, markers: list[_Marker], discs: list[_Disc], bars: list[Any]) -> tuple[list[WrittenCount], int]:
    """Write each count > 1 on its marker, or just outside it where that would overprint another count, another
    marker or a mean bar (largest counts first); a count with no free spot inside its axes is left out. ``discs``:
    each marker's circle, ``bars``: each mean bar's pixel box. Returns the written counts and how many were left
    out."""
    renderer = fig.canvas.get_renderer()
    grid, written, left_out = _BoxGrid(), [], 0
    for obstacle in (*discs, *bars):
        grid.add(obstacle)
    for index in sorted((i for i, m in enumerate(markers) if m.n > 1), key=lambda i: -markers[i].n):
        m, own = markers[index], discs[index]
        inside = m.ax.get_window_extent(renderer)
        for dx, dy in _LABEL_SPOTS:
            gap = m.radius_pt + 5
            text = m.ax.annotate(str(m.n), (m.x, m.y), xytext=(dx * gap, dy * gap), textcoords="offset points",
                                 ha="center", va="center", fontsize=7, color="black" if (dx, dy) == (0, 0) else m.color)
            box = text.get_window_extent(renderer).padded(2)  # >= 4 px between two counts
            if not grid.overlaps(box, own) and inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1):
                grid.add(box)
                written.append(WrittenCount(str(m.n), tuple(box.extents), index))
                break
            text.remove()
        else:
            left_out += 1
    return written, left_out


# Legend cost grows with the number and length of its labels (matplotlib lays out every glyph):
# past these caps groups are drawn together as "other" and names are shortened.
MAX_PLOTTED_GROUPS = 10
MAX_LEGEND_CHARS = 40
MAX_AREA_COUNT = 14  # above this many responses at one point, marker areas are scaled down to keep the largest this big


def legend_label(name: str) -> str:
    """A group name as a legend entry: one line, at most ``MAX_LEGEND_CHARS``, ``$`` kept literal (no mathtext)."""
    one_line = " ".join(name[: MAX_LEGEND_CHARS + 1].split())
    short = one_line if len(one_line) <= MAX_LEGEND_CHARS else one_line[: MAX_LEGEND_CHARS - 1] + "…"
    return short.replace("$", r"\$")


def plotted_groups(records: Sequence[EvalRecord]) -> list[tuple[str, list[EvalRecord]]]:
    """``(shortened name, records)`` per plotted series: the first ``MAX_PLOTTED_GROUPS`` groups (first-seen
    order), then one "other (N groups)" series for the rest."""
    groups = _group_records(records)
    names = list(groups)
    series = [(legend_label(n), groups[n]) for n in names[:MAX_PLOTTED_GROUPS]]
    rest = names[MAX_PLOTTED_GROUPS:]
    if rest:
        series.append((f"other ({len(rest)} groups)", [r for n in rest for r in groups[n]]))
    return series


def render_plot(records: Sequence[EvalRecord], path: Path) -> PlotLayout:
    """Two panels (PNG): SAFE precision per group (distribution + mean) and precision vs. claims per response.

    Identical points are drawn once, sized by and labelled with their count; the legend gives each group's
    size and how many responses abstained or had no supported/not-supported claim (not plotted: no precision).
    Counts never overprint each other, another marker or a mean bar (one that would is written beside its
    marker); returns where the counts, markers and bars went (``PlotLayout``). Cost is linear in the number of
    records whatever the groups: at most ``MAX_PLOTTED_GROUPS`` + 1 series (the rest drawn together, in grey), names of at most
    ``MAX_LEGEND_CHARS`` characters.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    series = plotted_groups(records)
    colors = plt.get_cmap("tab10").colors
    fig, (dist, scatter) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100, gridspec_kw={"width_ratios": [1, 1.3]})
    # marker area grows with the count up to MAX_AREA_COUNT responses, then the scale shrinks to keep the largest there
    largest = max([n for _, members in series for n in point_counts([(0, y) for _, y in precision_points(members)]).values()]
                  or [1])
    scale = min(1.0, MAX_AREA_COUNT / largest)

    def area(n: int) -> float:
        return 40 + 25 * n * scale

    markers: list[_Marker] = []
    bars: list[tuple[float, float, float]] = []  # the distribution panel's mean bars: (x0, x1, y)
    # claim counts are integers: groups sit side by side within ±0.3 of theirs
    spacing = min(0.25, 0.6 / (len(series) - 1)) if len(series) > 1 else 0.0
    for k, (name, members) in enumerate(series):
        pts = precision_points(members)
        label = group_label(name, members)
        color = "grey" if k == MAX_PLOTTED_GROUPS else colors[k % len(colors)]
        _bubbles(dist, [(k, y) for _, y in pts], lambda x: x, color, label, area, markers)
        if pts:
            mean = sum(y for _, y in pts) / len(pts)
            dist.hlines(mean, k - 0.3, k + 0.3, color=color, linewidth=2)
            bars.append((k - 0.3, k + 0.3, mean))
        shift = (k - (len(series) - 1) / 2) * spacing
        _bubbles(scatter, pts, lambda x, s=shift: x + s, color, label, area, markers)
    dist.set_xticks(range(len(series)), [name for name, _ in series], rotation=20)
    dist.set_xlim(-0.6, len(series) - 0.4)
    claim_counts = sorted({len(r.claims) for r in records if r.claims})
    if len(claim_counts) <= 12:  # few distinct counts: tick exactly those
        scatter.set_xticks(claim_counts)
    dist.set_ylabel("SAFE precision S / (S + NS)")
    dist.set_title("Precision per group (bar = mean)")
    scatter.set_xlabel("claims per response")
    scatter.set_title("Precision vs. claims per response")
    for ax in (dist, scatter):
        ax.set_ylim(-0.12, 1.12)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], marker="o", linestyle="", color="grey" if k == MAX_PLOTTED_GROUPS else colors[k % len(colors)],
                      alpha=0.55, label=label)
               for k, label in enumerate(scatter.get_legend_handles_labels()[1])]  # fixed-size markers in the legend
    fig.legend(handles=handles, loc="lower center", ncol=min(3, max(1, len(handles))), fontsize=8, frameon=False)
    note = fig.text(0.5, 0.955, "marker area and number = responses at that point", ha="center", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    # after the layout: positions are final
    discs, bar_boxes = [_disc(fig, m) for m in markers], [_bar_box(dist, *b) for b in bars]
    written, left_out = _write_counts(fig, markers, discs, bar_boxes)
    if left_out:
        note.set_text(f"{note.get_text()} ({left_out} crowded counts not written: see report.json)")
    with open(path, "wb") as fh:  # explicit handle: the temp name has no .png suffix
        fig.savefig(fh, format="png")
    plt.close(fig)
    return PlotLayout(written, [(d.x, d.y, d.r) for d in discs], [tuple(b.extents) for b in bar_boxes])
