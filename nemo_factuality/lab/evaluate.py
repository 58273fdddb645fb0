"""Lab evaluation through ``nemo-factuality eval``: sample → label with the pipeline → score → lab summary.

For one policy and one set of entities, in either world (``lab/worlds.py``):

1. sample ``n`` responses per entity (T=1; or greedy; or T=1 with the decode-time confidence
   threshold: a sentence whose confidence is below tau is declined — on the synthetic world its value becomes
   ``unknown``, on the countries "I don't know the <attribute> of <country>.");
2. label every sentence with the eval pipeline and the world's verifier (identity claims → ``kb_exact``, or the
   countries' ``CountryVerifier``), as ``nemo-factuality eval --config-name demo_kb`` does (``label_with_pipeline``);
3. take abstention sentences out of the claims (the verifier labels them IRRELEVANT; they assert nothing, so they
   are neither supported nor hallucinated; a response of abstentions only is an abstained response) into the
   records' ``abstentions``, and run the ``nemo-factuality eval`` command on the labelled records grouped by
   popularity tier (its ``report.json``, ``report.md``, ``claims.jsonl`` and plot land in the eval folder);
4. summarise: FActScore (γ=0, 0–1), SAFE F1@K (K = the world's slots, ``LabWorld.slots``: 6 for a bio, 4 for a
   country's profile) and precision, claims and hallucinated (not supported) claims per
   responding response, abstain rate (abstained sentences / all sentences), per tier; ``run_eval`` adds each
   entity's FActScore terms (``per_person``), which the report pairs between a method and its baseline
   (``lab/bootstrap.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_factuality.evaluation.cli import EvalConfig, label_with_pipeline
from nemo_factuality.lab.policy import Sample, sample
from nemo_factuality.lab.worlds import LabWorld, abstain_response, get_world

log = logging.getLogger(__name__)

SYNTHETIC = get_world("synthetic")


def apply_threshold(s: Sample, tau: float, world: LabWorld = SYNTHETIC, entity: str = "") -> str:
    """The response with every sentence whose confidence is below ``tau`` declined (``worlds.abstain_response``)."""
    return abstain_response(world, s.response, entity, s.value_probs, tau)


def sample_records(model: Any, tokenizer: Any, records: Sequence[Any], *, n: int = 1, greedy: bool = False,
                   temperature: float = 1.0, seed: int = 0, max_new_tokens: int = 64) -> list[Sample]:
    """``n`` samples per ``PromptRecord`` (prompt-major): chat records through the model's chat template
    (``real_policy.sample_chat``), raw ones as text (``policy.sample``)."""
    if records and records[0].messages is not None:
        from nemo_factuality.lab.real_policy import sample_chat

        return sample_chat(model, tokenizer, [r.messages for r in records], [r.prompt for r in records], n=n, greedy=greedy,
                           temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    return sample(model, tokenizer, [r.prompt for r in records], n=n, greedy=greedy, temperature=temperature,
                  max_new_tokens=max_new_tokens, seed=seed)


def sample_world(world: LabWorld, model: Any, tokenizer: Any, names: Sequence[str], **kw: Any) -> list[Sample]:
    """``sample_records`` on the world's prompts about ``names``."""
    return sample_records(model, tokenizer, [world.record(x) for x in names], **kw)


def responses_for(model, tokenizer, names: Sequence[str], tiers: dict[str, str], *, n: int, greedy: bool = False,
                  temperature: float = 1.0, tau: float | None = None, seed: int = 0, world: LabWorld = SYNTHETIC,
                  max_new_tokens: int = 64) -> list[dict]:
    """Eval records ``{"id", "prompt", "response", "topic", "tier"}`` for ``names`` (``n`` each, 1 when greedy),
    sampled at ``temperature``, with the decode-time threshold ``tau`` applied when given."""
    samples = sample_world(world, model, tokenizer, names, n=1 if greedy else n, greedy=greedy, temperature=temperature,
                           seed=seed, max_new_tokens=max_new_tokens)
    return rows_from(samples, names, tiers, n=1 if greedy else n, tau=tau, world=world)


