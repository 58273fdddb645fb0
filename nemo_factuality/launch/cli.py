"""``nemo-factuality launch <stage> [--cluster PROFILE] [--dry-run] [--out FILE] [key=value ...]``.

Renders ``slurm/het_job.sbatch.j2`` from ``conf/launch/<stage>.yaml`` and ``conf/cluster/<profile>.yaml``;
``--dry-run`` prints and writes the script, otherwise it is submitted with ``sbatch`` and the job id printed.
Overrides address the stage (``actor_nodes=4``) or the profile (``cluster.partition=batch``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from nemo_factuality.config import load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import render, write_script


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="nemo-factuality launch", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", help="conf/launch/<stage>.yaml, e.g. grpo_klcf, ppo_rlfh, grpo_fspo, grpo_knowrl, kto_factalign")
    p.add_argument("--cluster", default="h100_pyxis", help="conf/cluster/<profile>.yaml")
    p.add_argument("--dry-run", action="store_true", help="print and write the script without submitting")
    p.add_argument("--out", type=Path, default=None, help="where to write the script (default: <log_root>/<stage>.sbatch)")
    args, overrides = p.parse_known_args(list(argv))
    stage_over = [o for o in overrides if not o.startswith("cluster.")]
    cluster_over = [o[len("cluster."):] for o in overrides if o.startswith("cluster.")]
    stage = load_config(LaunchConfig, args.stage, stage_over, group="launch")
    cluster = load_config(ClusterProfile, args.cluster, cluster_over, group="cluster")
    script = write_script(render(args.stage, stage, cluster), args.out or Path(cluster.log_root) / f"{args.stage}.sbatch")
    if args.dry_run:
        print(script.read_text())
        print(f"# written to {script}", file=sys.stderr)
        return 0
    Path(cluster.log_root).mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"sbatch failed ({res.returncode}): {res.stderr.strip()}", file=sys.stderr)
        return res.returncode
    job_id = res.stdout.strip().split(";")[0]
    print(job_id)
    print(f"# submitted {script} as job {job_id}; logs in {cluster.log_root}/{stage.job_name}-{job_id}/", file=sys.stderr)
    return 0
