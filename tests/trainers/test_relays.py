"""What the source-rank relay and the job's agreement do with each kind of failure, on a real gloo group of 2 ranks
(issue 50, item 1: "audit every relay").

* a failure the job outlives (a server gone) is agreed: every rank raises it, and every rank checkpoints alike;
* a user-facing one (``FactualityInputError``) raised by the source inside the relay reaches every rank of the group
  as the same line (the ranks wait for it in that broadcast);
* any other (CUDA's out-of-memory error) stops its rank at once: the source broadcasts nothing and the failing rank
  enters no all-reduce — it raises while its peer has not reached the collective yet. Before the change it entered
  the all-reduce and waited for the peer (here: until the peer arrived 4 s later; in a real job, for ever).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_factuality.testing.ports import free_ports
from nemo_factuality.trainers.backends.collectives import agree_on_failure, on_group_source
from nemo_factuality.types import FactualityInputError, ServerUnavailableError

PEER_LATE_S = 4.0  # how long the peer stays out of the collective: the failing rank must not wait for it


def _rank(rank: int, port: int, case: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=30))
    t0 = time.monotonic()
    try:
        if case == "relay-input":
            def write_refit():
                raise FactualityInputError("refit: no space left on device writing /x/model.safetensors.partial")
            on_group_source(write_refit, None)
        elif case == "relay-oom":
            if rank == 1:
                time.sleep(PEER_LATE_S)  # the peer reaches the broadcast late (or never)
            on_group_source(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")), None)
        elif case == "agree-oom":
            if rank == 0:
                agree_on_failure(torch.OutOfMemoryError("CUDA out of memory"))
            else:
                time.sleep(PEER_LATE_S)
                agree_on_failure(None)
        elif case == "agree-server":
            agree_on_failure(ServerUnavailableError("reward server gone") if rank == 1 else None)
        out[rank] = ("returned", None, time.monotonic() - t0)
    except Exception as err:
        out[rank] = ("raised", f"{type(err).__name__}: {err}", time.monotonic() - t0)
    # a rank whose peer left the group must not wait at exit either
    os._exit(0)


def _run(case: str) -> dict:
    port = free_ports(1)[0]
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, port, case, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        return dict(out)


def test_a_user_facing_error_in_the_relay_reaches_every_rank_as_the_same_line():
    out = _run("relay-input")
    assert out[0][:2] == ("raised", "FactualityInputError: refit: no space left on device writing "
                                    "/x/model.safetensors.partial")
    assert out[1][:2] == ("raised", "FactualityInputError: refit: no space left on device writing "
                                    "/x/model.safetensors.partial (on rank 0)")


def test_an_out_of_memory_error_in_the_relay_stops_the_source_without_broadcasting():
    out = _run("relay-oom")
    status, error, seconds = out[0]
    assert (status, error) == ("raised", "OutOfMemoryError: CUDA out of memory")
    assert seconds < PEER_LATE_S / 2, f"the source waited {seconds:.1f} s for its peer"
    # the peer is left in its broadcast; with gloo it fails as soon as the source's process is gone
    assert out[1][0] == "raised", out[1]


def test_an_out_of_memory_error_never_enters_the_agreement():
    out = _run("agree-oom")
    status, error, seconds = out[0]
    assert (status, error) == ("raised", "OutOfMemoryError: CUDA out of memory")
    assert seconds < PEER_LATE_S / 2, f"the failing rank waited {seconds:.1f} s in the agreement"


def test_a_server_gone_on_one_rank_is_agreed_by_every_rank():
    out = _run("agree-server")
    assert out[1][:2] == ("raised", "ServerUnavailableError: reward server gone")
    assert out[0][:2] == ("raised", "ServerUnavailableError: ServerUnavailableError: reward server gone (on rank 1)")


@pytest.fixture(autouse=True)
def _no_group_in_the_test_process():
    yield
    assert not dist.is_initialized()
