"""Pipeline throughput: claims verified per second through LLM extraction + LLM verification.

A loopback OpenAI-protocol judge answers every request after a fixed delay (``--delay-ms``, a
stand-in for vLLM latency). The same batch is run at several client concurrency levels in one run;
concurrency 1 is the baseline, so the speed-up shows how much judge latency concurrency hides.

    python benchmarks/pipeline_bench.py [--responses 32] [--claims 8] [--delay-ms 50] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager

from nemo_factuality.judge.client import OpenAIJudgeClient
from nemo_factuality.pipeline import FactualityPipeline
from nemo_factuality.registry import EVIDENCE, EXTRACTORS, SEGMENTERS, VERIFIERS


@contextmanager
def judge_process(replies: dict[str, str], default: str, delay_ms: float):
    """The scripted judge in its own process, so its request handling does not share the client's GIL."""
    proc = subprocess.Popen([sys.executable, "-m", "nemo_factuality.testing.fake_openai", "--replies", json.dumps(replies),
                             "--default", default, "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"judge process did not start (got {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", type=int, default=32)
    ap.add_argument("--claims", type=int, default=8, help="claims per response the extractor returns")
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", default="1,8,32")
    args = ap.parse_args()
    facts = "\n".join(f"- Fact number {j} about the subject." for j in range(args.claims))

    responses = [f"Response {i} states several facts. " * 3 for i in range(args.responses)]
    prompts = ["Tell me a bio."] * len(responses)
    rows = []
    with judge_process({"atomic facts": facts}, "[Supported]", args.delay_ms) as url:
        for conc in (int(c) for c in args.concurrency.split(",")):
            client = OpenAIJudgeClient(url, "judge", concurrency=conc, timeout_s=30)
            pipe = FactualityPipeline(SEGMENTERS.build("regex"), EXTRACTORS.build("factscore", client=client),
                                      EVIDENCE.build("none"), VERIFIERS.build({"name": "llm_judge", "style": "safe"}, client=client))
            t0 = time.perf_counter()
            checks = pipe.check(prompts, responses)
            elapsed = time.perf_counter() - t0
            n_claims = sum(len(c.verdicts) for c in checks)
            assert n_claims == args.responses * args.claims and client.stats.errors == 0
            rows.append((conc, n_claims, elapsed, n_claims / elapsed))
            client.close()
    base = rows[0][3]
    print(f"judge delay {args.delay_ms:g} ms; {args.responses} responses x {args.claims} claims "
          f"({args.responses} extraction + {args.responses * args.claims} verification requests)")
    print(f"{'concurrency':>12}{'claims':>8}{'seconds':>10}{'claims/s':>10}{'speed-up':>10}")
    for conc, n, el, rate in rows:
        print(f"{conc:>12}{n:>8}{el:>10.2f}{rate:>10.1f}{rate / base:>9.1f}x")


if __name__ == "__main__":
    main()
