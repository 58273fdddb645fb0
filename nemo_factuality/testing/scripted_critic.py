"""A scripted critic server for the critic client's tests: NeMo-Aligner's critic-server protocol on a real PyTriton
server, with the weights replaced by arithmetic (as ``fake_openai`` stands in for an LLM judge).

    python -m nemo_factuality.testing.scripted_critic --port P --state FILE [--exit-after-train]

* ``critic_infer``  tokens, sequence_lengths → values = 0.01 · token id (one per position);
* ``critic_train``  tokens, returns, prev_values, mask → one "optimiser step" (the step count + 1, written to
  ``--state``) and loss_mean = the mask-weighted mean of the returns;
* ``critic_state``  → the step.

``critic_train`` applies one update per ``request_id`` (a repeat is answered from the update applied), as the real
server; ``--train-delay S`` makes every update take S seconds (a server that is slow, not down), and
``--ignore-request-id`` applies every request (a server without ids, to show what the ids prevent). Each applied
update appends its id to ``<state>.applied``.

It starts at the step in ``--state`` (0 when the file is absent), as the real server resumes from its latest
checkpoint. ``--exit-after-train``: the process dies right after applying a train step, before answering (the
connection drops with the update applied).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from pytriton.decorators import batch, sample
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--exit-after-train", action="store_true")
    ap.add_argument("--train-delay", type=float, default=0.0, help="seconds each update takes (a slow server)")
    ap.add_argument("--ignore-request-id", action="store_true", help="apply every request (a server without ids)")
    args = ap.parse_args()
    state = Path(args.state)
    step = {"n": int(state.read_text()) if state.is_file() else 0}

    @batch
    def infer(tokens: np.ndarray, sequence_lengths: np.ndarray) -> dict[str, np.ndarray]:
        del sequence_lengths
        return {"values": (0.01 * tokens).astype(np.float32)}

    applied: dict[str, object] = {"id": None, "answer": None}

    @sample
    def train(tokens: np.ndarray, returns: np.ndarray, prev_values: np.ndarray, mask: np.ndarray,
              request_id: np.ndarray | None = None) -> dict[str, np.ndarray]:
        del tokens, prev_values
        key = None if request_id is None or args.ignore_request_id else int(request_id.reshape(-1)[0])
        if key is not None and applied["id"] == key:  # the real server's rule: one update per request id
            return dict(applied["answer"])
        time.sleep(args.train_delay)  # a slow update: the client's timeout ends before the answer
        step["n"] += 1
        state.write_text(str(step["n"]))
        with Path(args.state + ".applied").open("a") as f:  # every update applied, for the test to count
            f.write(f"{key}\n")
        if args.exit_after_train:
            os._exit(3)  # the update is applied; the answer never leaves
        loss = float((returns * mask).sum() / max(float(mask.sum()), 1.0))
        answer = {"loss_mean": np.array([loss], dtype=np.float32)}
        applied.update(id=key, answer=answer)
        return answer

    @sample
    def server_state(dummy_var: np.ndarray) -> dict[str, np.ndarray]:
        del dummy_var
        return {"step": np.array([step["n"]], dtype=np.int64)}

    from nemo_factuality.serving.server import ensure_python_backend_env

    ensure_python_backend_env()  # Triton's Python-backend stub needs the interpreter's environment, as the real servers
    whole = ModelConfig(batching=False, max_batch_size=0, batcher=None)
    config = TritonConfig(http_address="127.0.0.1", http_port=args.port, allow_grpc=False, allow_metrics=False)
    with Triton(config=config) as triton:
        triton.bind(model_name="critic_infer", infer_func=infer,
                    inputs=(Tensor(name="tokens", shape=(-1,), dtype=np.int64),
                            Tensor(name="sequence_lengths", shape=(-1,), dtype=np.int64)),
                    outputs=(Tensor(name="values", shape=(-1,), dtype=np.float32),),
                    config=ModelConfig(batching=True, max_batch_size=64))
        triton.bind(model_name="critic_train", infer_func=train,
                    inputs=(*(Tensor(name=n, shape=(-1, -1), dtype=np.int64 if n == "tokens" else np.float32)
                                  for n in ("tokens", "returns", "prev_values", "mask")),
                            Tensor(name="request_id", shape=(1,), dtype=np.int64, optional=True)),
                    outputs=(Tensor(name="loss_mean", shape=(1,), dtype=np.float32),), config=whole)
        triton.bind(model_name="critic_state", infer_func=server_state,
                    inputs=(Tensor(name="dummy_var", shape=(1,), dtype=np.int64),),
                    outputs=(Tensor(name="step", shape=(1,), dtype=np.int64),), config=whole)
        triton.serve()


if __name__ == "__main__":
    main()
