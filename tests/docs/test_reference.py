"""The generated reference cannot drift: every CLI option, config key, logged metric and exit code is in it."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import reference_gen as gen  # noqa: E402

from nemo_factuality import exit_codes  # noqa: E402
from nemo_factuality.trainers import metric_names  # noqa: E402


def _sections(markdown: str) -> dict[str, str]:
    """``{heading text: section body}`` of a generated page (## and ### headings)."""
    out, current = {}, None
    for line in markdown.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            current = line.lstrip("#").strip().strip("`")
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def test_every_command_module_builds_its_parser():
    from nemo_factuality.cli import COMMANDS

    names = [name for name, _ in gen.command_parsers()]
    assert names == list(COMMANDS)


def test_every_cli_option_is_in_the_reference():
    sections = _sections(gen.cli_markdown())
    missing = []
    for _, parser in gen.command_parsers():
        for sub in gen.walk_parsers(parser):
            options = gen.parser_options(sub)
            if not options:
                continue
            body = sections.get(sub.prog)
            if body is None:
                missing.append(f"{sub.prog}: no section")
                continue
            for action in options:
                if f"| {gen.code(gen.option_name(action))} |" not in body:
                    missing.append(f"{sub.prog} {gen.option_name(action)}")
    assert not missing, missing
    # the train stages' sub-commands are the ones `nemo-factuality train` dispatches to
    from nemo_factuality.trainers.cli import STAGES

    assert {f"nemo-factuality train {s}" for s in STAGES} <= set(sections)


def _walk(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(value):
            keys += _walk(type(value), f"{prefix}{f.name}.")
    return keys


def test_every_config_key_is_in_the_reference_with_type_default_and_meaning():
    text = gen.config_markdown()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if match:
            rows.setdefault(match.group(1), []).append(match.group(2))
    missing, no_meaning = [], []
    for _, _, schemas in gen._schemas():
        for label, cls in schemas:
            for key in _walk(cls):
                if key not in rows:
                    missing.append(f"{label}: {key}")
    for name, factory, options in gen.reward_blocks():
        for key in gen.reward_keys(factory, options):
            if key.path not in rows:
                missing.append(f"reward.{name}: {key.path}")
    assert not missing, missing
    for label, key in gen.all_config_keys():
        if not key.meaning.strip():
            no_meaning.append(f"{label}: {key.path}")
    assert not no_meaning, f"add a comment on the field in its schema: {no_meaning}"


def test_a_config_row_shows_the_schema_default_and_type():
    from nemo_factuality.trainers.config import GRPOConfig

    keys = {k.path: k for k in gen.schema_keys(GRPOConfig)}
    assert keys["grpo.num_rollouts_per_prompt"].default == str(GRPOConfig().grpo.num_rollouts_per_prompt)
    assert keys["model.optim.betas"].default == "[0.9, 0.999]" and keys["model.optim.betas"].type == "list[float]"
    from nemo_factuality.trainers.config import PPOConfig

    critic = {k.path: k for k in gen.schema_keys(PPOConfig)}["critic.optim.lr"]
    assert float(critic.default) == PPOConfig().critic.optim.lr  # a section default that differs from its class's


def test_every_metric_a_stage_logs_is_in_the_catalogue(tmp_path):
    """Runs each stage for two steps (with validation) on the tiny policy and reads its metrics.jsonl."""
    import numpy as np
    import torch

    from nemo_factuality.testing.training import (
        GOOD,
        build_policy,
        good_fraction,
        good_tokens_dense,
        half_good_labeller,
        prompts,
        read_metrics,
    )
    from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic
    from nemo_factuality.trainers.config import GRPOConfig, KTOConfig, PPOConfig
    from nemo_factuality.trainers.data import PreferencePair
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.kto import KTOTrainer
    from nemo_factuality.trainers.ppo import PPOTrainer

    policy = build_policy(tmp_path / "policy")
    torch.manual_seed(0)

    def base(cfg, name):
        cfg.model.path, cfg.model.length_params.max_length = str(policy), 6
        cfg.trainer.max_steps, cfg.trainer.progress_bar, cfg.trainer.save_interval = 2, False, 0
        cfg.trainer.val_check_interval = 1
        cfg.exp_manager.explicit_log_dir, cfg.exp_manager.create_tensorboard_logger = str(tmp_path / name), False
        cfg.reward = {"name": "toy"}
        return cfg

    def signed(prompts_, completions, completion_ids, **_):  # a component and FSPO-style token signs
        batch = good_fraction(prompts_, completions, completion_ids)
        batch.components = {"part": batch.scores * 2}
        batch.token_signs = [np.where(np.isin(ids, list(GOOD)), 1, -1).astype(np.int8) for ids in completion_ids]
        return batch

    cfg = base(GRPOConfig(), "grpo")
    cfg.model.global_batch_size, cfg.model.micro_batch_size, cfg.model.entropy_bonus = 16, 8, 0.01
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_rollouts_per_prompt, cfg.grpo.truncated = 4, 8, "keep"
    GRPOTrainer(cfg, HFActor(cfg.model, max_steps=10), signed, prompts(4), val_data=prompts(2),
                run_dir=tmp_path / "grpo").fit()
    cfg = base(PPOConfig(), "ppo")
    cfg.model.global_batch_size, cfg.model.micro_batch_size, cfg.critic.micro_batch_size = 4, 4, 4
    cfg.ppo.num_prompts_per_step = 4
    PPOTrainer(cfg, HFActor(cfg.model, max_steps=10), HFCritic(cfg.critic, cfg.model.path, max_steps=10),
               good_tokens_dense, prompts(4), val_data=prompts(2), run_dir=tmp_path / "ppo").fit()
    cfg = base(KTOConfig(), "kto")
    cfg.kto.num_iterations, cfg.kto.prompts_per_iteration, cfg.kto.samples_per_prompt = 1, 4, 2
    cfg.model.global_batch_size, cfg.model.micro_batch_size = 4, 4
    KTOTrainer(cfg, HFActor(cfg.model, max_steps=10), half_good_labeller, prompts(4),
               general_pairs=[PreferencePair("hi", "a b", "c d")], run_dir=tmp_path / "kto").fit()

    logged = {stage: set().union(*(r.keys() for r in read_metrics(tmp_path / stage))) for stage in ("grpo", "ppo", "kto")}
    unknown = {stage: sorted(k for k in keys if metric_names.find(k) is None) for stage, keys in logged.items()}
    assert not any(unknown.values()), f"add these to trainers/metric_names.py: {unknown}"
    wrong_stage = sorted(f"{stage}: {k}" for stage, keys in logged.items() for k in keys
                         if stage not in metric_names.find(k).stages)
    assert not wrong_stage, wrong_stage
    # and every catalogued metric is logged by each stage it names (stale entries fail here)
    stale = sorted(f"{m.name} ({stage})" for m in metric_names.METRICS if not m.condition for stage in m.stages
                   if not any(m.matches(k) for k in logged[stage]))
    assert not stale, stale
    text = gen.metrics_markdown()
    assert all(f"`{m.name}`" in text for m in metric_names.METRICS)


def _int_returns_and_codes() -> dict[int, list[str]]:
    """Integer literals the package exits with: ``return N`` in a command's ``main``-like function, and every
    ``exit_code`` / ``EXIT_CODE`` class attribute."""
    found: dict[int, list[str]] = {}
    for path in sorted((ROOT / "nemo_factuality").rglob("*.py")):
        if "testing" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("main", "_main", "run_command", "serve", "run_stage"):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Constant) and type(sub.value.value) is int:
                        found.setdefault(sub.value.value, []).append(f"{where}:{sub.lineno}")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("exit_code", "EXIT_CODE")
                                                    for t in node.targets):
                found.setdefault(-1 if not isinstance(node.value, ast.Constant) else node.value.value, []).append(
                    f"{where}:{node.lineno}")
    return found


