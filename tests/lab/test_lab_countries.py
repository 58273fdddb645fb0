"""``nemo-factuality lab --world countries --quick`` on the real SmolLM2-135M-Instruct: a world of 9 real countries,
KLCF on GRPO and FactAlign on KTO, one step each against its reward served on PyTriton, the references, the report
and the audit files (RLFH's PPO, whose critic is a second copy of the model, runs in the full real lab only: it would
add about a third to this module's CI time). The CI size of the real lab (the full run, every
method, is a benchmark: docs/benchmarks.md, Real lab); every method's reward on the countries is checked by hand in
test_countries.py and tests/lab/test_method_rewards.py."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

METHODS = ("klcf", "factalign")  # a run of all six takes ~11 CPU-minutes here

pytest.importorskip("pytriton")
pytest.importorskip("countryinfo")


@pytest.fixture(scope="module")
def countries_run(tmp_path_factory, smollm2_dir):
    from nemo_factuality.cli import main

    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))
    out = tmp_path_factory.mktemp("lab") / "run"
    code = main(["lab", "--world", "countries", "--policy", str(smollm2_dir), "--quick", "--methods", ",".join(METHODS),
                 "--jobs", "2", "--out", str(out)])
    return code, out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_countries_lab_runs_every_method_on_the_real_model(countries_run):
    code, out = countries_run
    assert code == 0 and not (out / "INCOMPLETE").exists()
    report = json.loads((out / "report.json").read_text())
    assert list(report["methods"]) == list(METHODS)
    assert report["config"]["world_name"] == "countries" and report["config"]["trainable"] == "top_layers"
    for name, m in report["methods"].items():
        assert [t["steps"] for t in m["training"]] == [1], name  # one step through the method's own stage
        assert m["training"][0]["stage"] == {"factalign": "kto"}.get(name, "grpo")
        for when in ("before", "after", "before_greedy", "after_greedy", "base_at_t_eff"):
            block = m["heldout"][when]
            assert block["n_responses"] == 3 and set(block["per_tier"]) == {"popular", "medium", "rare"}, (name, when)
        assert m["effective_temperature"] > 0
        assert (out / "seed0" / "checkpoints" / name / "model.safetensors").is_file()
    for key in ("t1", "greedy", "tuned_temperature", "tuned_threshold", "greedy_threshold"):
        assert report["references"][key]["n_responses"] == 3
    assert {"t1", "greedy", "headline"} <= set(report["summary"])
    assert (out / "report.md").read_text().startswith("# Factuality lab")


@pytest.mark.slow
def test_countries_lab_writes_auditable_claims_checked_against_the_store(countries_run):
    from nemo_factuality.lab import countries as C

    _, out = countries_run
    seed = out / "seed0"
    gold = json.loads((seed / "world" / "gold.json").read_text())
    splits = json.loads((seed / "world" / "splits.json").read_text())
    assert len(gold) == 9 and sorted(splits["heldout"] + splits["val"] + splits["rl"]) == sorted(gold)
    claims = [json.loads(line) for line in (seed / "eval" / "heldout_base_greedy" / "claims.jsonl").read_text().splitlines()]
    responses = {json.loads(line)["id"]: json.loads(line)
                 for line in (seed / "eval" / "heldout_base_greedy" / "responses.jsonl").read_text().splitlines()}
    assert {c["response_id"] for c in claims} == set(responses)
    for c in claims:
        if c["claim"] is None:  # a response with no claim
            assert c["label"] == "abstained"
            continue
        response = responses[c["response_id"]]
        assert response["response"][slice(*c["span"])] == c["claim"]
        # the wiring (world files → store → verifier → eval → claims.jsonl): each label is what the country's values in
        # world/gold.json give for the sentence (the reader itself is checked by hand in test_countries.py)
        reading = C.read(c["claim"])
        if c["label"] == "abstained":
            assert reading.abstains
        elif reading is None:
            assert c["label"] == "not_supported"
        else:
            from nemo_factuality.lab.readings import is_correct

            expected = is_correct(reading, gold[response["topic"]][reading.attribute])
            assert c["label"] == ("supported" if expected else "not_supported"), c
