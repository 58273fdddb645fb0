"""A real Slurm cluster on loopback for tests: slurmctld + three slurmd "nodes" (n1, n2, n3), auth/none.

Several NodeName entries on one host (different slurmd ports) are needed for heterogeneous jobs: Slurm puts
each het group on nodes of its own, and a stage with judges has three groups (trainer, reward server,
judges). Each node claims 4 CPUs whatever the machine has (``SlurmdParameters=config_overrides``): a group
asks for one task per server, and a multi-judge stage's judge group alone runs four. Every daemon is
stopped by PID in ``stop()``, and the state directory is removed.

Processes are told apart from anything else on the machine by an environment variable unique to this
cluster (``RUN_ENV``): the daemons and every job submitted through ``sbatch`` carry it, and so does
each process a job starts (steps, servers, tritonserver). ``job_processes()`` lists exactly those,
so a test never mistakes another user's ``nemo-factuality serve`` for a leak of its own.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

CONF = """ClusterName=nftest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldPort={ctld_port}
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
SlurmdParameters=config_overrides
FirstJobId={first_job_id}
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=60 State=UP
"""
NODES = ("n1", "n2", "n3")
NODE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=4 RealMemory=2000 State=UNKNOWN"
RUN_ENV = "NF_SLURM_TEST_RUN"


def _free_port(lo: int = 16800, hi: int = 16899) -> int:
    for _ in range(200):
        port = random.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port for Slurm daemons in 16800-16899")


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.run_id = uuid.uuid4().hex
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), **{RUN_ENV: self.run_id})

    def start(self, timeout_s: float = 30) -> SlurmCluster:
        for d in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        ports = set()
        while len(ports) < 1 + len(NODES):
            ports.add(_free_port())
        ctld, *node_ports = sorted(ports)
        host = socket.gethostname()
        nodes = "\n".join(NODE.format(name=n, host=host, port=p) for n, p in zip(NODES, node_ports, strict=True))
        # a job id of its own per cluster: two clusters' jobs (tests run side by side) get different per-job ports
        first_job_id = random.randint(1000, 999_000)
        self.conf.write_text(CONF.format(host=host, root=self.root, ctld_port=ctld, nodes=nodes, node_names=",".join(NODES),
                                         first_job_id=first_job_id))
        self._run(["slurmctld", "-c", "-f", str(self.conf)])
        for node in NODES:
            self._run(["slurmd", "-f", str(self.conf), "-N", node])
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s}s; see {self.root}/log")

    def _run(self, cmd: list[str]) -> None:
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr}")

    def pids(self) -> list[int]:
        out = []
        for name in ("slurmctld.pid", *(f"slurmd.{n}.pid" for n in NODES)):
            f = self.root / name
            if f.exists() and f.read_text().strip():
                out.append(int(f.read_text().strip()))
        return out

    def job_processes(self) -> dict[int, str]:
        """``{pid: command line}`` of the live processes this cluster's jobs started (daemons excluded)."""
        marker = f"{RUN_ENV}={self.run_id}".encode()
        daemons, found = set(self.pids()), {}
        ctld = self.pids()[0] if (self.root / "slurmctld.pid").exists() and self.pids() else None
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in daemons:
                continue
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0") or not _alive(int(proc.name)):
                    continue
                if ctld is not None and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ctld:
                    continue  # slurmctld's own helper (slurmscriptd): part of the daemons, never a job step
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # exited meanwhile, or not ours to read
                continue
        return found

    def sbatch(self, script: Path, cwd: Path, extra_env: dict[str, str] | None = None) -> str:
        env = dict(self.env, **(extra_env or {}))
        res = subprocess.run(["sbatch", "--parsable", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s ``Key=Value`` fields (empty once slurmctld has forgotten the job)."""
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=self.env, capture_output=True, text=True).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def job_state(self, job_id: str) -> tuple[str, str]:
        fields = self.job_fields(job_id)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")

    def wait(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state, _ = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s}s (last {self.job_state(job_id)})")

    def stop(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 15
        while time.time() < deadline and any(_alive(p) for p in self.pids()):
            time.sleep(0.2)
        for pid in self.pids():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in self.job_processes():  # job steps orphaned by the daemons' exit: ours, so ours to end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root / "state", ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
