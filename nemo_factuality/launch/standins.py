"""CPU stand-ins for the launcher tests and dry runs: a reward-server health endpoint and a tiny trainer.

    python -m nemo_factuality.launch.standins reward-server --port 18900 [--startup-delay-s 2] [--never-ready] [--tag T]
    python -m nemo_factuality.launch.standins trainer --ckpt-dir DIR --steps 50 [--step-time-s 0.1]

The trainer trains a tiny torch model on CPU, checkpoints every ``--save-every`` steps and on SIGUSR1
(atomic write: temp file + rename), and resumes from the latest checkpoint — the behaviour the real
trainers implement, so the Slurm preemption flow can be tested end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def reward_server(port: int, startup_delay_s: float, never_ready: bool, tag: str = "") -> int:
    """A health endpoint on ``port`` answering ``{"ready": ..., "tag": tag}`` (the tag tells whose server answered)."""
    started = time.time()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            pass

        def do_GET(self):  # noqa: N802
            ready = not never_ready and time.time() - started >= startup_delay_s
            body = json.dumps({"ready": ready, "tag": tag}).encode()
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"stand-in reward server on :{port} (ready after {startup_delay_s}s{', never' if never_ready else ''})", flush=True)
    stop.wait()
    server.shutdown()
    return 0


def _save(ckpt_dir: Path, step: int, model, opt) -> Path:
    import torch

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    (ckpt_dir / "latest").write_text(path.name)
    return path


def trainer(ckpt_dir: Path, steps: int, step_time_s: float, save_every: int) -> int:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    latest = ckpt_dir / "latest"
    if latest.exists():
        state = torch.load(ckpt_dir / latest.read_text().strip(), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from step {start}", flush=True)
    stop = {"usr1": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(usr1=True))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    step = start
    while step < steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if stop["usr1"]:
            print(f"SIGUSR1: checkpoint saved at step {step}: {_save(ckpt_dir, step, model, opt)}", flush=True)
            return 0
        if step % save_every == 0:
            _save(ckpt_dir, step, model, opt)
        time.sleep(step_time_s)
    _save(ckpt_dir, step, model, opt)
    print(f"training finished at step {step}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_factuality.launch.standins")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("reward-server")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--startup-delay-s", type=float, default=1.0)
    r.add_argument("--never-ready", action="store_true")
    r.add_argument("--tag", default="", help="echoed in every reply")
    t = sub.add_parser("trainer")
    t.add_argument("--ckpt-dir", type=Path, required=True)
    t.add_argument("--steps", type=int, default=50)
    t.add_argument("--step-time-s", type=float, default=0.1)
    t.add_argument("--save-every", type=int, default=1000)
    a = p.parse_args(argv)
    if a.what == "reward-server":
        return reward_server(a.port, a.startup_delay_s, a.never_ready, a.tag)
    return trainer(a.ckpt_dir, a.steps, a.step_time_s, a.save_every)


if __name__ == "__main__":
    sys.exit(main())
