"""``nemo-factuality train {grpo,ppo,kto} --config-name NAME [--preset PRESET] [key=value ...]`` (also reached as
``python -m nemo_factuality.trainers.<stage>``, whose entry block goes through ``nemo_factuality.cli.run_as_module``).

parse config → build actor (and critic), reward, data → run the stage's trainer → clean up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_factuality.types import ServerUnavailableError

log = logging.getLogger(__name__)

STAGES = {
    "grpo": ("GRPOConfig", "KLCF, FSPO, KnowRL: group-relative policy optimisation"),
    "ppo": ("PPOConfig", "RLFH: PPO with a critic and token-level dense rewards"),
    "kto": ("KTOConfig", "FactAlign: iterated sample → label → KTO + fKTO"),
}


def _parser(stage: str, prog: str | None = None) -> argparse.ArgumentParser:
    from nemo_factuality.cli import ArgumentParser

    prog = prog or f"nemo-factuality train {stage}"
    p = ArgumentParser(prog=prog, usage=f"{prog} --config-name NAME [--preset PRESET] [key=value ...]",
                       description=STAGES[stage][1],
                       epilog="key=value overrides change any config key, e.g. trainer.max_steps=10 model.optim.lr=1e-6")
    _add_stage_arguments(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """``nemo-factuality train`` with one sub-command per stage, each taking ``_parser(stage)``'s arguments
    (``main`` dispatches on the stage name itself; this parser is what the docs' reference reads)."""
    from nemo_factuality.cli import ArgumentParser

    p = ArgumentParser(prog="nemo-factuality train", description="run a training stage")
    sub = p.add_subparsers(dest="stage", required=True, metavar="{" + ",".join(STAGES) + "}")
    for stage, (_, help_) in STAGES.items():
        _add_stage_arguments(sub.add_parser(stage, help=help_, description=help_))
    return p


def _add_stage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-name", default=None,
                   help="conf/train/<name>.yaml (klcf, fspo, knowrl -> grpo; rlfh -> ppo; factalign -> kto) or a YAML path")
    p.add_argument("--preset", default=None,
                   help="a model preset of the stage's trainer.backend (aligner or megatron, named on the command line "
                        "or in the config), conf/train/<backend>/<name>.yaml: its layout, batch sizes and settings for "
                        "this stage (on aligner also the NeMo model settings); key=value overrides still win")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def parse_stage_config(stage: str, argv: Sequence[str] | None, *, prog: str | None = None) -> tuple[Any, dict]:
    """``--config-name NAME [--preset P] key=value …`` → (the stage's validated typed config, the preset's runtime
    fields for the backend builder: an aligner preset's ``AlignerRuntime``, nothing for megatron's); ``ConfigError``
    names the key."""
    from nemo_factuality.cli import split_overrides
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers import config as schemas

    parser = _parser(stage, prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    overrides = split_overrides(args.overrides, parser.prog)
    schema = getattr(schemas, STAGES[stage][0])
    preset_overrides, runtime, backend = [], {}, None
    if args.preset:  # the backend the config and command line name picks the preset folder (conf/train/<backend>/)
        from nemo_factuality.config import load_config
        from nemo_factuality.trainers.presets import load_preset

        backend = load_config(schema, args.config_name, overrides, group="train").trainer.backend
        preset_overrides, runtime = load_preset(backend, args.preset, stage)
    cfg = schemas.load_train_config(schema, args.config_name, [*preset_overrides, *overrides])
    if backend is not None and cfg.trainer.backend != backend:
        raise ConfigError(f"--preset {args.preset} is a {backend}-backend preset (conf/train/{backend}/) but it sets "
                          f"trainer.backend={cfg.trainer.backend}: fix the preset's common.trainer.backend")
    return cfg, runtime


def run_stage(stage: str, argv: Sequence[str] | None) -> int:
    """Build everything from config and run ``stage``; returns the exit code."""
    from nemo_factuality.trainers.data import load_pairs, load_prompts

    cfg, runtime = parse_stage_config(stage, argv)
    if cfg.trainer.backend == "megatron" and not str(cfg.trainer.device).startswith("cuda"):
        from nemo_factuality.config import ConfigError

        # Megatron-Core has no CPU path of its own: the CI's CPU runs patch dozens of its CUDA calls in test drivers,
        # which is not a way to run a user's job
        raise ConfigError(f"trainer.backend=megatron with trainer.device={cfg.trainer.device}: the megatron backend "
                          "trains on GPUs (trainer.device=cuda, one rank per GPU under torchrun or srun); to try it on "
                          "a CPU machine run its smoke kit's CPU path, `bash tools/gpu_smoke.sh --cpu --backend megatron "
                          "--skip-trl` (docs/cluster/gpu.md), or train on trainer.backend=hf")
    if stage == "ppo" and cfg.trainer.backend == "aligner" and not cfg.critic.url:
        from nemo_factuality.config import ConfigError

        raise ConfigError("critic.url must name the critic server: trainer.backend=aligner runs RLFH's critic as "
                          "NeMo-Aligner's critic server (python -m nemo_factuality.trainers.critic_server, same config)")
    # every input is checked before anything is written or loaded
    train = load_prompts(cfg.data.train, cfg.data.format)
    val = load_prompts(cfg.data.validation, cfg.data.format) if cfg.data.validation else None
    pairs = load_pairs(cfg.data.general_pairs) if stage == "kto" and cfg.data.general_pairs else []
    check_model_paths(stage, cfg)
    if cfg.rollout.engine == "vllm":  # before the policy loads (with_rollout_engine checks again for other callers)
        from nemo_factuality.trainers.engines.vllm_engine import engine_python, require_vllm

        # the engine's Python imports vLLM: a seconds-long probe, where the refusal used to come after the weights loaded
        require_vllm(engine_python(cfg.rollout.vllm))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(cfg.exp_manager.explicit_log_dir)
    from nemo_factuality.trainers.resume import check_resume, write_run_config

    resumed = check_resume(run_dir, cfg)  # a checkpoint of another model: one line, before anything loads
    # torch and the backends load only now: a config or input error above reaches the user without their import
    from nemo_factuality.config import to_yaml
    from nemo_factuality.trainers.backends import BACKENDS
    from nemo_factuality.trainers.backends.collectives import ranks_from_slurm
    from nemo_factuality.trainers.runtime import build_reward, seed_everything

    # under torchrun or srun only the job's rank 0 writes the run's files
    writer = int(os.environ.get("RANK") or ranks_from_slurm(os.environ).get("RANK", "0")) == 0
    seed_everything(cfg.trainer.seed)
    actor, critic = BACKENDS.get(cfg.trainer.backend)(cfg, critic=stage == "ppo", **runtime)
    from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine

    actor = with_rollout_engine(cfg, actor, run_dir)  # rollout.engine=vllm: generation on a vLLM engine process
    reward = None
    try:
        reward = build_reward(cfg, actor.tokenizer)
        # start-up passed (models, engine, reward servers): only now does the run folder get its files
        run_dir.mkdir(parents=True, exist_ok=True)
        if writer:
            write_run_config(run_dir, to_yaml(cfg), resumed)  # a resume keeps the first config, its changes beside
        _fit(stage, cfg, actor, critic, reward, train, val, pairs, run_dir)
    except ServerUnavailableError as err:
        # the Slurm launcher requeues on this file as well as on exit 75 (srun may report a killed rank's code)
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "REQUEUE").write_text(f"{' '.join(str(err).split())}\n", encoding="utf-8")
        raise
    finally:
        for client in (reward, critic, actor):  # served rewards, the critic server, a vLLM engine: none outlives the run
            close = getattr(client, "close", None)
            if callable(close):
                close()
    return 0


