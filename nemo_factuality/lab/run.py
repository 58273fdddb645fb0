"""``nemo-factuality lab``: world → KB → tiny policy → factuality RL → evaluation → report, in one run folder.

Run folder layout::

    DIR/world/{people,bios,facts,passages}.jsonl, splits.json   the synthetic world
    DIR/kb.sqlite                                               the knowledge store (passages + facts)
    DIR/checkpoints/base, DIR/checkpoints/rl[_<variant>]         HF checkpoints (tokenizer included)
    DIR/metrics/pretrain.jsonl, rl[_<variant>]_{train,val}.jsonl
    DIR/rl/<variant>/                                           the GRPO stage's run dir (metrics.jsonl, checkpoints, final/)
    DIR/eval/<set>_<when>/                                      each ``nemo-factuality eval`` run
    DIR/report.json, report.md, plots/*.png
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.lab import world as W
from nemo_factuality.lab.evaluate import responses_for, run_eval
from nemo_factuality.lab.policy import PolicyConfig, build_policy, encode_docs, pretrain, train_tokenizer
from nemo_factuality.lab.train import lab_reward, train_grpo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabConfig:
    """Everything one lab run does; ``quick_config`` shrinks it for CI."""

    world: W.WorldConfig = W.WorldConfig()
    n_val: tuple[int, int, int] = (10, 15, 25)
    n_heldout: tuple[int, int, int] = (40, 40, 40)
    policy: PolicyConfig = PolicyConfig()
    pretrain_budget_s: float = 600.0  # a cap on wall time; the step count is the setting
    pretrain_steps: int = 450  # enough to know popular people, not rare ones: RL has something to calibrate
    reward: dict[str, Any] = field(default_factory=lambda: {"name": "lab_slots", "wrong_penalty": 1.0, "mode": "dual"})
    grpo_preset: str = "grpo"  # conf/lab/<preset>.yaml: the GRPO stage's config
    grpo_overrides: tuple[str, ...] = ()  # key=value on top of it
    eval_samples: int = 4
    tau: float = 0.5
    reward_transport: str = "pytriton"  # pytriton | inprocess
    balanced_rl_prompts: bool = True
    trainable: str = "calibration"  # all | calibration (final norm + the abstention row; see lab/train.py)
    compare: bool = False
    seed: int = 0


def quick_config(seed: int = 0) -> LabConfig:
    """A small world a 2-layer policy memorises in a few hundred steps (CI: under 3 minutes)."""
    return LabConfig(world=W.WorldConfig(n_people=(20, 30, 60), bios_per_person=(12, 3, 1), seed=seed),
                     n_val=(4, 4, 8), n_heldout=(6, 8, 16), pretrain_budget_s=120.0, pretrain_steps=300,
                     policy=PolicyConfig(hidden=96, layers=2, heads=4, intermediate=256),
                     grpo_preset="grpo_quick", eval_samples=4, seed=seed)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


class _Clock:
    """Wall and CPU seconds per phase (CPU time is the honest number on a shared machine)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, cpu = time.monotonic(), _cpu_s()
        log.info("lab phase: %s", name)
        yield
        self.phases[name] = {"wall_s": time.monotonic() - wall, "cpu_s": _cpu_s() - cpu}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def build_world(cfg: LabConfig, out: Path) -> tuple[list[W.Person], list[dict], W.Splits, Path]:
    people = W.make_people(cfg.world)
    bios = W.make_bios(people, cfg.world)
    splits = W.split_people(people, cfg.n_val, cfg.n_heldout, cfg.seed)
    paths = W.write_world(out / "world", people, bios, splits)
    kb = W.build_world_kb(paths, out / "kb.sqlite")
    return people, bios, splits, kb


def pretrain_policy(cfg: LabConfig, bios: list[dict], out: Path) -> tuple[Any, Any, Path]:
    base = out / "checkpoints" / "base"
    tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios], base)
    model = build_policy(len(tok), cfg.policy, cfg.seed, tok)
    ids, mask = encode_docs(tok, bios)
    curve = pretrain(model, ids, mask, budget_s=cfg.pretrain_budget_s, max_steps=cfg.pretrain_steps, seed=cfg.seed)
    model.save_pretrained(base)
    _write_jsonl(out / "metrics" / "pretrain.jsonl", curve)
    return model, tok, base


def rl_prompt_pool(rl_names: list[str], tiers: dict[str, str], balanced: bool) -> list[str]:
    """The RL prompt records: every RL entity, with each tier repeated up to the largest tier's size when ``balanced``.

    Without balancing, rare people (most of the world) dominate the batches and "unknown" is reinforced
    everywhere, so the policy also abstains on people it knows; with it, every batch asks about popular
    people (where answering pays) as often as about rare ones (where abstaining pays).
    """
    by_tier = {t: [x for x in rl_names if tiers[x] == t] for t in W.TIERS}
    if not balanced:
        return list(rl_names)
    size = max(len(v) for v in by_tier.values())
    return [names[i % len(names)] for names in by_tier.values() if names for i in range(size)]


