"""Worst-case input cost per stage: time vs input size, now and with the code issue 17 replaced.

Each stage gets the degenerate input that made it quadratic (repetitive text is normal early in RL),
at sizes doubling from a base. ``x2`` is the time ratio per doubling: about 2 is linear, about 4
quadratic. The baseline is the replaced algorithm, kept here verbatim in behaviour and run in the
same process on the same inputs; it stops at the first size past ``--baseline-cap-s``.

    python benchmarks/robustness_bench.py [--doublings 4] [--baseline-cap-s 5] [--stages segment,brackets,...]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation import render
from nemo_factuality.evaluation.report import EvalOptions, EvalRecord, build_report, parse_record
from nemo_factuality.judge import parsers
from nemo_factuality.text import segment
from nemo_factuality.text.alignment import align_tokens

# ------------------------------------------------------------------ the replaced algorithms (baselines)


def _old_is_abbreviation(text: str, period_index: int) -> bool:
    m = re.search(r"([A-Za-z][A-Za-z.]*)$", text[:period_index])  # the whole prefix at every period
    if not m:
        return False
    word = m.group(1).lower()
    return word in segment._ABBREVIATIONS or (len(word) == 1 and text[m.start(1)].isupper())


def _old_segment(text: str) -> Any:
    current, segment._is_abbreviation = segment._is_abbreviation, _old_is_abbreviation
    try:
        return _SEGMENTER.split(text)
    finally:
        segment._is_abbreviation = current


_OLD_BRACKET = re.compile(r"\[(.*?)\]", re.DOTALL)


def _old_safe_rating(text: str) -> Any:
    return [c for c in reversed(_OLD_BRACKET.findall(text))]  # the findall is the whole cost


def _old_align(tokenizer: Any, text: str, ids: list[int]) -> list[tuple[int, int]]:
    offsets, prev_end = [], 0
    for i in range(len(ids)):  # every prefix decoded
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        complete = prefix if text.startswith(prefix) else prefix.rstrip("\ufffd")
        end = max(len(complete), prev_end)
        offsets.append((prev_end, end))
        prev_end = end
    return offsets


def _old_render_plot(records: list[EvalRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    groups: dict[str, list[EvalRecord]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    for name, members in groups.items():  # every group its own series and full-length legend label
        xs, ys = zip(*render.precision_points(members), strict=True)
        ax.scatter(xs, ys, label=name, alpha=0.7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with open(path, "wb") as fh:
        fig.savefig(fh, format="png")
    plt.close(fig)


# ------------------------------------------------------------------------------------ stages


def _tiny_tokenizer() -> Any:
    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    return build_tiny_tokenizer()


_SEGMENTER = segment.RegexSegmenter(max_chars=10**8)  # sizes past the default max_chars show the trend


def stage_segment(n: int) -> tuple[str, tuple]:
    return f"'A. ' * {n}", ("A. " * n,)


def stage_brackets(n: int) -> tuple[str, tuple]:
    return f"'[' * {n}", ("[" * n,)


def _align_input(tokenizer: Any, n_chars: int) -> tuple[str, list[int]]:
    text = ("naïve café 🙂 東京 Paris. " * (n_chars // 24 + 1))[:n_chars]
    text = text[:-1] if text and text[-1] == "\ufffd" else text
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]  # not a re-tokenisation
    return text, ids


def _plot_input(n_chars: int) -> list[EvalRecord]:
    return [EvalRecord(str(i), "p", "r", (("c", "supported"),), ("x" if i else "y") * n_chars) for i in range(2)]


def _eval_input(n: int) -> list[dict]:
    return [{"id": i, "prompt": "p", "response": "r", "claims": [{"text": "c", "label": "supported"}] * 3, "g": f"g{i % 7}"}
            for i in range(n)]


def _eval_run(raws: list[dict]) -> Any:
    recs = [parse_record(r, where=f"in.jsonl:{i}", group_by="g") for i, r in enumerate(raws)]
    return build_report(recs, EvalOptions())


def _best_of(fn: Callable[..., Any], args: tuple, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def run_stage(name: str, sizes: list[int], make: Callable[[int], tuple[str, tuple]], new: Callable, old: Callable | None,
              cap_s: float) -> None:
    print(f"\n== {name}")
    print(f"{'input':<30} {'now (ms)':>10} {'x2':>6} {'before (ms)':>12} {'x2':>6}")
    prev_new = prev_old = None
    old_live = old is not None
    for n in sizes:
        label, args = make(n)
        t_new = _best_of(new, args, 3)
        t_old = None
        if old_live:
            t_old = _best_of(old, args, 1)
            old_live = t_old < cap_s
        ratio = lambda t, p: f"{t / p:6.2f}" if t is not None and p else "     –"  # noqa: E731
        before = "" if t_old is None else f"{t_old * 1e3:12.1f}"
        print(f"{label:<30} {t_new * 1e3:10.2f} {ratio(t_new, prev_new)} {before:>12} {ratio(t_old, prev_old)}")
        prev_new, prev_old = t_new, t_old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doublings", type=int, default=4, help="sizes: base, 2*base, ... (this many doublings)")
    ap.add_argument("--baseline-cap-s", type=float, default=5.0, help="stop the baseline after a run this long")
    ap.add_argument("--stages", default="segment,brackets,hallulens,align,plot,eval")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    sizes = lambda base: [base * 2**k for k in range(args.doublings + 1)]  # noqa: E731
    if "segment" in stages:
        run_stage("segmentation: RegexSegmenter().split", sizes(4000), stage_segment, _SEGMENTER.split,
                  _old_segment, args.baseline_cap_s)
    if "brackets" in stages:
        run_stage("judge reply: parse_safe_rating (unclosed brackets)", sizes(50_000), stage_brackets,
                  parsers.parse_safe_rating, _old_safe_rating, args.baseline_cap_s)
    if "hallulens" in stages:
        run_stage("judge reply: parse_verdict_compat('hallulens') (before: RecursionError past ~1000)", sizes(50_000),
                  stage_brackets, lambda t: parsers.parse_verdict_compat("hallulens", t), None, args.baseline_cap_s)
    if "align" in stages:
        tok = _tiny_tokenizer()
        cache: dict[int, tuple] = {}

        def make_align(n: int) -> tuple[str, tuple]:
            cache[n] = cache.get(n) or (tok, *_align_input(tok, n))
            return f"{len(cache[n][2])} ids ({n} chars)", cache[n]

        run_stage("token alignment: align_tokens, ids ≠ re-tokenisation", sizes(1000), make_align, align_tokens,
                  _old_align, args.baseline_cap_s)
    if "plot" in stages:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "p.png"
            render.render_plot(_plot_input(1), out)  # import matplotlib outside the timings
            run_stage("eval plot: render_plot, 2 groups with long names", sizes(2000),
                      lambda n: (f"group names of {n} chars", (_plot_input(n), out)), render.render_plot,
                      _old_render_plot, args.baseline_cap_s)
    if "eval" in stages:
        run_stage("eval: parse_record + build_report (7 groups)", sizes(2000),
                  lambda n: (f"{n} records", (_eval_input(n),)), _eval_run, None, args.baseline_cap_s)


if __name__ == "__main__":
    main()
