"""``tools/torch_index.sh``: where the set-up scripts take torch from (issue 43, item 7).

A machine without a GPU gets torch's CPU build from PyTorch's CPU index when that index answers (PyPI's Linux torch is
the multi-GB CUDA build), and is told when it does not; a machine with a GPU gets no CPU index. The index here is a
real HTTP server on loopback; "a machine with a GPU" is an ``nvidia-smi`` on PATH that lists one, as the real one does.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

from nemo_factuality.config import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "torch_index.sh"


@pytest.fixture()
def cpu_index():
    """A loopback index answering ``/torch/`` (the page an installer reads first), as download.pytorch.org does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            body = b"<a href='torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl'>torch</a>"
            self.send_response(200 if self.path.rstrip("/") == "/whl/cpu/torch" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def _run(tmp_path: Path, index: str, *, gpu: bool = False, flag: str = "--pip-args", **env: str) -> tuple[list[str], str]:
    """(the installer arguments, the one-line description) with pip configured with nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    conf = tmp_path / "pip.conf"
    conf.write_text("")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NEMO_FACTUALITY_TORCH"))}
    base.update(PATH=f"{bin_dir}:{base['PATH']}", PIP_CONFIG_FILE=str(conf), NEMO_FACTUALITY_TORCH_INDEX=index, **env)
    args, why = (subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, timeout=60, env=base,
                                check=True) for flag in (flag, "--describe"))
    assert args.stderr.strip() == f"torch: {why.stdout.strip()}"  # --pip-args says its choice too (one probe)
    return args.stdout.split(), why.stdout.strip()


def test_without_a_gpu_the_cpu_index_is_added_when_it_answers(tmp_path, cpu_index):
    args, why = _run(tmp_path, cpu_index)
    assert args == ["--extra-index-url", cpu_index]
    assert why == f"no GPU: torch's CPU build from {cpu_index}"


def test_an_unreachable_cpu_index_is_left_out_and_said(tmp_path, cpu_index):
    dead = cpu_index.replace("/whl/cpu", "/nothing-here")  # answers 404: what a proxy or a moved index gives
    args, why = _run(tmp_path, dead)
    assert args == [] and "did not answer" in why and "CUDA build" in why
    args, why = _run(tmp_path, "http://127.0.0.1:9/whl/cpu")  # nothing listens: refused at once
    assert args == [] and "did not answer" in why


def test_a_machine_with_a_gpu_keeps_the_default_index(tmp_path, cpu_index):
    args, why = _run(tmp_path, cpu_index, gpu=True)
    assert args == [] and "NVIDIA GPU" in why
    args, _ = _run(tmp_path, cpu_index, gpu=True, NEMO_FACTUALITY_TORCH="cpu")  # the override wins over detection
    assert args == ["--extra-index-url", cpu_index]


def test_pips_configured_wheel_folders_and_indexes_are_passed_on(tmp_path, cpu_index):
    """uv does not read pip's configuration: a machine's local wheel folder or mirror reaches it through these; pip
    reads them itself and is not given them twice."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pip_config = {"PIP_FIND_LINKS": f"{wheels} {tmp_path / 'absent'}", "PIP_EXTRA_INDEX_URL": "file:///srv/mirror/simple"}
    args, _ = _run(tmp_path, cpu_index, flag="--uv-args", **pip_config)
    assert args == ["--find-links", str(wheels), "--extra-index-url", "file:///srv/mirror/simple",
                    "--extra-index-url", cpu_index]
    args, _ = _run(tmp_path, cpu_index, **pip_config)
    assert args == ["--extra-index-url", cpu_index]


def test_the_set_up_scripts_take_torch_from_it():
    assert "tools/torch_index.sh --pip-args" in (REPO_ROOT / "tools" / "setup_env.sh").read_text()
    assert 'tools/torch_index.sh "--$installer-args"' in (REPO_ROOT / "tools" / "setup_stack_env.sh").read_text()
