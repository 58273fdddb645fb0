"""The factuality lab's benchmarks: the methods bake-off over seeds, and the lab on a busy machine.

    python benchmarks/lab_bench.py --out outputs/lab_bench [--seeds 0,1,2] [--methods all] [--quick] [-- key=value ...]
    python benchmarks/lab_bench.py --out outputs/lab_busy --busy [--busy-steps 10]

**Bake-off** (issue 25): one ``nemo-factuality lab`` process over the seeds. Targets: every method on 3 seeds in
under 60 minutes on 2 CPU cores; each method's held-out FActScore gain at matched decoding (T=1 and greedy)
with its spread over seeds; aim: the best method beats the best no-training reference at the same decoding.
Prints and writes ``OUT/bench.md`` / ``bench.json``: per method the gains, the references, the learned-temperature
check, and the run's wall and CPU time (the child's user+sys: the honest number on a shared machine), with the
``uptime`` load before and after.

**Busy machine** (``--busy``): the same short lab run (``--quick --methods slots``, ``trainer.max_steps``
= ``--busy-steps``) with torch's default thread pool (``--threads 2`` on 2 cores: what the lab used before)
and with the lab's sizing (``--threads 1``), each alone and beside one other CPU-bound process (a
``while True: pass`` this script starts and kills by PID). Prints seconds per pretraining step and per GRPO
step, and each setting's slowdown from sharing the machine (target: about 2×, not 8×).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from nemo_factuality.lab.report import GREEDY_REFERENCES


def load() -> str:
    """The 1-, 5- and 15-minute load averages (``uptime``)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_lab(out: Path, args: list[str]) -> dict:
    """``nemo-factuality lab --out OUT ARGS`` in its own process: exit code, wall, CPU (user+sys) and the report."""
    cmd = [sys.executable, "-m", "nemo_factuality.cli", "lab", "--out", str(out), *args]
    before, start, load_before = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic(), load()
    with (out.parent / f"{out.name}.log").open("w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if code not in (0, 1):  # 1 = --quick's direction check failed; the report is still there
        raise SystemExit(f"lab failed (exit {code}); see {out.parent / f'{out.name}.log'}")
    report = json.loads((out / "report.json").read_text())
    return {"exit": code, "wall_s": wall, "cpu_s": cpu, "load_before": load_before, "load_after": load(), "report": report}


# ---------------------------------------------------------------------------------------------- bake-off
def _pm(g: dict) -> str:
    interval = g.get("interval")
    return (f"{g['mean']:+.1f}" + (f" ± {g['sd']:.1f}" if g.get("sd") is not None else "")
            + (f" [{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else ""))


def _fs(block: dict, sd: dict | None = None) -> str:
    text = f"{100 * block['factscore']:.1f}"
    return text + (f" ± {100 * sd['factscore']:.1f}" if sd and sd.get("factscore") is not None else "")


def bakeoff_table(run: dict) -> str:
    r = run["report"]
    refs, methods, s = r["references"], r["methods"], r["summary"]
    head = ["policy", "FS T=1", "Δ T=1", "FS greedy", "Δ greedy", "claims T=1", "abstain T=1", "T_eff", "Δ over base@T_eff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in (("t1", "base T=1"), ("greedy", "base greedy"), ("tuned_temperature", "base tuned T"),
                       ("tuned_threshold", "base T=1 + tuned τ"), ("greedy_threshold", "base greedy + tuned τ")):
        b, greedy = refs[key], key in GREEDY_REFERENCES
        cells = [label, "" if greedy else _fs(b, refs["sd"][key]), "", _fs(b, refs["sd"][key]) if greedy else "", "",
                 f"{b['claims_per_response']:.2f}", f"{100 * b['abstain_rate']:.0f}%", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    for name, m in methods.items():
        h, sd = m["heldout"], m["sd"]["heldout"]
        cells = [name, _fs(h["after"], sd["after"]), _pm(m["gain"]["t1"]), _fs(h["after_greedy"], sd["after_greedy"]),
                 _pm(m["gain"]["greedy"]), f"{h['after']['claims_per_response']:.2f}", f"{100 * h['after']['abstain_rate']:.0f}%",
                 f"{m['effective_temperature']:.2f}", _pm(m["gain"]["over_base_at_t_eff"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"aim (the best method beats the best no-training reference at the same decoding, both picked on "
              f"validation, its 95% paired bootstrap interval over held-out people above 0): "
              f"T=1 {_pm(s['t1']['margin'])} ({s['t1']['best_method']} vs {s['t1']['best_reference']}, {s['t1']['margin']['verdict']}), "
              f"greedy {_pm(s['greedy']['margin'])} ({s['greedy']['best_method']} vs {s['greedy']['best_reference']}, "
              f"{s['greedy']['margin']['verdict']}): {'met' if s['aim_met'] else 'not met'}",
              f"time: {run['wall_s'] / 60:.1f} min wall (target < 60), {run['cpu_s'] / 60:.1f} min CPU; load before "
              f"{run['load_before']}, after {run['load_after']}; exit {run['exit']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- busy machine
@contextlib.contextmanager
def busy_process(on: bool) -> Iterator[None]:
    """One other CPU-bound process for the duration (started here and killed by its PID)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def per_step(run: dict, steps: int) -> dict[str, float]:
    t = run["report"]["timings"]
    pre = next(v for k, v in t.items() if k.endswith(": pretrain"))
    train = next(v for k, v in t.items() if k.endswith(": slots: train"))
    pre_steps = run["report"]["config"]["pretrain_steps"]
    return {"pretrain_s_per_step": pre["wall_s"] / pre_steps, "grpo_s_per_step": train["wall_s"] / steps,
            "total_wall_s": run["wall_s"], "total_cpu_s": run["cpu_s"]}


def busy(out: Path, steps: int) -> str:
    rows = {}
    for threads in (2, 1):
        for other in (False, True):
            name = f"threads{threads}_{'busy' if other else 'alone'}"
            with busy_process(other):
                run = run_lab(out / name, ["--quick", "--methods", "slots", "--jobs", "1", "--threads", str(threads),
                                           f"trainer.max_steps={steps}", "trainer.val_check_interval=0"])
            rows[name] = {**per_step(run, steps), "load_before": run["load_before"], "load_after": run["load_after"]}
            print(name, json.dumps(rows[name]), flush=True)
    lines = ["| torch threads | other CPU-bound process | pretrain s/step | GRPO s/step | whole run wall s | CPU s | load before → after |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        threads, other = name.split("_")
        lines.append(f"| {threads.removeprefix('threads')} | {'yes' if other == 'busy' else 'no'} | {r['pretrain_s_per_step']:.3f} | "
                     f"{r['grpo_s_per_step']:.2f} | {r['total_wall_s']:.0f} | {r['total_cpu_s']:.0f} | {r['load_before']} → {r['load_after']} |")
    for threads in (2, 1):
        a, b = rows[f"threads{threads}_alone"], rows[f"threads{threads}_busy"]
        lines.append(f"\nthreads {threads}: sharing the machine costs {b['pretrain_s_per_step'] / a['pretrain_s_per_step']:.1f}× "
                     f"(pretraining), {b['grpo_s_per_step'] / a['grpo_s_per_step']:.1f}× (GRPO), "
                     f"{b['total_wall_s'] / a['total_wall_s']:.1f}× (whole run)")
    (out / "busy.json").write_text(json.dumps(rows, indent=2))
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default="all")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--busy", action="store_true", help="measure the thread sizing on a busy machine instead")
    p.add_argument("--busy-steps", type=int, default=10)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.busy:
        md = busy(args.out, args.busy_steps)
    else:
        lab_args = ["--seeds", args.seeds, "--methods", args.methods, *(["--quick"] if args.quick else []),
                    *(["--jobs", str(args.jobs)] if args.jobs else []), *overrides]
        run = run_lab(args.out / "run", lab_args)
        md = bakeoff_table(run)
        (args.out / "bench.json").write_text(json.dumps({k: v for k, v in run.items() if k != "report"}, indent=2))
        per_seed = {m: v["gain"] for m, v in run["report"]["methods"].items()}
        print(json.dumps(per_seed), flush=True)
    (args.out / ("busy.md" if args.busy else "bench.md")).write_text(md + "\n", encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
