"""``nemo-factuality lab --quick`` end to end: world, KB, pretraining, GRPO against the PyTriton reward, eval, report.

This is the CI run of the lab (under 3 minutes on 2 cores): it checks the run folder, the report
schema the README promises, and the direction of the change the lab exists to show.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

pytest.importorskip("pytriton")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from nemo_factuality.cli import main

    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))
    out = tmp_path_factory.mktemp("lab") / "run"
    code = main(["lab", "--quick", "--seed", "0", "--out", str(out)])
    return code, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_lab_reduces_hallucination_on_heldout_entities(quick_run):
    code, out = quick_run
    report = json.loads((out / "report.json").read_text())
    for split in ("heldout", "rl_prompts"):
        for when in ("before", "after"):
            block = report[split][when]
            assert 0.0 <= block["factscore"] <= 1.0
            assert block["claims_per_response"] > 0
            assert 0.0 <= block["abstain_rate"] <= 1.0
            assert set(block["per_tier"]) == {"popular", "medium", "rare"}
    s = report["summary"]
    assert s["heldout_factscore_gain_points"] == pytest.approx(
        100 * (report["heldout"]["after"]["factscore"] - report["heldout"]["before"]["factscore"]))
    # The direction --quick asserts (the exit code says the same).
    assert s["heldout_factscore_gain_points"] > 0, s
    assert s["heldout_claims_change"] > -0.5, s
    assert code == 0


@pytest.mark.slow
def test_quick_lab_run_folder_holds_every_artefact(quick_run):
    _, out = quick_run
    for rel in ("world/people.jsonl", "world/facts.jsonl", "world/splits.json", "kb.sqlite",
                "checkpoints/base/config.json", "checkpoints/base/tokenizer.json", "checkpoints/rl/config.json",
                "metrics/pretrain.jsonl", "metrics/rl_train.jsonl", "metrics/rl_val.jsonl", "rl/rl/metrics.jsonl",
                "eval/heldout_before/report.json", "eval/heldout_after/report.json", "eval/heldout_greedy/report.json",
                "eval/heldout_threshold/report.json", "eval/rl_prompts_after/responses.jsonl",
                "report.md", "plots/reward_curves.png", "plots/precision_vs_claims.png", "plots/per_tier.png"):
        assert (out / rel).exists(), rel
    val = [json.loads(line) for line in (out / "metrics" / "rl_val.jsonl").read_text().splitlines()]
    assert val[0]["step"] == 0 and len(val) >= 2  # the base policy is validated before any RL step


def test_lab_refuses_a_used_run_folder(tmp_path, capsys):
    from nemo_factuality.cli import main

    (tmp_path / "something").write_text("x")
    assert main(["lab", "--quick", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
