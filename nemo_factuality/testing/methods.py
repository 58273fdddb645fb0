"""The scripted LLM judge, facts and knowledge store that the method rewards' tests share (tests/trainers).

``method_judge`` answers every judge role of the five method rewards (claim extraction, verification,
checklist coverage, informativeness, grading) with a fixed, favourable reply, so a test knows what each
reward's components must come out as; serve it with ``ScriptedOpenAIServer(method_judge)``.
"""

from __future__ import annotations

from pathlib import Path

from nemo_factuality.testing.fake_openai import Reply

# (subject, relation, value, passage): what the tests' SQLite knowledge store holds
FACTS = [("Ada Varga", "born_year", "1917", "Ada Varga was born in 1917."),
         ("Lev Novak", "occupation", "chemist", "Lev Novak worked as a chemist.")]


def method_judge(req: dict) -> Reply:
    content = req["messages"][-1]["content"]
    if "atomic statements" in content:  # RLFH extraction
        return Reply(">> Sentence 1: Ada Varga was born in 1917.\n* Ada Varga was born in 1917")
    if "Choose from" in content:
        return Reply("Correct")
    if "helpful the statement" in content:
        return Reply("4")
    if "Extract every verifiable factual claim" in content or "independent atomic facts" in content \
            or "list of atomic facts" in content:
        return Reply("- Ada Varga was born in 1917.")
    if "Is the following claim true" in content:
        return Reply("True")
    if "Covered" in content:
        return Reply("Covered")
    if "Grade the predicted answer" in content:
        return Reply("A")
    if "[Supported]" in content:
        return Reply("The knowledge says so. [Supported]")
    return Reply("unscripted", status=400)


def build_kb(out_dir: Path) -> Path:
    """A real SQLite knowledge store (passages + facts) of FACTS in ``out_dir``."""
    from nemo_factuality.knowledge.store import build_store
    from nemo_factuality.testing.training import write_jsonl

    write_jsonl(out_dir / "p.jsonl", [{"title": s, "text": t} for s, _, _, t in FACTS])
    write_jsonl(out_dir / "f.jsonl", [{"subject": s, "relation": r, "value": v, "text": t} for s, r, v, t in FACTS])
    return Path(build_store(out_dir / "p.jsonl", out_dir / "kb.sqlite", facts_jsonl=out_dir / "f.jsonl", progress=False))
