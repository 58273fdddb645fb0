"""Slurm launchers: render het-job sbatch scripts from conf/launch + conf/cluster (never imports trainers)."""
