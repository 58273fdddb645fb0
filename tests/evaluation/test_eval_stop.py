"""``kill <eval pid>`` or Ctrl-C while ``nemo-factuality eval`` waits on its judge (issue 43: SIGTERM ended it at once
with exit 143 and no word): one line saying it stops, exit 128 + the signal within seconds, no traceback, no report
(the report is written only whole). Through the real command, in a process of its own, against a judge that takes
30 s to answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_eval_waiting_on_its_judge_within_seconds(tmp_path, sig, code):
    (tmp_path / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    kb = build_store(tmp_path / "p.jsonl", tmp_path / "kb.sqlite", progress=False)
    src = tmp_path / "responses.jsonl"
    src.write_text(json.dumps({"id": "1", "prompt": "Who is Ada?", "response": "Ada Varga was born in 1917."}) + "\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with ScriptedOpenAIServer(default=Reply("- Ada Varga was born in 1917.", delay_s=30)) as judge:
        proc = subprocess.Popen([sys.executable, "-m", "nemo_factuality.cli", "eval", "--input", str(src), "--output",
                                 str(out), "--config-name", "safe_vllm", f"pipeline.evidence.store_path={kb}",
                                 f"pipeline.judge.base_url={judge.url}", "pipeline.judge.max_retries=0"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not judge.state.requests and time.monotonic() < deadline:  # eval is waiting on the judge now
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.1)
            assert judge.state.requests
            start = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
            took = time.monotonic() - start
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    name = signal.Signals(sig).name
    assert proc.returncode == code and took < 10, (proc.returncode, took, err[-3000:])
    assert f"nemo-factuality eval: {name} received: stopping" in err, err[-3000:]
    assert f"nemo-factuality eval: error: stopped by {name}" in err and f"(exit {code})" in err
    assert "Traceback" not in err
    assert not (out / "report.json").exists()
