"""The loopback Slurm the launcher's job tests submit to (``testing.slurm``: slurmctld + three slurmd on this machine),
one per module."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    for binary in ("slurmctld", "slurmd", "sbatch", "scontrol"):
        if shutil.which(binary) is None:
            pytest.fail(f"{binary} not installed (tools/setup_env.sh installs Debian's slurm packages)")
    from nemo_factuality.testing.slurm import SlurmCluster

    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        pids = cluster.pids()
        cluster.stop()
        assert not any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z" for p in pids)
