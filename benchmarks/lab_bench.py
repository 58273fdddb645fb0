"""The factuality lab's benchmark: ``nemo-factuality lab`` over several seeds, one process each, with the spread.

    python benchmarks/lab_bench.py --out outputs/lab_bench [--seeds 0,1,2] [--quick] [-- key=value ...]

Target (issue 15): on 2 CPU cores in under 15 minutes per run, held-out FActScore (γ=0) rises by at
least 10 points while claims per response fall by no more than 25%, averaged over 3 seeds. Each run's
wall time and CPU time (the child's user+sys, the honest number on a shared machine) are recorded;
the table goes to ``OUT/bench.md`` and ``OUT/bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path, quick: bool, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "nemo_factuality.cli", "lab", "--seed", str(seed), "--out", str(out / f"seed{seed}")]
    cmd += ["--quick"] if quick else []
    cmd += overrides
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with (out / f"seed{seed}.log").open("w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if code not in (0, 1):  # 1 = --quick's direction check failed; the report is still there
        raise SystemExit(f"seed {seed} failed (exit {code}); see {out / f'seed{seed}.log'}")
    report = json.loads((out / f"seed{seed}" / "report.json").read_text())
    s = report["summary"]
    return {"seed": seed, "wall_s": wall, "cpu_s": cpu,
            "heldout_before": report["heldout"]["before"]["factscore"], "heldout_after": report["heldout"]["after"]["factscore"],
            "heldout_gain_points": s["heldout_factscore_gain_points"], "heldout_claims_change": s["heldout_claims_change"],
            "rl_prompts_gain_points": s["rl_prompts_factscore_gain_points"],
            "rl_prompts_claims_change": s["rl_prompts_claims_change"],
            "greedy_gain_points": 100 * (report["references"]["greedy"]["factscore"] - report["heldout"]["before"]["factscore"]),
            "threshold_gain_points": 100 * (next(v for k, v in report["references"].items() if k.startswith("threshold"))["factscore"]
                                            - report["heldout"]["before"]["factscore"]),
            "rl_steps": report["training"]["rl"]["steps"], "best_step": report["training"]["rl"]["best_step"]}


def _mean_sd(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):+.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{xs[0]:+.1f}"


def table(rows: list[dict]) -> str:
    head = ["seed", "held-out FS before → after", "Δ held-out (pts)", "Δ claims", "Δ RL prompts (pts)", "Δ claims (RL)",
            "greedy Δ", "threshold Δ", "RL steps (best)", "wall s", "CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['seed']} | {100 * r['heldout_before']:.1f} → {100 * r['heldout_after']:.1f} | "
                     f"{r['heldout_gain_points']:+.1f} | {100 * r['heldout_claims_change']:+.0f}% | "
                     f"{r['rl_prompts_gain_points']:+.1f} | {100 * r['rl_prompts_claims_change']:+.0f}% | "
                     f"{r['greedy_gain_points']:+.1f} | {r['threshold_gain_points']:+.1f} | {r['rl_steps']} ({r['best_step']}) | "
                     f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} |")
    col = lambda k, scale=1.0: [scale * r[k] for r in rows]  # noqa: E731
    lines.append(f"| mean ± sd | | {_mean_sd(col('heldout_gain_points'))} | {_mean_sd(col('heldout_claims_change', 100))}% | "
                 f"{_mean_sd(col('rl_prompts_gain_points'))} | {_mean_sd(col('rl_prompts_claims_change', 100))}% | "
                 f"{_mean_sd(col('greedy_gain_points'))} | {_mean_sd(col('threshold_gain_points'))} | | "
                 f"{statistics.fmean(col('wall_s')):.0f} | {statistics.fmean(col('cpu_s')):.0f} |")
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(run_seed(seed, args.out, args.quick, overrides))
        print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    (args.out / "bench.md").write_text(md + "\n", encoding="utf-8")
    (args.out / "bench.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
