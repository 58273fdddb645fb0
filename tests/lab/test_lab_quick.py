"""``nemo-factuality lab --quick --methods all`` end to end: the world, KB, pretraining, every method through its
own stage against its reward served on PyTriton, the evaluations and the report.

This is the CI run of the lab (a few minutes on 2 cores, two worker processes): it checks the run folder,
the report schema the README promises, and the direction each method's training must move held-out FActScore.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile

import pytest

from nemo_factuality.lab.methods import GROUPS

pytest.importorskip("pytriton")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The command's run, its stdout and stderr kept in files beside it, fd1.log and fd2.log: file descriptors 1 and
    2 (its worker processes write there), and — since pytest's capture replaces them, so a print() never reaches
    fd 1 — ``sys.stdout`` and ``sys.stderr`` too, and for its own process's logging (which pytest's log handlers
    would take, the command's ``basicConfig`` then doing nothing) a handler on the root logger writing to fd2.log."""
    from nemo_factuality.cli import main

    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))
    out = tmp_path_factory.mktemp("lab") / "run"
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    # line-buffered, so the Python-level lines and what the processes write to the descriptors (the same open file,
    # so one offset) keep their order
    sinks = {fd: open(out.parent / f"fd{fd}.log", "w", buffering=1, encoding="utf-8") for fd in (1, 2)}  # closed below
    root, handler = logging.getLogger(), logging.StreamHandler(sinks[2])
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))  # the command's format
    level = root.level
    try:
        for fd, sink in sinks.items():
            os.dup2(sink.fileno(), fd)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        with contextlib.redirect_stdout(sinks[1]), contextlib.redirect_stderr(sinks[2]):
            code = main(["lab", "--quick", "--methods", "all", "--jobs", "2", "--out", str(out)])
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for fd, sink in sinks.items():
            sink.flush()
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            sink.close()
    return code, out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_lab_trains_every_method_in_the_right_direction(quick_run):
    code, out = quick_run
    report = json.loads((out / "report.json").read_text())
    assert list(report["methods"]) == list(GROUPS["all"])
    for name, m in report["methods"].items():
        for split, whens in (("heldout", ("before", "after", "before_greedy", "after_greedy", "base_at_t_eff")),
                             ("rl_prompts", ("before", "after")), ("validation", ("before", "after"))):
            for when in whens:
                block = m[split][when]
                assert 0.0 <= block["factscore"] <= 1.0 and 0.0 <= block["abstain_rate"] <= 1.0, (name, split, when)
                assert set(block["per_tier"]) == {"popular", "medium", "rare"}
        gain = m["gain"]["t1"]["mean"]
        assert gain == pytest.approx(100 * (m["heldout"]["after"]["factscore"] - m["heldout"]["before"]["factscore"]))
        # each method trained on its own reward: held-out FActScore at T=1 rose and claims did not collapse
        assert gain > 0, (name, gain)
        assert m["heldout"]["after"]["claims_per_response"] > 0.5 * m["heldout"]["before"]["claims_per_response"], name
        samples = {t["policy_samples_budget"] for t in m["training"]}
        assert samples == {1920}, (name, samples)  # the same number of policy samples for every method
        assert m["effective_temperature"] > 0
    for key in ("t1", "greedy", "tuned_temperature", "tuned_threshold", "greedy_threshold"):
        assert 0.0 <= report["references"][key]["factscore"] <= 1.0
        assert 0.0 <= report["references"]["validation"][key]["factscore"] <= 1.0  # what the best reference is picked on
    assert set(report["summary"]) >= {"t1", "greedy", "aim_met", "against_base", "headline"}
    assert code == 0  # --quick's own direction check agrees


