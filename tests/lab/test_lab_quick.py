"""``nemo-factuality lab --quick --methods all`` end to end: the world, KB, pretraining, every method through its
own stage against its reward served on PyTriton, the evaluations and the report.

This is the CI run of the lab (a few minutes on 2 cores, two worker processes): it checks the run folder,
the report schema the README promises, and the direction each method's training must move held-out FActScore.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from nemo_factuality.lab.methods import GROUPS

pytest.importorskip("pytriton")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from nemo_factuality.cli import main

    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))
    out = tmp_path_factory.mktemp("lab") / "run"
    code = main(["lab", "--quick", "--methods", "all", "--jobs", "2", "--out", str(out)])
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
    assert len(people) == 30 and report["summary"]["heldout_people"] == [30]
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
