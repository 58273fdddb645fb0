"""``nemo-factuality launch <stage> [--cluster PROFILE] [--via sbatch|nemo-run] [--dry-run] [--out FILE] [key=value ...]``.

Plans the job of ``conf/launch/<stage>.yaml`` on ``conf/cluster/<profile>.yaml`` (``launch.render.plan``) and renders
it as ``slurm/het_job.sbatch.j2`` (``--via sbatch``, the default) or builds it as a NeMo-Run experiment (``--via
nemo-run``, ``launch.nemorun``). ``--dry-run`` prints the script and writes it to ``--out`` (default
``outputs/launch/<stage>.sbatch``, or ``<stage>.nemo_run.sbatch``, under the git-ignored output folder) and nowhere
else; a real submit writes it under the profile's ``log_root`` (or ``--out``) and runs ``sbatch`` (NeMo-Run: through
its local tunnel, its experiment under ``<log_root>/nemo-run``).
Overrides address the stage (``params.policy_model=/models/x``, ``preset=qwen2.5-14b``) or the profile
(``cluster.partition=batch``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_factuality.cli import ArgumentParser, split_overrides
from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import plan, render, write_script

VIAS = ("sbatch", "nemo-run")


def _names(group: str) -> str:
    return ", ".join(sorted(p.stem for p in (REPO_ROOT / "conf" / group).glob("*.yaml")))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="nemo-factuality launch",
                       description="Render slurm/het_job.sbatch.j2 for a stage (conf/launch) on a cluster profile "
                                   "(conf/cluster) and submit it with sbatch. --dry-run prints it and writes it to --out "
                                   "or outputs/launch/<stage>.sbatch only.",
                       usage="nemo-factuality launch STAGE [--cluster PROFILE] [--via sbatch|nemo-run] [--dry-run] "
                             "[--out FILE] [key=value ...]",
                       epilog="key=value overrides change the stage (its required values: params.policy_model=/models/x "
                              "params.train_data=...; preset=qwen2.5-14b) or, prefixed with cluster., the profile "
                              "(cluster.partition=batch, cluster.account=me). A dry run without a required value names "
                              "every one still missing.")
    p.add_argument("stage", help=f"conf/launch/<stage>.yaml ({_names('launch')}) or a YAML path")
    p.add_argument("--cluster", default="h100_pyxis", help=f"conf/cluster/<profile>.yaml ({_names('cluster')}) or a YAML path")
    p.add_argument("--via", choices=VIAS, default="sbatch",
                   help="submit the rendered sbatch script, or build the same job as a NeMo-Run Experiment of "
                        "heterogeneous SlurmExecutors and submit it through NeMo-Run's LocalTunnel (needs nemo-run: "
                        "tools/setup_stack_env.sh nemorun)")
    p.add_argument("--dry-run", action="store_true", help="print and write the script without submitting (with --via "
                                                           "nemo-run: the script NeMo-Run would submit and its tasks')")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the script (default: outputs/launch/<stage>.sbatch with --dry-run, else "
                        "<log_root>/<stage>.sbatch)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="stage or cluster.* overrides")
    return p


DRY_RUN_DIR = Path("outputs") / "launch"  # relative to the current directory, as the lab's outputs/lab


def main(argv: Sequence[str]) -> int:
    p = build_parser()
    args = p.parse_intermixed_args(list(argv))
    overrides = split_overrides(args.overrides, p.prog)
    stage_over = [o for o in overrides if not o.startswith("cluster.")]
    cluster_over = [o[len("cluster."):] for o in overrides if o.startswith("cluster.")]
    stage = load_config(LaunchConfig, args.stage, stage_over, group="launch")
    cluster = load_config(ClusterProfile, args.cluster, cluster_over, group="cluster")
    stage_name = Path(args.stage).stem
    if args.via == "nemo-run":
        return _via_nemo_run(stage_name, plan(stage_name, stage, cluster), args)
    text = render(stage_name, stage, cluster)
    if args.dry_run:  # nothing outside --out / the output folder (git ignores outputs/)
        script = write_script(text, args.out or DRY_RUN_DIR / f"{stage_name}.sbatch")
        print(text, end="")
        print(f"# written to {script}", file=sys.stderr)
        return 0
    script = write_script(text, args.out or Path(cluster.log_root) / f"{stage_name}.sbatch")
    Path(cluster.log_root).mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"nemo-factuality launch: error: sbatch failed ({res.returncode}): {res.stderr.strip()}", file=sys.stderr)
        return res.returncode
    job_id = res.stdout.strip().split(";")[0]
    print(job_id)
    print(f"# submitted {script} as job {job_id}; logs in {cluster.log_root}/{stage.job_name}-{job_id}/", file=sys.stderr)
    return 0


def _via_nemo_run(stage_name: str, job, args) -> int:
    """The same job through NeMo-Run (``launch.nemorun``): the dry run prints what it would submit."""
    from nemo_factuality.launch import nemorun

    if args.dry_run:
        out = args.out or DRY_RUN_DIR / f"{stage_name}.nemo_run.sbatch"
        print(nemorun.dry_run(job, out), end="")
        print(f"# NeMo-Run's het-job script written to {out}", file=sys.stderr)
        return 0
    try:
        job_id, folder = nemorun.submit(job)
    except nemorun.SubmitFailed as err:
        print(f"nemo-factuality launch: error: sbatch failed through NeMo-Run ({err.code}): {err}", file=sys.stderr)
        return err.code
    print(job_id)
    print(f"# submitted through NeMo-Run as job {job_id} (experiments in {folder}); logs in "
          f"{job.cluster.log_root}/{job.stage.job_name}-{job_id}/", file=sys.stderr)
    return 0
