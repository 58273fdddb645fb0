"""Reward-server throughput and latency vs batch size and client concurrency, with the in-process reward as baseline.

The reward is the offline FactAlign labeller on the packaged demo knowledge store (no judge), so
the numbers isolate the serving path: PyTriton HTTP, dynamic batching, token decoding, JSON details.

    python benchmarks/serve_bench.py [--requests 64] [--batch-sizes 1,8,32] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="requests per (batch size, concurrency) cell")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--concurrency", default="1,8,32")
    args = ap.parse_args()
    os.environ.setdefault("PYTRITON_HOME", tempfile.mkdtemp(prefix="pytriton_home_"))

    from nemo_factuality.evaluation.cli import DATA_DIR
    from nemo_factuality.knowledge.store import build_store
    from nemo_factuality.pipeline import build_pipeline
    from nemo_factuality.rewards.factalign import FactAlignConfig, FactAlignLabeler
    from nemo_factuality.serving.client import RemoteFactualityReward
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.testing.ports import free_ports

    tmp = Path(tempfile.mkdtemp())
    kb = build_store(DATA_DIR / "demo_passages.jsonl", tmp / "kb.sqlite", facts_jsonl=DATA_DIR / "demo_facts.jsonl", progress=False)
    reward = FactAlignLabeler(build_pipeline({"verifier": {"name": "kb_exact", "store_path": str(kb)}}), FactAlignConfig(k=10))
    import json

    records = [json.loads(line) for line in open(DATA_DIR / "demo_eval.jsonl", encoding="utf-8")]
    prompts, responses = [r["prompt"] for r in records], [r["response"] for r in records]
    http, grpc, tm, health, metrics = free_ports(5)
    cfg = ServeConfig(host="127.0.0.1", http_port=http, grpc_port=grpc, triton_metrics_port=tm, health_port=health,
                      metrics_port=metrics, response_marker="\n", max_queue_delay_us=1000)
    rows = []
    with FactualityRewardServer(cfg, reward):
        url = f"http://127.0.0.1:{http}"
        RemoteFactualityReward(url)(prompts[:2], responses[:2])  # warm up
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            batches = [([prompts[(i + j) % len(prompts)] for j in range(bs)], [responses[(i + j) % len(responses)] for j in range(bs)])
                       for i in range(args.requests)]
            lat_in = []
            t0 = time.perf_counter()
            for p, r in batches:
                s = time.perf_counter()
                reward(p, r)
                lat_in.append(time.perf_counter() - s)
            base_tput = args.requests * bs / (time.perf_counter() - t0)
            for conc in (int(x) for x in args.concurrency.split(",")):
                lat: list[float] = []
                lock = threading.Lock()
                todo = list(range(args.requests))

                def worker() -> None:
                    client = RemoteFactualityReward(url)
                    while True:
                        with lock:
                            if not todo:
                                return
                            k = todo.pop()
                        s = time.perf_counter()
                        client(*batches[k])
                        with lock:
                            lat.append(time.perf_counter() - s)

                t0 = time.perf_counter()
                threads = [threading.Thread(target=worker) for _ in range(conc)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                tput = args.requests * bs / (time.perf_counter() - t0)
                rows.append((bs, conc, tput, _pct(lat, 50), _pct(lat, 99), base_tput, _pct(lat_in, 50)))
    print(f"{'batch':>6}{'clients':>8}{'samples/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'in-proc samples/s':>19}"
          f"{'in-proc p50 ms':>16}{'overhead':>10}")
    for bs, conc, tput, p50, p99, base, base50 in rows:
        print(f"{bs:>6}{conc:>8}{tput:>11.1f}{p50:>9.2f}{p99:>9.2f}{base:>19.1f}{base50:>16.2f}{base / tput:>9.2f}x")
    print("overhead = in-process samples/s ÷ served samples/s (1.0 = free; < 1 when concurrency overlaps requests)")


if __name__ == "__main__":
    main()
