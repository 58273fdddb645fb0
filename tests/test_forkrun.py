"""``testing.forkrun``, the torchrun stand-in that imports a heavy stack once and forks the ranks: its ranks get
torchrun's worker environment and form a real gloo group; each program runs in new processes; a failing rank ends its
program and the run as torchrun's would (the others stopped, exit 1, no later program started)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_factuality.testing.forkrun import program_nproc, split_programs
from nemo_factuality.testing.venvs import run_batch_in_venv, run_bounded

PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    preloaded = "torch" in sys.modules  # imported by the launcher before the fork, not by this program
    import sibling  # beside this file: the script's folder is on the path, as for `python program.py`
    import torch
    import torch.distributed as dist


    def main():
        out, mode = sys.argv[1], sys.argv[2]
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"pid": os.getpid(), "sum": total.item(), "env": env, "preloaded": preloaded}, f)
        if mode == "helper":  # a daemonic helper process, as NeMo's data loading starts: it must not outlive its rank
            import multiprocessing
            multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True).start()
        if mode == "atexit":  # what a rank leaves to its exit: an atexit handler, output without a newline
            import atexit
            import pathlib
            atexit.register(pathlib.Path(f"{out}.atexit{rank}").write_text, "ran")
            print(f"unflushed-{rank}", end="")
        if mode == "fail" and rank == 1:
            sys.exit(3)
        if mode == "fail":
            time.sleep(60)  # the launcher must stop this rank, not wait for it
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
""")


def _forkrun(tmp_path, *programs: list[str], nproc: int = 2, timeout: float = 60):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    (tmp_path / "sibling.py").write_text("")
    args = [arg for p in programs for arg in ("--next", str(script), *p)][1:]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return run_bounded([sys.executable, "-m", "nemo_factuality.testing.forkrun", f"--nproc={nproc}", "--grace=2",
                        "--preload=torch", "--", *args], timeout=timeout, env=env)


def test_ranks_form_a_gloo_group_with_torchruns_environment_and_each_program_gets_new_processes(tmp_path):
    res = _forkrun(tmp_path, [str(tmp_path / "a"), "ok"], [str(tmp_path / "b"), "ok"])
    assert res.returncode == 0, res.stdout
    runs = {p: [json.loads((tmp_path / f"{p}.rank{r}.json").read_text()) for r in range(2)] for p in "ab"}
    for p, ranks in runs.items():
        assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2: both ranks were in one group
        assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] and {r["env"]["WORLD_SIZE"] for r in ranks} == {"2"}
        assert ranks[0]["env"]["TORCHELASTIC_RUN_ID"] == ranks[1]["env"]["TORCHELASTIC_RUN_ID"]
        assert all(r["preloaded"] for r in ranks)
    pids = [r["pid"] for ranks in runs.values() for r in ranks]
    assert len(set(pids)) == 4  # four ranks, four processes: nothing of program a lives on in program b


def test_a_failing_rank_stops_the_others_and_the_run(tmp_path):
    start = time.monotonic()
    res = _forkrun(tmp_path, [str(tmp_path / "a"), "fail"], [str(tmp_path / "b"), "ok"])
    assert res.returncode == 1
    assert "rank 1 of" in res.stdout and "exited 3" in res.stdout
    assert "Traceback" not in res.stdout, res.stdout  # the launcher reaps the stopped ranks and says it in one line
    assert time.monotonic() - start < 40  # rank 0's 60 s sleep was cut short
    assert not list(tmp_path.glob("b.rank*.json"))  # the next program never started


def test_a_ranks_daemonic_helpers_end_with_it(tmp_path):
    """A rank exits as an interpreter does (atexit handlers run): its daemonic helpers are stopped with it rather than
    outliving it holding the output pipe, which left the launcher's caller waiting."""
    start = time.monotonic()
    res = _forkrun(tmp_path, [str(tmp_path / "a"), "helper"], timeout=100)
    assert res.returncode == 0, res.stdout
    assert time.monotonic() - start < 60


def test_a_rank_ends_with_its_atexit_handlers_run_and_its_output_flushed(tmp_path):
    """A rank skips the interpreter's module teardown (``os._exit`` after the atexit handlers: ~3 s of CPU per NeMo
    rank), and loses nothing a program leaves to its exit."""
    res = _forkrun(tmp_path, [str(tmp_path / "a"), "atexit"])
    assert res.returncode == 0, res.stdout
    assert "unflushed-0" in res.stdout and "unflushed-1" in res.stdout
    assert [(tmp_path / f"a.atexit{r}").read_text() for r in (0, 1)] == ["ran", "ran"]


def test_a_batch_runs_every_program_at_its_own_size_and_reports_each_outcome_apart(tmp_path):
    """``run_batch_in_venv`` (``--keep-going --logs``): a failing program does not stop the next; each program runs
    at its own ``--nproc``; each outcome carries that program's output only; a program the batch never finished (it
    ran out of time) has no exit code rather than a made-up one."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    (tmp_path / "sibling.py").write_text("")
    venv = Path(sys.executable).parent.parent
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    programs = {"fails": (2, [str(script), str(tmp_path / "a"), "fail"]),
                "two": (2, [str(script), str(tmp_path / "b"), "ok"]),
                "one": (1, [str(script), str(tmp_path / "c"), "ok"])}
    runs = run_batch_in_venv(venv, programs, env=env, preload=("torch",), logs=tmp_path / "logs", timeout=90)
    assert runs["fails"].code == 1 and "rank 1 of" in runs["fails"].output and "exited 3" in runs["fails"].output
    assert (runs["two"].code, runs["one"].code) == (0, 0)
    assert [json.loads((tmp_path / f"b.rank{r}.json").read_text())["sum"] for r in range(2)] == [3.0, 3.0]
    assert json.loads((tmp_path / "c.rank0.json").read_text())["sum"] == 1.0 and not (tmp_path / "c.rank1.json").exists()
    assert "exited 3" not in runs["two"].output
    with pytest.raises(AssertionError, match="fails: exit 1"):
        runs["fails"].check("fails")
    # out of time inside the first program (its rank 0 sleeps 60 s): no program has an outcome
    late = run_batch_in_venv(venv, {"slow": (2, [str(script), str(tmp_path / "d"), "fail"])}, env=env,
                             preload=("torch",), logs=tmp_path / "late", timeout=1)
    assert late["slow"].code is None and "killed" in late["slow"].output


def test_program_lists_split_on_next():
    assert program_nproc(["--nproc=2", "b.py", "y"], 1) == (2, ["b.py", "y"]) and program_nproc(["a.py"], 3) == (3, ["a.py"])
    with pytest.raises(SystemExit, match="before the program"):
        program_nproc(["--nproc=2"], 1)
    assert split_programs(["a.py", "x", "--next", "b.py", "y"]) == [["a.py", "x"], ["b.py", "y"]]
    with pytest.raises(SystemExit, match="empty program"):
        split_programs(["a.py", "--next"])
