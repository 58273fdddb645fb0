"""``nemo-factuality eval``: score responses with FActScore, SAFE F1@K, VeriScore and HalluLens.

    nemo-factuality eval --input F.jsonl --output report.json [--group-by FIELD] [--k 64,100,178]
                         [--gamma 0,10] [--config-name NAME] [key=value ...]
    nemo-factuality eval --demo --output outputs/demo

Records without labels are fact-checked first with the configured pipeline
(``conf/eval/<config-name>.yaml``, ``pipeline:`` block). Writes ``report.json``, ``report.md``,
``claims.jsonl`` (every claim judged: ``evaluation/claims.py``) and ``precision_vs_claims.png`` (all via temp file +
rename, so a failure leaves nothing half-written). Blank responses count as abstentions; how many there were is in
the report (``n_empty``) and on the console.

A record whose fact-check failed (judge down, unreadable replies) is excluded from every metric and
listed under ``failures`` in the report; the command exits 1 when more than ``--max-failed-fraction``
(default 0) of the records failed, and ``--fail-fast`` stops at the first failure instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nemo_factuality import exit_codes
from nemo_factuality.cli import ArgumentParser, UsageError, positive_int, split_overrides
from nemo_factuality.config import load_config
from nemo_factuality.evaluation.claims import claim_records, empty_count
from nemo_factuality.evaluation.render import render_markdown, render_plot
from nemo_factuality.evaluation.report import (
    EvalOptions,
    EvalRecord,
    build_report,
    check_core_fields,
    check_unique_ids,
    group_of,
    parse_record,
    to_json_safe,
)
from nemo_factuality.fileio import atomic_write, input_file
from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.pipeline import PipelineConfig
from nemo_factuality.types import FactualityInputError, Label

log = logging.getLogger(__name__)
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

_LABEL_FROM_VERDICT = {
    Label.SUPPORTED: "supported",
    Label.NOT_SUPPORTED: "not_supported",
    Label.NOT_ENOUGH_INFO: "not_supported",
    Label.IRRELEVANT: "irrelevant",
}


@dataclass
class EvalConfig:
    """Typed schema for ``conf/eval/*.yaml``: the pipeline used when records carry no labels."""

    # the fact-checking pipeline for records without labels (see Fact-checking pipeline): typed, so a misspelt part
    # (pipeline.verifer...) is an unknown key with its close match; kb_exact's store_path must be given
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    topic_field: str = "topic"  # the record field holding the topic (entity) the evidence is searched for
    materials_field: str = "materials"  # the record field holding given evidence passages (RLFH-style `materials`)


def read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Read JSONL as ``(file:line, record)``; invalid UTF-8 or JSON names the line."""
    return list(iter_jsonl(path))


def _needs_checking(raw: dict[str, Any]) -> bool:
    claims = raw.get("claims", "missing")
    if claims == "missing":
        return True
    return isinstance(claims, list) and any(isinstance(c, dict) and "label" not in c for c in claims)


def _check_pipeline_fields(where: str, raw: dict[str, Any], cfg: EvalConfig) -> None:
    """The fields the pipeline reads from an unlabelled record: topic a string or null, materials a list of strings or
    null, a response the segmenter takes (its ``max_chars``: refused here, naming the record, rather than by the
    segmenter in the middle of fact-checking)."""
    from nemo_factuality.text.segment import MAX_RESPONSE_CHARS

    # the lab hands its pipeline as a plain mapping
    segmenter = (cfg.pipeline.get("segmenter") if isinstance(cfg.pipeline, dict) else cfg.pipeline.segmenter) or {}
    limit = int(segmenter.get("max_chars", MAX_RESPONSE_CHARS)) if segmenter.get("name", "regex") == "regex" else None
    response = raw.get("response")
    if limit is not None and isinstance(response, str) and len(response) > limit:
        record = f" (id {raw['id']!r})" if "id" in raw else ""
        raise FactualityInputError(f"{where}{record}: response has {len(response)} characters, more than "
                                   f"pipeline.segmenter.max_chars={limit}; shorten or drop that record, or raise the "
                                   f"limit (pipeline.segmenter.max_chars={len(response)})")
    topic, materials = raw.get(cfg.topic_field), raw.get(cfg.materials_field)
    if topic is not None and not isinstance(topic, str):
        raise FactualityInputError(f"{where}: field {cfg.topic_field!r} must be a string or null, got {type(topic).__name__}")
    if materials is not None and not (isinstance(materials, list) and all(isinstance(m, str) for m in materials)):
        raise FactualityInputError(f"{where}: field {cfg.materials_field!r} must be a list of strings or null "
                                   f"(evidence passages for fact-checking), got {type(materials).__name__}")


class EvalFailedError(RuntimeError):
    """Fact-checking failed for a record and ``--fail-fast`` was given (or too many records failed)."""


def label_with_pipeline(rows: list[tuple[str, dict[str, Any]]], cfg: EvalConfig, *, fail_fast: bool = False,
                        pipeline: Any = None) -> dict[str, str]:
    """Fill ``claims`` (with labels, spans and evidence) in place for records that have none, using the configured
    pipeline (or ``pipeline``, a built one: the lab's worlds bring their own verifier).

    Returns ``{file:line: reason}`` for the records whose fact-check failed (their ``claims`` stay
    unset: they are not abstentions); with ``fail_fast`` the first failure raises ``EvalFailedError``.
    The fields the pipeline reads are checked on every such record before any is fact-checked.
    """
    where_of = {id(raw): where for where, raw in rows}
    failed: dict[str, str] = {}
    todo = []
    for where, raw in rows:
        if _needs_checking(raw):
            _check_pipeline_fields(where, raw, cfg)
            todo.append(raw)
    if not todo:
        return failed
    if pipeline is None:
        from nemo_factuality.pipeline import build_pipeline

        pipeline = build_pipeline(cfg.pipeline)
    log.info("fact-checking %d unlabelled records with %s", len(todo), pipeline)
    batch = 32
    for start in tqdm(range(0, len(todo), batch), desc="fact-checking", unit="batch"):
        chunk = todo[start : start + batch]
        checks = pipeline.check(
            [r.get("prompt", "") for r in chunk],
            [r.get("response", "") for r in chunk],
            topics=[r.get(cfg.topic_field) for r in chunk],
            materials=[tuple(r.get(cfg.materials_field) or ()) for r in chunk],
        )
        for raw, check in zip(chunk, checks, strict=True):
            if check.error is not None:
                failed[where_of[id(raw)]] = check.error
                if fail_fast:
                    raise EvalFailedError(f"{where_of[id(raw)]}: fact-checking failed (--fail-fast): {check.error}")
                continue
            by_id = {v.claim_id: v for v in check.verdicts}
            if check.abstained or not check.claims:
                raw["claims"] = None
                continue
            labelled, unparseable = [], 0
            for claim in check.claims:
                verdict = by_id.get(claim.id)
                if verdict is None or verdict.label is Label.UNPARSEABLE:
                    unparseable += 1
                    continue
                labelled.append({"text": claim.text, "label": _LABEL_FROM_VERDICT[verdict.label],
                                 "span": None if claim.span is None else [claim.span.start, claim.span.end],
                                 "evidence": list(verdict.evidence)})
            raw["claims"] = labelled
            raw["unparseable"] = unparseable
    return failed


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} must be a comma-separated list of positive integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag} values must be positive integers, got {text!r}")
    return values


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if any(not v >= 0 for v in values):  # also rejects nan
        raise UsageError(f"{flag} values must be >= 0, got {text!r}")
    return values


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="nemo-factuality eval",
                       description="Score responses with FActScore, SAFE F1@K, VeriScore and HalluLens. Records without "
                                   "labelled claims are fact-checked first with the --config-name pipeline.",
                       usage="nemo-factuality eval (--input F.jsonl | --demo) --output PATH [options] [key=value ...]",
                       epilog="key=value overrides change the fact-checking pipeline of --config-name, e.g. "
                              "pipeline.verifier.store_path=kb.sqlite (see conf/eval/*.yaml).")
    p.add_argument("--input", type=Path, help="JSONL records (omit with --demo)")
    p.add_argument("--output", type=Path, required=True,
                   help="report.json path (ends in .json), or a directory to write report.json, report.md and the plot in")
    p.add_argument("--demo", action="store_true", help="evaluate the packaged demo records against the demo knowledge store")
    p.add_argument("--group-by", default=None, help="record field to group results by (each value gets its own block)")
    p.add_argument("--k", default="64,100,178", help="SAFE F1@K values (comma-separated positive integers)")
    p.add_argument("--gamma", default="0,10", help="FActScore length-penalty gammas (comma-separated, >= 0)")
    p.add_argument("--hallulens-k", type=positive_int, default=32, help="K of HalluLens LongWiki recall@K")
    p.add_argument("--config-name", default=None,
                   help="conf/eval/<name>.yaml: the fact-checking pipeline for records without labels (demo_kb, safe_vllm)")
    p.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="exit 1 when more than this fraction of records could not be fact-checked")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first record whose fact-check fails")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. pipeline.verifier.store_path=kb.sqlite")
    return p


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = build_parser()
    args = p.parse_intermixed_args(list(argv))
    overrides = split_overrides(args.overrides, p.prog)
    if not args.demo and args.input is None:
        p.error("--input is required unless --demo is given")
    return args, overrides


def _report_path(output: Path) -> Path:
    """report.json for ``--output`` (a .json path or a directory); an existing non-directory is refused, and so is a
    path under one (before: only "Not a directory: …" once the report was about to be written)."""
    for parent in output.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--output {output} is under {parent}, which is a file, not a directory; choose an "
                             "--output whose folders are folders")
    if output.suffix == ".json":
        if output.is_dir():
            raise UsageError(f"--output {output} is a directory; name a .json file or drop the .json suffix")
        return output
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is an existing file; give a directory (report.json, report.md and the plot "
                         "go in it) or a path ending in .json")
    return output / "report.json"


def _demo_store(workdir: Path) -> tuple[Path, list[str]]:
    """Where the demo knowledge store goes (in ``workdir``) and the pipeline overrides pointing at it."""
    kb = workdir / "demo_kb.sqlite"
    return kb, [f"pipeline.verifier.store_path={kb}", "pipeline.evidence.name=none"]


def _build_demo_store(kb: Path) -> None:
    from nemo_factuality.knowledge.store import build_store

    if not kb.exists():
        build_store(DATA_DIR / "demo_passages.jsonl", kb, facts_jsonl=DATA_DIR / "demo_facts.jsonl", progress=False)


def main(argv: Sequence[str]) -> int:
    args, overrides = _parse_args(argv)
    # every flag and override is checked before anything is built or written
    out_json = _report_path(args.output)
    input_path = args.input
    if input_path is not None:
        input_file(input_path, "--input", suffixes=(".jsonl",), hint="--input takes the records' JSONL file")
    if not 0.0 <= args.max_failed_fraction <= 1.0:
        raise UsageError(f"--max-failed-fraction must be in [0, 1], got {args.max_failed_fraction}")
    ks, gammas = _ints(args.k, "--k"), _floats(args.gamma, "--gamma")
    if args.demo:
        demo_kb, demo_overrides = _demo_store(out_json.parent)
        input_path, overrides = DATA_DIR / "demo_eval.jsonl", demo_overrides + overrides
        args.group_by = args.group_by or "domain"
    cfg = load_config(EvalConfig, args.config_name, overrides, group="eval")
    if args.demo or args.config_name:  # a pipeline was asked for: its stages' names and options too
        from nemo_factuality.pipeline import check_pipeline_config

        check_pipeline_config(cfg.pipeline)
    opts = EvalOptions(ks=ks, gammas=gammas, hallulens_k=args.hallulens_k,
                       extra={"input": str(input_path), "group_by": args.group_by})
    if args.demo:
        _build_demo_store(demo_kb)
    rows = read_jsonl(input_path)
    for where, raw in rows:  # all input checked before any (slow) fact-checking
        check_core_fields(raw, where=where)
        if args.group_by:
            group_of(raw, args.group_by, where=where)
        if _needs_checking(raw):
            _check_pipeline_fields(where, raw, cfg)
    check_unique_ids(rows)
    unlabelled = sum(1 for _, raw in rows if _needs_checking(raw))
    if unlabelled and not args.config_name and not args.demo:
        raise UsageError(f"{unlabelled} of {len(rows)} records in {input_path} have no labelled claims, so they must be "
                         "fact-checked first: pass a pipeline, e.g. --config-name demo_kb pipeline.verifier.store_path=kb.sqlite "
                         "(conf/eval/*.yaml), or add claims with labels to the records")
    try:
        failed = label_with_pipeline(rows, cfg, fail_fast=args.fail_fast)
    except EvalFailedError as err:
        print(f"nemo-factuality eval: {err}", file=sys.stderr)
        return exit_codes.FAILURE
    records: list[EvalRecord] = [parse_record(raw, where=where, group_by=args.group_by) for where, raw in
                                 tqdm(rows, desc="scoring", unit="rec", disable=len(rows) < 1000) if where not in failed]
    if records or not failed:
        report = to_json_safe(build_report(records, opts))
    else:  # every record failed: a report of the failures alone, never "no records"
        report = {"options": {"k": list(opts.ks), "gamma": list(opts.gammas), "hallulens_k": opts.hallulens_k, **opts.extra},
                  "groups": {}}
    report["failures"] = failure_block(failed, len(rows), args.max_failed_fraction)
    atomic_write(out_json, lambda p: p.write_text(json.dumps(report, indent=2), encoding="utf-8"))
    markdown = render_markdown(report) + _failures_markdown(report["failures"])
    atomic_write(out_json.with_suffix(".md"), lambda p: p.write_text(markdown, encoding="utf-8"))
    claims_path = out_json.parent / "claims.jsonl"
    atomic_write(claims_path, lambda p: write_jsonl(p, claim_records(rows, failed)))
    atomic_write(out_json.parent / "precision_vs_claims.png", lambda p: render_plot(records, p))
    print(markdown)
    log.info("wrote %s, %s, %s and %s", out_json, out_json.with_suffix(".md"), claims_path,
             out_json.parent / "precision_vs_claims.png")
    n_empty = empty_count(rows)
    if n_empty:
        print(f"nemo-factuality eval: {n_empty} of {len(rows)} responses are empty (blank): they count as abstentions, "
              "so check the generation step before reading them as a model that abstains", file=sys.stderr)
    block = report["failures"]
    if block["n_failed"]:
        print(f"nemo-factuality eval: {block['n_failed']} of {block['n_records']} records could not be fact-checked and "
              f"were excluded (first: {block['records'][0]['where']}: {block['records'][0]['error']})", file=sys.stderr)
    if block["exceeded"]:
        print(f"nemo-factuality eval: failed fraction {block['fraction']:.3g} > --max-failed-fraction "
              f"{args.max_failed_fraction:g}; the report is written but this run is not a result", file=sys.stderr)
        return exit_codes.FAILURE
    return exit_codes.OK


def write_jsonl(path: Path, records: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _failures_markdown(block: dict[str, Any]) -> str:
    if not block["n_failed"]:
        return ""
    lines = [f"**{block['n_failed']} of {block['n_records']} records could not be fact-checked** and are excluded "
             f"from every number above (fraction {block['fraction']:.3g}, limit {block['max_failed_fraction']:g}):", ""]
    lines += [f"* `{r['where']}`: {r['error']}" for r in block["records"][:10]]
    return "\n".join(lines) + "\n"


def failure_block(failed: dict[str, str], n_records: int, max_fraction: float, *, listed: int = 100) -> dict[str, Any]:
    """The report's ``failures`` block: counts, the fraction, whether it exceeds the limit, and the first records.

    >>> failure_block({"f.jsonl:2": "judge down"}, 4, 0.0)["fraction"]
    0.25
    """
    fraction = len(failed) / n_records if n_records else 0.0
    return {"n_failed": len(failed), "n_records": n_records, "fraction": fraction, "max_failed_fraction": max_fraction,
            "exceeded": fraction > max_fraction,
            "records": [{"where": w, "error": e} for w, e in list(failed.items())[:listed]]}
