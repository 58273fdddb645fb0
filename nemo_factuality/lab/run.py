"""``nemo-factuality lab``: world → KB → tiny policy → factuality RL → evaluation → report, in one run folder.

Run folder layout::

    DIR/world/{people,bios,facts,passages}.jsonl, splits.json   the synthetic world
    DIR/kb.sqlite                                               the knowledge store (passages + facts)
    DIR/checkpoints/base, DIR/checkpoints/rl[_<variant>]         HF checkpoints (tokenizer included)
    DIR/metrics/pretrain.jsonl, rl[_<variant>]_{train,val}.jsonl
    DIR/eval/<set>_<when>/                                      each ``nemo-factuality eval`` run
    DIR/report.json, report.md, plots/*.png
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nemo_factuality.lab import world as W
from nemo_factuality.lab.evaluate import responses_for, run_eval
from nemo_factuality.lab.policy import PolicyConfig, build_policy, encode_docs, pretrain, sample, train_tokenizer
from nemo_factuality.lab.rl import RLConfig, train_rl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabConfig:
    """Everything one lab run does; ``quick_config`` shrinks it for CI."""

    world: W.WorldConfig = W.WorldConfig()
    n_val: tuple[int, int, int] = (10, 15, 25)
    n_heldout: tuple[int, int, int] = (40, 40, 40)
    policy: PolicyConfig = PolicyConfig()
    pretrain_budget_s: float = 300.0
    pretrain_steps: int = 1500
    reward: dict[str, Any] = field(default_factory=lambda: {"name": "lab_slots", "wrong_penalty": 1.0, "mode": "dual"})
    rl: RLConfig = RLConfig()
    eval_samples: int = 4
    tau: float = 0.5
    reward_transport: str = "pytriton"  # pytriton | inprocess
    compare: bool = False
    seed: int = 0


def quick_config(seed: int = 0) -> LabConfig:
    return LabConfig(world=W.WorldConfig(n_people=(30, 60, 150), bios_per_person=(16, 4, 1), seed=seed),
                     n_val=(5, 5, 10), n_heldout=(10, 15, 25), pretrain_budget_s=70.0, pretrain_steps=400,
                     rl=RLConfig(max_steps=25, budget_s=50.0, prompts_per_step=16, val_every=5, patience=3, seed=seed),
                     eval_samples=2, seed=seed)


@contextlib.contextmanager
def reward_endpoint(cfg: LabConfig, kb: Path, tokenizer_dir: Path, reward_spec: dict[str, Any]) -> Iterator[Any]:
    """The lab reward, served on PyTriton in this process (default) or called in-process."""
    from nemo_factuality.registry import REWARDS

    spec = {**reward_spec, "store_path": str(kb), "tokenizer": str(tokenizer_dir)}
    reward = REWARDS.build(spec)
    if cfg.reward_transport == "inprocess":
        yield reward
        return
    from nemo_factuality.serving.client import RemoteFactualityReward
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.testing.ports import free_ports

    ports = free_ports(5)
    serve_cfg = ServeConfig(reward=spec, policy_tokenizer=str(tokenizer_dir), host="127.0.0.1", http_port=ports[0],
                            grpc_port=ports[1], triton_metrics_port=ports[2], health_port=ports[3], metrics_port=ports[4])
    with FactualityRewardServer(serve_cfg, reward):
        yield RemoteFactualityReward(f"http://127.0.0.1:{ports[0]}")


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


def rl_sample(splits: W.Splits, people: list[W.Person], n_heldout: tuple[int, int, int]) -> list[str]:
    """RL-prompt entities to evaluate on: the same tier mix and size as the held-out set."""
    by_tier = {p.name: p.tier for p in people}
    out = []
    for tier, k in zip(W.TIERS, n_heldout):
        out += [x for x in splits.rl if by_tier[x] == tier][:k]
    return out


def make_validator(model, tok, reward, val_names: list[str], n: int):
    """``validate(step)``: mean lab reward, precision and claims on the validation entities."""
    prompts = [W.prompt_for(x) for x in val_names]

    def validate(step: int) -> dict[str, float]:
        samples = sample(model, tok, prompts, n=n, seed=10_000 + step)
        batch = reward([s.prompt for s in samples], [s.response for s in samples])
        comp = batch.components
        return {"val_reward": float(np.mean(batch.scores)),
                "val_precision": float(comp["supported"].sum() / max(comp["claims"].sum(), 1)),
                "val_claims": float(np.mean(comp["claims"]))}

    return validate


def run_rl_variant(cfg: LabConfig, name: str, reward_spec: dict, rl_cfg: RLConfig, base: Path, kb: Path,
                   splits: W.Splits, out: Path) -> tuple[Any, dict[str, Any]]:
    """Train one RL variant from the base checkpoint; save it and its metrics. Returns (model, info)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    with reward_endpoint(cfg, kb, base, reward_spec) as reward:
        validate = make_validator(model, tok, reward, splits.val, n=cfg.eval_samples)
        train_log, val_log = train_rl(model, tok, reward, [W.prompt_for(x) for x in splits.rl], rl_cfg, validate)
    ckpt = out / "checkpoints" / name
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    _write_jsonl(out / "metrics" / f"{name}_train.jsonl", train_log)
    _write_jsonl(out / "metrics" / f"{name}_val.jsonl", val_log)
    best = max(val_log, key=lambda v: v["val_reward"])
    return model, {"steps": len(train_log), "best_step": best["step"], "train": train_log, "val": val_log}


def evaluate(model, tok, names: list[str], tiers: dict[str, str], kb: Path, out_dir: Path, cfg: LabConfig,
             **kwargs: Any) -> dict[str, Any]:
    rows = responses_for(model, tok, names, tiers, n=cfg.eval_samples, seed=cfg.seed + 7, **kwargs)
    return run_eval(rows, kb, out_dir)


def compare_variants(cfg: LabConfig) -> dict[str, tuple[dict, RLConfig]]:
    """``--compare`` columns: precision-only vs the dual reward; slot-level dense vs response-level advantages."""
    return {"rl_precision_only": ({**cfg.reward, "mode": "precision"}, cfg.rl),
            "rl_slot_dense": (cfg.reward, replace(cfg.rl, advantage="slot"))}


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
        rl_model, info = run_rl_variant(cfg, "rl", cfg.reward, cfg.rl, base, kb, splits, out)
    report["training"] = {"rl": {k: v for k, v in info.items() if k not in ("train", "val")}}
    with clock.phase("eval_after"):
        report["heldout"]["after"] = evaluate(rl_model, tok, splits.heldout, tiers, kb, out / "eval" / "heldout_after", cfg)
        report["rl_prompts"]["after"] = evaluate(rl_model, tok, rl_names, tiers, kb, out / "eval" / "rl_prompts_after", cfg)
    curves = {"rl": info}
    if cfg.compare:
        with clock.phase("compare"):
            for name, (spec, rl_cfg) in compare_variants(cfg).items():
                m, vinfo = run_rl_variant(cfg, name, spec, rl_cfg, base, kb, splits, out)
                report["variants"][name] = {"heldout": evaluate(m, tok, splits.heldout, tiers, kb, out / "eval" / f"heldout_{name}", cfg),
                                            "steps": vinfo["steps"], "best_step": vinfo["best_step"]}
                curves[name] = vinfo
    report["timings"] = clock.phases
    write_report(report, curves, out)
    return report
