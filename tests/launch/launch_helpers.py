"""Shared by the launcher tests: a shipped stage with every required ``params`` value set, and its rendering."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from nemo_factuality.config import load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import render


def site_value(key: str) -> str:
    """The value the tests give a required launch parameter (a site path; unique per key)."""
    return f"/site/{key}"


def load_site_stage(stage_name: str, overrides: Sequence[str] = ()) -> LaunchConfig:
    """``conf/launch/<stage_name>.yaml`` under ``overrides``, every params key still empty set to ``site_value``."""
    stage = load_config(LaunchConfig, stage_name, list(overrides), group="launch")
    stage.params = {k: site_value(k) if v is None else v for k, v in stage.params.items()}
    return stage


def site_params(stage_name: str) -> list[str]:
    """``params.<key>=<site value>`` for every required key of a shipped stage (command-line overrides)."""
    stage = load_config(LaunchConfig, stage_name, group="launch")
    return [f"params.{k}={site_value(k)}" for k, v in stage.params.items() if v is None]


def rendered(stage_name: str, cluster_name: str = "h100_pyxis", overrides: Sequence[str] = (), **cluster_over) -> str:
    """The script of a shipped stage (params set) on a shipped profile under ``cluster.<key>=<value>`` overrides."""
    cluster = load_config(ClusterProfile, cluster_name, [f"{k}={v}" for k, v in cluster_over.items()], group="cluster")
    return render(stage_name, load_site_stage(stage_name, overrides), cluster)


def srun_steps(text: str) -> list[tuple[str, str]]:
    """``(srun line, the command its bash -c runs)`` of every step of a rendered script, in script order."""
    lines = text.splitlines()
    return [(line, shlex.split(lines[i + 1].strip().removesuffix("&"))[-1])
            for i, line in enumerate(lines) if line.startswith("srun ")]
