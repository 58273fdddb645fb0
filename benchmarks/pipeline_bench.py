"""Pipeline throughput: claims verified per second through LLM extraction + LLM verification.

A loopback OpenAI-protocol judge answers every request after a fixed delay (``--delay-ms``, a
stand-in for vLLM latency). The same batch is run at several client concurrency levels in one run;
concurrency 1 is the baseline, so the speed-up shows how much judge latency concurrency hides.

    python benchmarks/pipeline_bench.py [--responses 32] [--claims 8] [--delay-ms 50] [--concurrency 1,8,32]

Retrieval part (``--kb-passages N``, 0 skips it): the same pipeline with a fast judge (0 ms) and
``kb`` evidence from an N-passage synthetic store, once on the tantivy store and once on the old
SQLite FTS5 store; the table is CPU seconds of this process per stage (the judge runs in its own
process), so it shows which stage costs the most CPU once the judge is fast.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

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


class StageTimer:
    """Wraps a pipeline part; adds the process CPU seconds its batch calls take to ``cpu[stage]``.

    Stages run one after another inside ``check``, so process CPU during a call (the judge
    client's threads included) is that stage's.
    """

    METHODS = ("split", "extract_batch", "get_batch", "verify_batch")

    def __init__(self, inner, stage: str, cpu: dict[str, float]) -> None:
        self.inner, self.stage, self.cpu = inner, stage, cpu

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.METHODS:
            return attr

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return attr(*args, **kwargs)
            finally:
                self.cpu[self.stage] = self.cpu.get(self.stage, 0.0) + time.process_time() - t0
        return timed


class Fts5Evidence:
    """``kb`` evidence on the old FTS5 store (the baseline column)."""

    def __init__(self, path: Path, k: int = 5) -> None:
        from nemo_factuality.knowledge.legacy_fts5 import Fts5Store

        self.store, self.k = Fts5Store(path), k

    def get_batch(self, queries):
        return [[p.text for p in self.store.search(q.claim.text, k=self.k)] for q in queries]


def retrieval_cost(args: argparse.Namespace) -> None:
    """CPU seconds per stage with a 0 ms judge: evidence from the tantivy store vs the old FTS5 store."""
    from nemo_factuality.knowledge.legacy_fts5 import build_fts5_store
    from nemo_factuality.knowledge.store import build_store

    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(20_000)]
    words = [f"w{i}" for i in range(20_000)]
    # Claims are Zipf-word sentences like the store's passages, so each query does real BM25 work.
    facts = "\n".join(f"- {' '.join(rng.choices(words, weights, k=10))}." for _ in range(args.claims))
    responses = [f"Response {i} states several facts. " * 3 for i in range(args.responses)]
    prompts = ["Tell me a bio."] * len(responses)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "p.jsonl"
        with open(src, "w") as fh:
            fh.writelines(json.dumps({"title": f"Entity {i % 5000}", "text": " ".join(rng.choices(words, weights, k=60))})
                          + "\n" for i in range(args.kb_passages))
        stores = {"kb (tantivy)": lambda: EVIDENCE.build({"name": "kb", "store_path": str(build_store(
                      src, Path(tmp) / "kb.sqlite", progress=False)), "workers": 1}),
                  "kb (old FTS5)": lambda: Fts5Evidence(build_fts5_store(src, Path(tmp) / "fts5.sqlite"))}
        table = []
        with judge_process({"atomic facts": facts}, "[Supported]", 0.0) as url:
            for name, make_evidence in stores.items():
                cpu: dict[str, float] = {}
                client = OpenAIJudgeClient(url, "judge", concurrency=32, timeout_s=30)
                pipe = FactualityPipeline(
                    StageTimer(SEGMENTERS.build("regex"), "segment", cpu),
                    StageTimer(EXTRACTORS.build("factscore", client=client), "extract (judge)", cpu),
                    StageTimer(make_evidence(), "evidence", cpu),
                    StageTimer(VERIFIERS.build({"name": "llm_judge", "style": "safe"}, client=client), "verify (judge)", cpu))
                t0 = time.perf_counter()
                checks = pipe.check(prompts, responses)
                wall = time.perf_counter() - t0
                assert sum(len(c.verdicts) for c in checks) == args.responses * args.claims and client.stats.errors == 0
                table.append((name, wall, cpu))
                client.close()
    stages = list(table[0][2])
    print(f"\nCPU seconds per stage, judge delay 0 ms, {args.responses * args.claims} claims, "
          f"{args.kb_passages} passages in the store (evidence queries run in-process, one thread)")
    print(f"{'evidence':>16}" + "".join(f"{s:>17}" for s in stages) + f"{'wall s':>9}  largest CPU cost")
    for name, wall, cpu in table:
        print(f"{name:>16}" + "".join(f"{cpu[s]:>17.3f}" for s in stages) + f"{wall:>9.2f}  {max(cpu, key=cpu.get)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", type=int, default=32)
    ap.add_argument("--claims", type=int, default=8, help="claims per response the extractor returns")
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--kb-passages", type=int, default=100_000, help="retrieval part's store size (0 skips it)")
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
    if args.kb_passages > 0:
        retrieval_cost(args)


if __name__ == "__main__":
    main()
