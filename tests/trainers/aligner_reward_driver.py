"""Runs in the NeMo-Aligner venv: Aligner's RemoteGPTRMClient (through ``remote_reward_client``) against a port
where nothing listens. The request must fail with our error naming the URL within ``init_timeout_s``, the
exception must leave the block, and no non-daemon thread may be left (else the process would hang at exit).

    python tests/trainers/aligner_reward_driver.py PORT      # last line: "OK <seconds> <message>"
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

import torch  # noqa: E402


def main() -> int:
    port = int(sys.argv[1])
    os.environ.setdefault("MASTER_PORT", str(port + 1 if port < 65000 else port - 1))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0,
                                         world_size=1)
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(1, 1)
    from nemo_factuality.serving.client import RemoteRewardError
    from nemo_factuality.trainers.backends.aligner.reward import remote_reward_client

    remote_rm = SimpleNamespace(url=f"http://127.0.0.1:{port}", init_timeout_s=3.0, timeout_s=5.0,
                                reward_model=SimpleNamespace(name="reward_model", ip=None, port=port))
    rollout = {"response_tokens": torch.ones(2, 8, dtype=torch.long), "response_lengths": torch.tensor([5, 8])}
    before = {t.ident for t in threading.enumerate()}
    t0 = time.monotonic()
    message = None
    try:
        with remote_reward_client(remote_rm, pad_to_length=16, check=False) as rm:
            rm.infer_rm(rollout).result()
    except RemoteRewardError as err:
        message = str(err)
    elapsed = time.monotonic() - t0
    assert message is not None, "a request to a closed port returned"
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon]
    assert not left, f"threads left running after the block: {left}"
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    print(f"OK {elapsed:.1f} {message}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