def check_model_paths(stage: str, cfg: Any) -> None:
    """The hf and megatron backends' models are local directories that will load (``local_models``): checked before anything is
    written. (The aligner backend's ``model.restore_from_path`` is checked where NeMo restores it.)"""
    from nemo_factuality import local_models

    if cfg.trainer.backend in ("hf", "megatron"):
        local_models.check_model_dir(cfg.model.path, "model.path", tokenizer=True)
        if stage == "ppo" and cfg.critic.path:
            local_models.check_model_dir(cfg.critic.path, "critic.path")


def _fit(stage: str, cfg: Any, actor: Any, critic: Any, reward: Any, train: list, val: list | None, pairs: list,
         run_dir: Path) -> None:
    if stage == "grpo":
        from nemo_factuality.trainers.grpo import GRPOTrainer

        GRPOTrainer(cfg, actor, reward, train, run_dir=run_dir, val_data=val).fit()
    elif stage == "ppo":
        from nemo_factuality.trainers.ppo import PPOTrainer

        PPOTrainer(cfg, actor, critic, reward, train, run_dir=run_dir, val_data=val).fit()
    else:
        from nemo_factuality.trainers.kto import KTOTrainer

        KTOTrainer(cfg, actor, reward, train, general_pairs=pairs, run_dir=run_dir).fit()


def main(argv: Sequence[str]) -> int:
    """``nemo-factuality train <stage> ...``."""
    from nemo_factuality.cli import UsageError

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        lines = ["usage: nemo-factuality train {grpo,ppo,kto} --config-name NAME [--preset PRESET] [key=value ...]", "",
                 "stages:"]
        lines += [f"  {k:<6} {v[1]}" for k, v in STAGES.items()]
        print("\n".join(lines))
        return 0
    if argv[0] not in STAGES:
        raise UsageError(f"unknown stage {argv[0]!r}; choose one of {', '.join(STAGES)} (see 'nemo-factuality train --help')")
    return run_stage(argv[0], argv[1:])