@pytest.mark.slow
def test_quick_lab_report_opens_with_the_answers_and_the_seed(quick_run):
    """What the command prints (its report.md) opens with: what one seed can tell (the margins' intervals are a
    paired bootstrap over the held-out people, not the seed-to-seed spread), did training reduce hallucination
    against the base at the same decoding, did it beat the no-training references, and that seed 0 is the
    development seed. Every margin's verdict is its interval's."""
    _, out = quick_run
    lines = [line for line in (out / "report.md").read_text().splitlines() if line.strip()]
    assert lines[1].startswith("**What one seed can tell:** each margin comes with a 95% paired bootstrap interval "
                               "[in brackets] over the 30 held-out people")
    assert lines[2].startswith("**Did training reduce hallucination (raise held-out FActScore) against the base at the "
                               "same decoding?** At T=1: ")
    assert lines[3].startswith("**Did it beat the no-training references?**")
    assert lines[4].startswith("**Seed 0 is the development seed**")
    assert "| *base, greedy + tuned threshold* |" in (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())
    people = report["references"]["per_person"]["t1"][0]  # seed 0's held-out people, paired with every method's
    assert len(people) == 30 and report["summary"]["heldout_entities"] == [30]
    assert sum(p["score_sum"] for p in people.values()) / sum(p["responding"] for p in people.values()) == pytest.approx(
        report["references"]["t1"]["factscore"])
    expected = {(True, False): "beats", (False, True): "falls behind", (False, False): "within noise"}
    for decoding in ("t1", "greedy"):
        for name, m in report["summary"]["against_base"][decoding].items():
            low, high = m["interval"]
            assert low <= high and m["verdict"] == expected[(low > 0, high < 0)], (decoding, name, m)


@pytest.mark.slow
def test_quick_lab_run_folder_holds_every_artefact(quick_run):
    _, out = quick_run
    seed = out / "seed0"
    for rel in ("world/people.jsonl", "world/facts.jsonl", "world/splits.json", "kb.sqlite", "klcf_checklists.json",
                "checkpoints/base/config.json", "checkpoints/base/tokenizer.json", "report.json",
                "metrics/pretrain.jsonl", "eval/heldout_base/report.json", "eval/heldout_base_greedy/report.json",
                "eval/heldout_base_tuned_threshold/report.json", "eval/heldout_base_tuned_temperature/report.json",
                "eval/heldout_base_greedy_threshold/report.json",
                "eval/rl_prompts_base/responses.jsonl"):
        assert (seed / rel).exists(), rel
    for name in GROUPS["all"]:
        for rel in (f"checkpoints/{name}/config.json", f"metrics/{name}_val.jsonl", f"rl/{name}/metrics.jsonl",
                    f"rl/{name}/triton.log", f"eval/heldout_{name}/report.json", f"eval/heldout_{name}_greedy/report.json"):
            assert (seed / rel).exists(), rel
        val = [json.loads(line) for line in (seed / "metrics" / f"{name}_val.jsonl").read_text().splitlines()]
        assert val[0]["step"] == 0 and len(val) >= 2  # the base policy is validated before any training step
    for rel in ("report.md", "plots/methods.png", "plots/precision_vs_claims.png", "plots/per_tier.png",
                "plots/validation_curves.png"):
        assert (out / rel).exists(), rel
    assert "| **factalign** (kto) |" in (out / "report.md").read_text()


@pytest.mark.slow
def test_quick_lab_says_where_it_wrote_and_how_far_each_method_got(quick_run):
    """Issue 54 item 6: the run ends naming report.md, report.json and plots/ (before: the report alone, no path), and
    each method's validation line says "step 5/30" (before: "step 5", with no end in sight)."""
    _, out = quick_run
    printed = (out.parent / "fd1.log").read_text().strip().splitlines()
    assert printed[-1].startswith(f"wrote {out / 'report.md'}, {out / 'report.json'} and the plots in {out / 'plots'}/")
    logged = (out.parent / "fd2.log").read_text()
    for name, total in (("klcf", 30), ("rlfh", 30), ("factalign", 32)):  # conf/lab/*_quick.yaml's trainer.max_steps
        assert f"seed 0: {name}: validation at step 0/{total}:" in logged, (name, logged[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_getting_started_recipe_learns_on_this_runs_base(quick_run, tmp_path):
    """Before: the only offline recipe trained a random policy whose reward stayed 0.0000. The getting-started page's
    first train command (read from the page), run as written with ``$B`` this
    run's ``seed0`` (the base, store and RL prompts its first command builds): KnowRL's stage, 30 steps; its reward
    over the last ten steps is above the first ten's."""
    from nemo_factuality.testing.doc_recipes import recipe_blocks, train_commands

    _, out = quick_run
    first, _ = recipe_blocks()
    (argv,) = train_commands(first, {"B": str(out / "seed0")})
    run_dir = tmp_path / "knowrl"
    argv = [w if not w.startswith("exp_manager.explicit_log_dir=") else f"exp_manager.explicit_log_dir={run_dir}"
            for w in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_FACTUALITY_DEBUG")}
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "train", *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/score"] for r in rows if "reward/score" in r]
    assert len(rewards) == 30 and all(math.isfinite(r) for r in rewards), rewards
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, rewards
    assert "training finished at step 30" in res.stderr and (run_dir / "final" / "config.json").is_file()
