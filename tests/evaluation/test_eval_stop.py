"""``kill <eval pid>`` or Ctrl-C while ``nemo-factuality eval`` waits on its judge (issue 43: SIGTERM ended it at once
with exit 143 and no word): one line saying it stops, exit 128 + the signal within seconds, no traceback, no report
(the report is written only whole). Through the real command, in a process of its own, against a judge that takes
30 s to answer."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.testing.processes import command_in_own_group, signal_and_wait


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_eval_waiting_on_its_judge_within_seconds(tmp_path, sig, code):
    (tmp_path / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    kb = build_store(tmp_path / "p.jsonl", tmp_path / "kb.sqlite", progress=False)
    src = tmp_path / "responses.jsonl"
    src.write_text(json.dumps({"id": "1", "prompt": "Who is Ada?", "response": "Ada Varga was born in 1917."}) + "\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with ScriptedOpenAIServer(default=Reply("- Ada Varga was born in 1917.", delay_s=30)) as judge:
        args = [sys.executable, "-m", "nemo_factuality.cli", "eval", "--input", str(src), "--output", str(out),
                "--config-name", "safe_vllm", f"pipeline.evidence.store_path={kb}", f"pipeline.judge.base_url={judge.url}",
                "pipeline.judge.max_retries=0"]
        with command_in_own_group(args, env) as proc:
            deadline = time.monotonic() + 120
            while not judge.state.requests and time.monotonic() < deadline:  # eval is waiting on the judge now
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.1)
            assert judge.state.requests
            err, took = signal_and_wait(proc, sig)
    name = signal.Signals(sig).name
    assert proc.returncode == code and took < 10, (proc.returncode, took, err[-3000:])
    assert f"nemo-factuality eval: {name} received: stopping" in err, err[-3000:]
    assert f"nemo-factuality eval: error: stopped by {name}" in err and f"(exit {code})" in err
    assert "Traceback" not in err
    assert not (out / "report.json").exists()