def test_every_exit_code_is_in_the_table():
    codes = {e.code for e in exit_codes.EXIT_CODES}
    found = _int_returns_and_codes()
    literal_attrs = [w for code, wheres in found.items() if code != -1 for w in wheres
                     if "exit_code" in (ROOT / w.split(":")[0]).read_text().splitlines()[int(w.split(":")[1]) - 1].lower()]
    assert not literal_attrs, f"use a nemo_factuality.exit_codes constant: {literal_attrs}"
    unknown = {code: wheres for code, wheres in found.items() if code != -1 and code not in codes}
    assert not unknown, f"add these to nemo_factuality/exit_codes.py: {unknown}"
    from nemo_factuality.trainers.runtime import TrainingStalledError
    from nemo_factuality.types import ServerUnavailableError

    assert {TrainingStalledError.exit_code, ServerUnavailableError.exit_code} <= codes
    # the Slurm template requeues on the same code: it takes it from the module (launch.render passes it)
    assert '"$rc" -eq {{ exit_codes.TEMPFAIL }}' in (ROOT / "slurm" / "job_lib.sh.j2").read_text()  # both launch paths' requeue
    text = gen.exit_codes_markdown()
    assert all(f"| {c} |" in text for c in codes)


@pytest.mark.parametrize("page", gen.GENERATED)
def test_the_committed_pages_are_what_the_code_generates(page):
    """Issue 54 item 6: the pages are committed, so the docs' links to them open without a Sphinx build (before: git-
    ignored, dead links on GitHub until a build); a page that differs from the code is stale and fails here."""
    path = ROOT / "docs" / "reference" / page
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert f"docs/reference/{page}" not in ignored, f"docs/reference/{page} is git-ignored: it must be committed"
    assert path.is_file() and path.read_text(encoding="utf-8") == gen.render_all()[page], (
        f"docs/reference/{page} differs from the code: run `python docs/_ext/reference_gen.py` and commit the pages")