def rows_from(samples: Sequence[Sample], names: Sequence[str], tiers: dict[str, str], *, n: int,
              tau: float | None = None, world: LabWorld = SYNTHETIC) -> list[dict]:
    """Eval records from ``n`` samples per name (prompt-major), thresholded at ``tau`` when given."""
    rows = []
    for i, s in enumerate(samples):
        name = names[i // n]
        text = apply_threshold(s, tau, world, name) if tau is not None else s.response
        rows.append({"id": f"{name}#{i % n}", "prompt": s.prompt, "response": text, "topic": name, "tier": tiers[name]})
    return rows


def label_rows(rows: list[dict], kb_path: Path, world: LabWorld = SYNTHETIC) -> None:
    """Label claims in place with the eval pipeline and the world's verifier; abstention sentences move to
    ``abstentions`` (``claims.jsonl`` lists them as abstained) and are counted in ``abstained_slots``."""
    from nemo_factuality.lab.pipeline import lab_pipeline

    cfg = EvalConfig(pipeline={"segmenter": {"name": "regex"}, "extractor": {"name": "identity"},
                               "evidence": {"name": "none"}, "verifier": {"name": "kb_exact", "store_path": str(kb_path)},
                               "abstain_detection": None})
    label_with_pipeline([("lab", r) for r in rows], cfg,
                        pipeline=lab_pipeline(str(kb_path), abstentions_are_claims=True, world=world.name))
    for r in rows:
        claims = r.get("claims") or []
        kept = [c for c in claims if c["label"] != "irrelevant"]
        r["abstentions"] = [c for c in claims if c["label"] == "irrelevant"]
        r["abstained_slots"] = len(claims) - len(kept)
        r["slots"] = len(claims)
        r["claims"] = kept or None


def run_eval(rows: list[dict], kb_path: Path, out_dir: Path, world: LabWorld = SYNTHETIC) -> dict[str, Any]:
    """Label, write ``responses.jsonl``, run ``nemo-factuality eval`` into ``out_dir``; return the lab summary
    with ``per_person`` (``per_person_scores``).

    The eval command's markdown goes to ``out_dir/report.md`` only (the lab prints its own report, not one
    table per evaluation)."""
    from nemo_factuality.evaluation.cli import main as eval_main

    label_rows(rows, kb_path, world)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "responses.jsonl"
    with records.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with contextlib.redirect_stdout(io.StringIO()):
        code = eval_main(["--input", str(records), "--output", str(out_dir / "report.json"), "--group-by", "tier",
                          "--k", str(world.slots), "--gamma", "0,10"])
    if code != 0:
        raise RuntimeError(f"nemo-factuality eval failed on {records} (exit {code})")
    report = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    return {**summarise(report, rows, world.slots), "per_person": per_person_scores(rows)}


def per_person_scores(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """``{person: {"score_sum", "responding"}}`` of labelled records (``topic`` names the person; ``claims`` as
    ``label_rows`` leaves them): the sum of FActScore's per-response score (γ=0: the fraction of supported
    claims) over the person's responding responses, and their number. The FActScore of any set of people is
    ``Σ score_sum / Σ responding``; the report resamples people with it (``lab/bootstrap.py``)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        person = out.setdefault(r["topic"], {"score_sum": 0.0, "responding": 0})
        claims = r.get("claims") or []  # None or []: an abstained response, which FActScore leaves out
        if claims:
            person["score_sum"] += sum(c["label"] == "supported" for c in claims) / len(claims)
            person["responding"] += 1
    return out


def score_rows(rows: list[dict], kb_path: Path, world: LabWorld = SYNTHETIC) -> dict[str, Any]:
    """The same summary as ``run_eval`` without files (for the validation sweeps that tune the references)."""
    from nemo_factuality.evaluation.report import EvalOptions, build_report, parse_record, to_json_safe

    label_rows(rows, kb_path, world)
    records = [parse_record(r, where=r["id"], group_by="tier") for r in rows]
    report = to_json_safe(build_report(records, EvalOptions(ks=(world.slots,), gammas=(0, 10))))
    return summarise(report, rows, world.slots)


def _block(group: dict[str, Any], rows: Sequence[dict], k: int) -> dict[str, Any]:
    slots = sum(r["slots"] for r in rows)
    responding = group["n_records"] - group["n_abstained"]
    return {
        "factscore": group["factscore"]["gamma0"]["score"],
        "factscore_gamma10": group["factscore"]["gamma10"]["score"],
        "respond_ratio": group["factscore"]["gamma0"]["respond_ratio"],
        "safe_f1": group["safe"][f"f1@{k}"],  # SAFE F1@K at K = the world's slots
        "precision": group["safe"]["precision"],
        "claims_per_response": group["claims_per_response"],
        # not-supported claims per responding response: what a reader of the answers is told that is false
        "hallucinated_per_response": (group["label_counts"]["not_supported"] / responding) if responding else None,
        "abstain_rate": sum(r["abstained_slots"] for r in rows) / slots if slots else None,
        "n_responses": group["n_records"],
    }


def summarise(report: dict[str, Any], rows: Sequence[dict], k: int) -> dict[str, Any]:
    """The lab's block for one evaluation: headline numbers for ``all`` plus ``per_tier`` (SAFE at K = ``k``)."""
    out = _block(report["groups"]["all"], rows, k)
    out["per_tier"] = {name: _block(g, [r for r in rows if r["tier"] == name], k)
                       for name, g in report["groups"].items() if name != "all"}
    return out