def rl_sample(splits: W.Splits, people: list[W.Person], n_heldout: tuple[int, int, int]) -> list[str]:
    """RL-prompt entities to evaluate on: the same tier mix and size as the held-out set."""
    by_tier = {p.name: p.tier for p in people}
    out = []
    for tier, k in zip(W.TIERS, n_heldout, strict=True):
        out += [x for x in splits.rl if by_tier[x] == tier][:k]
    return out


def run_rl_variant(cfg: LabConfig, name: str, reward_spec: dict, overrides: list[str], base: Path, kb: Path,
                   splits: W.Splits, tiers: dict[str, str], out: Path) -> tuple[Any, dict[str, Any]]:
    """Train one RL variant with the GRPO stage from the base checkpoint; export it and its metrics."""
    from transformers import AutoTokenizer

    spec = {**reward_spec, "store_path": str(kb), "tokenizer": str(base)}
    rl_names = rl_prompt_pool(splits.rl, tiers, cfg.balanced_rl_prompts)
    with lab_reward(cfg.reward_transport, spec, base) as (reward, reward_overrides):
        model, train_log, val_log = train_grpo(cfg.grpo_preset, [*reward_overrides, f"trainer.seed={cfg.seed}", *overrides],
                                               base, out / "rl" / name, reward, rl_names, splits.val, cfg.eval_samples,
                                               cfg.trainable)
    ckpt = out / "checkpoints" / name
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(base).save_pretrained(ckpt)
    _write_jsonl(out / "metrics" / f"{name}_train.jsonl", train_log)
    _write_jsonl(out / "metrics" / f"{name}_val.jsonl", val_log)
    best = max(val_log, key=lambda v: v["val/lab_reward"])
    return model, {"steps": len(train_log), "best_step": best["step"], "train": train_log, "val": val_log}


def evaluate(model, tok, names: list[str], tiers: dict[str, str], kb: Path, out_dir: Path, cfg: LabConfig,
             **kwargs: Any) -> dict[str, Any]:
    rows = responses_for(model, tok, names, tiers, n=cfg.eval_samples, seed=cfg.seed + 7, **kwargs)
    return run_eval(rows, kb, out_dir)


def compare_variants(cfg: LabConfig) -> dict[str, tuple[dict, list[str]]]:
    """``--compare`` columns (KLCF's point and RLFH/FSPO's): a precision-only reward instead of the dual one,
    and a response-level advantage (no per-sentence FSPO signs) instead of the sentence-level one."""
    return {"rl_precision_only": ({**cfg.reward, "mode": "precision"}, []),
            "rl_response_level": (cfg.reward, ["grpo.fspo_flip=false"])}


def run_lab(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """The whole lab; writes every artefact under ``out`` and returns the report dict."""
    from nemo_factuality.lab.report import write_report

    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    clock = _Clock()
    with clock.phase("world"):
        people, bios, splits, kb = build_world(cfg, out)
    tiers = {p.name: p.tier for p in people}
    rl_names = rl_sample(splits, people, cfg.n_heldout)
    with clock.phase("pretrain"):
        model, tok, base = pretrain_policy(cfg, bios, out)
    report: dict[str, Any] = {"config": asdict(cfg), "heldout": {}, "rl_prompts": {}, "references": {}, "variants": {}}
    with clock.phase("eval_before"):
        report["heldout"]["before"] = evaluate(model, tok, splits.heldout, tiers, kb, out / "eval" / "heldout_before", cfg)
        report["rl_prompts"]["before"] = evaluate(model, tok, rl_names, tiers, kb, out / "eval" / "rl_prompts_before", cfg)
        report["references"]["greedy"] = evaluate(model, tok, splits.heldout, tiers, kb, out / "eval" / "heldout_greedy", cfg,
                                                  greedy=True)
        report["references"][f"threshold_tau{cfg.tau:g}"] = evaluate(model, tok, splits.heldout, tiers, kb,
                                                                    out / "eval" / "heldout_threshold", cfg, tau=cfg.tau)
    with clock.phase("rl"):
        rl_model, info = run_rl_variant(cfg, "rl", cfg.reward, list(cfg.grpo_overrides), base, kb, splits, tiers, out)
    report["training"] = {"rl": {k: v for k, v in info.items() if k not in ("train", "val")}}
    with clock.phase("eval_after"):
        report["heldout"]["after"] = evaluate(rl_model, tok, splits.heldout, tiers, kb, out / "eval" / "heldout_after", cfg)
        report["rl_prompts"]["after"] = evaluate(rl_model, tok, rl_names, tiers, kb, out / "eval" / "rl_prompts_after", cfg)
    curves = {"rl": info}
    if cfg.compare:
        with clock.phase("compare"):
            for name, (spec, extra) in compare_variants(cfg).items():
                m, vinfo = run_rl_variant(cfg, name, spec, [*cfg.grpo_overrides, *extra], base, kb, splits, tiers, out)
                report["variants"][name] = {"heldout": evaluate(m, tok, splits.heldout, tiers, kb, out / "eval" / f"heldout_{name}", cfg),
                                            "steps": vinfo["steps"], "best_step": vinfo["best_step"]}
                curves[name] = vinfo
    report["timings"] = clock.phases
    write_report(report, curves, out)
    return report
