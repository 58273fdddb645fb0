"""``nemo-factuality lab``: world → KB → policy → each method's training → evaluation → one report.

The world is the synthetic one (invented people; a tiny policy pretrained here) or the countries (real facts; a real
pretrained policy, ``countries_config``): ``LabConfig.world_name``, ``lab/worlds.py``.

Run folder layout::

    DIR/report.json, report.md, plots/*.png                 over all seeds (mean ± sd when there are several)
    DIR/seed<N>/world/{people,bios,facts,passages}.jsonl, splits.json, gold.json   the seed's synthetic world
                     ({countries,facts,passages}.jsonl, splits.json, gold.json for the countries)
    DIR/seed<N>/kb.sqlite                                    its knowledge store (passages + facts)
    DIR/seed<N>/rl_prompts.jsonl                             the RL prompts with their reward columns (a train data file)
    DIR/seed<N>/checkpoints/base, checkpoints/<method>       HF checkpoints (tokenizer included)
    DIR/seed<N>/rl/<method>/                                 the stage's own run dir (metrics.jsonl, checkpoints, final/)
    DIR/seed<N>/metrics/pretrain.jsonl, <method>_{train,val}.jsonl
    DIR/seed<N>/eval/<set>_<policy>/                         each ``nemo-factuality eval`` run
    DIR/seed<N>/report.json                                  that seed's blocks, with per-person FActScore terms

One seed's work is a *prepare* task (world, pretraining, the base's evaluations and the validation-tuned
references) followed by one task per method. Tasks run in ``jobs`` worker processes with ``threads`` torch
threads each (see ``configure_threads``): tiny models gain little from a second thread, and one extra
thread per process is what made a shared machine 8× slower.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nemo_factuality.lab import world as W
from nemo_factuality.lab.methods import GROUPS, METHODS, load_stage_config, route_overrides
from nemo_factuality.lab.policy import PolicyConfig
from nemo_factuality.lab.worlds import get_world

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabConfig:
    """Everything one lab run does; ``quick_config`` shrinks it for CI."""

    world: W.WorldConfig = W.WorldConfig()
    n_val: tuple[int, int, int] = (10, 15, 25)
    n_heldout: tuple[int, int, int] = (40, 40, 40)
    policy: PolicyConfig = PolicyConfig()
    pretrain_budget_s: float = 1200.0  # a cap on wall time; the step count is the setting
    pretrain_steps: int = 450  # enough to know popular people, not rare ones: training has something to calibrate
    methods: tuple[str, ...] = GROUPS["all"]
    presets: dict[str, str] = field(default_factory=lambda: {"grpo": "grpo", "ppo": "ppo", "kto": "kto"})
    overrides: tuple[str, ...] = ()  # [method:]key=value on the stage configs, [method:]reward.key=value on the rewards
    eval_samples: int = 4
    temperatures: tuple[float, ...] = (0.25, 0.5, 0.75)  # tried on validation for the tuned-temperature reference
    thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # ... and for the threshold reference
    checklist_samples: int = 4  # base samples per prompt for KLCF's checklists
    reward_transport: str = "pytriton"  # pytriton | inprocess
    balanced_rl_prompts: bool = True
    trainable: str = "calibration"  # calibration | abstention | all (see lab/train.py)
    seeds: tuple[int, ...] = (0,)
    jobs: int = 1  # worker processes (1: everything in this process)
    threads: int = 1  # torch threads per process
    world_name: str = "synthetic"  # synthetic | countries (lab/worlds.py)
    real_policy: str | None = None  # countries: a model-zoo name or an HF folder (lab/real_policy.py)
    max_new_tokens: int = 64  # every evaluation's and validation's response length (the stages': length_params)
    countries_per_tier: int | None = None  # countries: a world of this many countries per tier (None: all of them)
    n_rl: tuple[int, int, int] | None = None  # RL entities kept per tier (None: every entity not held out or validated)
    n_rl_eval: tuple[int, int, int] | None = None  # RL entities scored after training, per tier (None: n_heldout's)


def quick_config() -> LabConfig:
    """A small world a 2-layer policy memorises in a few hundred steps (CI)."""
    return LabConfig(world=W.WorldConfig(n_people=(20, 30, 60), bios_per_person=(12, 3, 1)),
                     n_val=(4, 4, 8), n_heldout=(6, 8, 16), pretrain_steps=300,
                     policy=PolicyConfig(hidden=96, layers=2, heads=4, intermediate=256),
                     presets={"grpo": "grpo_quick", "ppo": "ppo_quick", "kto": "kto_quick"})


def countries_config(policy: str, quick: bool = False) -> LabConfig:
    """The countries world asked of a real model. Sized for the 2-core machine's hour (``docs/benchmarks.md``): per
    tier 10 held-out, 5 validation and 12 RL-prompt countries (the rest unused; 4 of them scored after training); 2
    samples per country at T=1, 64 new tokens; each method 80 policy samples (``conf/lab/*_countries.yaml``).
    ``quick``: 3 countries per tier, one step per method (CI)."""
    presets = {stage: f"{stage}_countries{'_quick' if quick else ''}" for stage in ("grpo", "ppo", "kto")}
    common = {"world_name": "countries", "real_policy": policy, "presets": presets, "trainable": "top_layers",
              "temperatures": (0.5,), "thresholds": (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)}
    if quick:
        return LabConfig(n_val=(1, 1, 1), n_heldout=(1, 1, 1), eval_samples=1, checklist_samples=1, max_new_tokens=24,
                         countries_per_tier=3, thresholds=(0.8,), **{k: v for k, v in common.items() if k != "thresholds"})
    return LabConfig(n_val=(5, 5, 5), n_heldout=(10, 10, 10), n_rl=(12, 12, 12), n_rl_eval=(4, 4, 4), eval_samples=2,
                     checklist_samples=1, max_new_tokens=64, **common)


# ---------------------------------------------------------------------------------------------- threads, timing
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
_QUIET = ("nemo_factuality.trainers", "nemo_factuality.evaluation", "nemo_factuality.serving", "nemo_factuality.knowledge",
          "pytriton")


def configure_threads(threads: int) -> None:
    """One pool size for every library that would start its own: torch intra-op (and inter-op, when still
    settable), OpenMP/MKL children such as the reward server's Triton stub, and the Rust tokenizers' pool."""
    import torch

    for var in _THREAD_VARS:
        os.environ[var] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["TQDM_DISABLE"] = "1"  # workers log progress lines; interleaved bars from several processes are noise
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(threads)


def quiet_libraries() -> None:
    """The lab logs its own progress; the stages' per-step lines and the eval command's are left to their files."""
    import transformers

    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()  # e.g. the critic's "score head newly initialised" load report


@contextlib.contextmanager
def lab_process(threads: int) -> Iterator[None]:
    """``configure_threads`` and ``quiet_libraries`` for the run, undone afterwards (the lab may run inside a
    longer-lived process, e.g. the tests)."""
    import torch
    import transformers

    env = {k: os.environ.get(k) for k in (*_THREAD_VARS, "TOKENIZERS_PARALLELISM", "TQDM_DISABLE")}
    levels = {name: logging.getLogger(name).level for name in _QUIET}
    torch_threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    configure_threads(threads)
    quiet_libraries()
    try:
        yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        torch.set_num_threads(torch_threads)
        transformers.logging.set_verbosity(verbosity)


def _usage() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@contextlib.contextmanager
def timed(into: dict[str, Any], name: str) -> Iterator[None]:
    """Wall and CPU seconds (this process and its finished children, e.g. the Triton server)."""
    wall, cpu = _usage()
    log.info("lab: %s", name)
    yield
    end_wall, end_cpu = _usage()
    into[name] = {"wall_s": end_wall - wall, "cpu_s": end_cpu - cpu}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- one seed: prepare
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


def rl_sample(splits: W.Splits, tiers: dict[str, str], n_heldout: tuple[int, int, int]) -> list[str]:
    """RL-prompt entities to evaluate on: the same tier mix and size as the held-out set."""
    out = []
    for tier, k in zip(W.TIERS, n_heldout, strict=True):
        out += [x for x in splits.rl if tiers[x] == tier][:k]
    return out


def prepare_seed(cfg: LabConfig, seed: int, out: Path) -> dict[str, Any]:
    """World, knowledge store, base policy (pretrained here, or the real one), the base's evaluations and the
    validation-tuned references."""
    import torch

    torch.manual_seed(seed)
    timings: dict[str, Any] = {}
    make = _real_world if cfg.world_name == "countries" else _synthetic_world
    world_ctx, model, tok = make(cfg, seed, out, timings)
    kb = Path(world_ctx["kb"])
    splits, tiers = W.Splits(**world_ctx["splits"]), world_ctx["tiers"]
    rl_names = rl_sample(splits, tiers, cfg.n_rl_eval or cfg.n_heldout)
    with timed(timings, f"seed {seed}: base evaluations"):
        tuning = tune_references_for(cfg, model, tok, splits.val, tiers, kb, seed)
        blocks = base_blocks(cfg, model, tok, splits, rl_names, tiers, kb, out, seed, tuning)
    ctx = {"seed": seed, "dir": str(out), **world_ctx, "rl_sample": rl_names, "base_blocks": blocks, "tuning": tuning,
           "timings": timings}
    if "klcf" in cfg.methods:
        with timed(timings, f"seed {seed}: klcf checklists"):
            ctx["checklists"] = str(klcf_checklists(cfg, model, tok, [*splits.rl, *splits.val], kb, out, seed))
    write_rl_prompts(cfg, ctx, out / "rl_prompts.jsonl")
    return ctx


def write_rl_prompts(cfg: LabConfig, ctx: dict[str, Any], path: Path) -> None:
    """The RL prompt pool the methods train on, one JSON line each with every column a lab reward reads (``topic``,
    ``ground_truth``, and ``checklist`` when KLCF ran): a ``nemo-factuality train`` data file (``data.format=jsonl``)
    for the day-one recipes of docs/getting_started.md, which train against this seed's base and store."""
    gold = json.loads(Path(ctx["gold"]).read_text(encoding="utf-8"))
    checklists = json.loads(Path(ctx["checklists"]).read_text(encoding="utf-8")) if "checklists" in ctx else None
    columns = ("topic", "ground_truth", *(("checklist",) if checklists else ()))
    pool = rl_prompt_pool(W.Splits(**ctx["splits"]).rl, ctx["tiers"], cfg.balanced_rl_prompts)
    records = prompt_records(cfg.world_name, pool, columns, gold, checklists)
    _write_jsonl(path, [{"prompt": r.prompt, **r.columns} for r in records])


def _synthetic_world(cfg: LabConfig, seed: int, out: Path, timings: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """The invented people, their store, and a tiny policy pretrained on their bios."""
    from nemo_factuality.lab.policy import build_policy, encode_docs, pretrain, train_tokenizer

    with timed(timings, f"seed {seed}: world"):
        wcfg = replace(cfg.world, seed=seed)
        people = W.make_people(wcfg)
        bios = W.make_bios(people, wcfg)
        splits = W.split_people(people, cfg.n_val, cfg.n_heldout, seed)
        kb = W.build_world_kb(W.write_world(out / "world", people, bios, splits), out / "kb.sqlite")
    with timed(timings, f"seed {seed}: pretrain"):
        base = out / "checkpoints" / "base"
        tok = train_tokenizer([f"{b['prompt']} {b['response']}" for b in bios], base)
        model = build_policy(len(tok), cfg.policy, seed, tok)
        ids, mask = encode_docs(tok, bios)
        curve = pretrain(model, ids, mask, budget_s=cfg.pretrain_budget_s, max_steps=cfg.pretrain_steps, seed=seed)
        model.save_pretrained(base)
        _write_jsonl(out / "metrics" / "pretrain.jsonl", curve)
    gold = {p.name: dict(p.facts) for p in people}
    return ({"kb": str(kb), "base": str(base), "splits": asdict(splits), "tiers": {p.name: p.tier for p in people},
             "gold": _write_gold(out, gold), "pretrain": {"steps": curve[-1]["step"], "final_loss": curve[-1]["loss"]}},
            model, tok)


def _real_world(cfg: LabConfig, seed: int, out: Path, timings: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """The countries, their store, and the real policy as it comes (no pretraining)."""
    from nemo_factuality.lab import countries as C
    from nemo_factuality.lab.real_policy import load_policy, resolve_policy

    with timed(timings, f"seed {seed}: world"):
        countries = C.make_countries()
        if cfg.countries_per_tier is not None:
            countries = C.sample_countries(countries, cfg.countries_per_tier, seed)
        splits = W.split_people(countries, cfg.n_val, cfg.n_heldout, seed)
        if cfg.n_rl is not None:  # a real model's step is costly: the stages see a few dozen RL prompts, not 180
            tier = {c.name: c.tier for c in countries}
            splits = replace(splits, rl=[x for t, k in zip(C.TIERS, cfg.n_rl, strict=True)
                                         for x in [y for y in splits.rl if tier[y] == t][:k]])
        kb = W.build_world_kb(C.write_world(out / "world", countries, splits), out / "kb.sqlite")
    with timed(timings, f"seed {seed}: policy"):
        base = resolve_policy(cfg.real_policy or "")
        model, tok = load_policy(base)
    gold = {c.name: C.gold_column(c) for c in countries}
    return ({"kb": str(kb), "base": str(base), "splits": asdict(splits), "tiers": {c.name: c.tier for c in countries},
             "gold": _write_gold(out, gold), "pretrain": None}, model, tok)


def _write_gold(out: Path, gold: dict[str, dict[str, str]]) -> str:
    path = out / "world" / "gold.json"
    path.write_text(json.dumps(gold, ensure_ascii=False), encoding="utf-8")
    return str(path)


def _eval_kw(cfg: LabConfig) -> dict[str, Any]:
    """What every sampling call of one run shares: the world and the response length."""
    return {"world": get_world(cfg.world_name), "max_new_tokens": cfg.max_new_tokens}


def tune_references_for(cfg: LabConfig, model: Any, tok: Any, names: list[str], tiers: dict[str, str], kb: Path,
                        seed: int) -> dict[str, Any]:
    from nemo_factuality.lab.decoding import tune_references

    return tune_references(model, tok, names, tiers, kb, n=cfg.eval_samples, temperatures=cfg.temperatures,
                           thresholds=cfg.thresholds, seed=seed + 3, **_eval_kw(cfg))


def base_blocks(cfg: LabConfig, model: Any, tok: Any, splits: W.Splits, rl_names: list[str], tiers: dict[str, str],
                kb: Path, out: Path, seed: int, tuning: dict[str, Any]) -> dict[str, Any]:
    """The base on the held-out entities at every reference decoding (one sampling per decoding: the thresholded
    references decline sentences of the same samples), on the RL sample, and on validation."""
    from nemo_factuality.lab.evaluate import rows_from, run_eval, sample_world

    kw, eval_seed, n = _eval_kw(cfg), seed + 7, cfg.eval_samples
    world = kw["world"]
    draw = lambda names, **d: sample_world(world, model, tok, names, seed=eval_seed, max_new_tokens=cfg.max_new_tokens, **d)  # noqa: E731
    t1, greedy = draw(splits.heldout, n=n), draw(splits.heldout, n=1, greedy=True)
    held = splits.heldout
    scored = {"t1": ("base", t1, n, None), "greedy": ("base_greedy", greedy, 1, None),
              "tuned_threshold": ("base_tuned_threshold", t1, n, tuning["threshold"]),
              "greedy_threshold": ("base_greedy_threshold", greedy, 1, tuning["greedy_threshold"])}
    blocks: dict[str, Any] = {"heldout": {}, "rl_prompts": {}}
    for key, (folder, samples, k, tau) in scored.items():
        blocks["heldout"][key] = run_eval(rows_from(samples, held, tiers, n=k, tau=tau, world=world), kb,
                                          out / "eval" / f"heldout_{folder}", world)
    tuned = draw(held, n=n, temperature=tuning["temperature"])
    blocks["heldout"]["tuned_temperature"] = run_eval(rows_from(tuned, held, tiers, n=n, world=world), kb,
                                                      out / "eval" / "heldout_base_tuned_temperature", world)
    blocks["heldout"] = {k: blocks["heldout"][k] for k in ("t1", "greedy", "tuned_temperature", "tuned_threshold",
                                                           "greedy_threshold")}
    rows = rows_from(draw(rl_names, n=n), rl_names, tiers, n=n, world=world)
    blocks["rl_prompts"]["t1"] = run_eval(rows, kb, out / "eval" / "rl_prompts_base", world)
    blocks["validation"] = validation_blocks(model, tok, splits.val, tiers, kb, cfg, seed)
    return blocks


def klcf_checklists(cfg: LabConfig, model: Any, tok: Any, names: list[str], kb: Path, out: Path, seed: int) -> Path:
    """KLCF's offline step: what the base already knows about each entity, as the supported claims of
    ``checklist_samples`` base samples (``rewards.klcf_checklist.checklist_for`` with the lab's pipeline)."""
    from nemo_factuality.lab.evaluate import sample_world
    from nemo_factuality.lab.pipeline import lab_pipeline
    from nemo_factuality.rewards.klcf_checklist import checklist_for

    n, world = cfg.checklist_samples, get_world(cfg.world_name)
    samples = sample_world(world, model, tok, names, n=n, seed=seed + 11, max_new_tokens=cfg.max_new_tokens)
    pipeline = lab_pipeline(str(kb), world=world.name)
    lists = {x: checklist_for(pipeline, world.prompt_for(x), [s.response for s in samples[i * n : (i + 1) * n]])
             for i, x in enumerate(names)}
    path = out / "klcf_checklists.json"
    path.write_text(json.dumps(lists, ensure_ascii=False), encoding="utf-8")
    return path


def validation_blocks(model: Any, tok: Any, names: list[str], tiers: dict[str, str], kb: Path, cfg: LabConfig,
                      seed: int) -> dict[str, Any]:
    """A policy on the validation entities at T=1 and greedy: what design choices are compared on."""
    from nemo_factuality.lab.evaluate import responses_for, score_rows

    kw = _eval_kw(cfg)
    return {key: score_rows(responses_for(model, tok, names, tiers, n=cfg.eval_samples, seed=seed + 13, **kw, **d), kb,
                            kw["world"])
            for key, d in (("t1", {}), ("greedy", {"greedy": True}))}


# ---------------------------------------------------------------------------------------------- one seed: a method
def prompt_records(world_name: str, names: list[str], columns: tuple[str, ...], gold: dict[str, dict[str, str]],
                   checklists: dict[str, list[str]] | None) -> list[Any]:
    """``PromptRecord``s (the world's prompt, chat messages when it has them) with the columns a method's reward reads."""
    world = get_world(world_name)

    def cols(name: str) -> dict[str, Any]:
        table = {"ground_truth": lambda: gold[name], "topic": lambda: name, "checklist": lambda: (checklists or {})[name]}
        return {c: table[c]() for c in columns}

    return [world.record(x, cols(x)) for x in names]


# reward options that are "how many slots an answer has" (FactAlign's K, KnowRL's length penalty γ): 6 on the
# synthetic world's bios, 4 on a country's profile
_SLOT_OPTIONS = {"lab_factalign": ("k",), "lab_knowrl": ("gamma",)}


def run_method(cfg: LabConfig, ctx: dict[str, Any], name: str) -> dict[str, Any]:
    """Train ``name`` from the seed's base through its stage, then score it (held-out at T=1 and greedy, RL
    prompts at T=1, the learned-temperature check). Returns the method's blocks for the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_factuality.lab.decoding import effective_temperature
    from nemo_factuality.lab.evaluate import responses_for, run_eval
    from nemo_factuality.lab.reward import build_lab_reward
    from nemo_factuality.lab.train import Validator, lab_reward, train_stage

    method, seed, out, kb, base = METHODS[name], ctx["seed"], Path(ctx["dir"]), Path(ctx["kb"]), Path(ctx["base"])
    world, kw = get_world(cfg.world_name), _eval_kw(cfg)
    stage_overrides, reward_overrides = route_overrides(cfg.overrides, cfg.methods)[name]
    splits, tiers, timings = W.Splits(**ctx["splits"]), ctx["tiers"], {}
    gold = json.loads(Path(ctx["gold"]).read_text(encoding="utf-8"))
    checklists = json.loads(Path(ctx["checklists"]).read_text(encoding="utf-8")) if "checklists" in ctx else None
    pool = rl_prompt_pool(splits.rl, tiers, cfg.balanced_rl_prompts)
    records = prompt_records(world.name, pool, method.columns, gold, checklists)
    val_records = prompt_records(world.name, splits.val, method.columns, gold, checklists)
    slots = {option: world.slots for option in _SLOT_OPTIONS.get(method.reward["name"], ())}  # K = the answer's slots
    spec = {**method.reward, **slots, **reward_overrides, "store_path": str(kb), "world": world.name}
    slot_reward = build_lab_reward(str(kb), world=world.name)
    with timed(timings, f"seed {seed}: {name}: train"), lab_reward(cfg.reward_transport, spec, base, out / "rl" / name / "triton.log",
                                                                   world.response_marker) as (reward, via):
        stage_cfg = load_stage_config(method.stage, cfg.presets[method.stage],
                                      [f"model.path={base}", f"exp_manager.explicit_log_dir={out / 'rl' / name}",
                                       f"trainer.seed={seed}", *via, *stage_overrides])
        model, history, validator = train_stage(
            method.stage, stage_cfg, base, out / "rl" / name, reward, records,
            lambda m, t: Validator(m, t, reward, val_records, cfg.eval_samples, slot_reward, f"seed {seed}: {name}: ",
                                   cfg.max_new_tokens, max_steps=stage_cfg.trainer.max_steps),
            cfg.trainable)
    tok = AutoTokenizer.from_pretrained(base)
    model.save_pretrained(out / "checkpoints" / name)
    tok.save_pretrained(out / "checkpoints" / name)
    _write_jsonl(out / "metrics" / f"{name}_train.jsonl", history)
    _write_jsonl(out / "metrics" / f"{name}_val.jsonl", validator.log)
    eval_seed = seed + 7
    result: dict[str, Any] = {"heldout": {}, "rl_prompts": {}}
    with timed(timings, f"seed {seed}: {name}: evaluate"):
        for key, d in (("t1", {}), ("greedy", {"greedy": True})):
            rows = responses_for(model, tok, splits.heldout, tiers, n=cfg.eval_samples, seed=eval_seed, **kw, **d)
            result["heldout"][key] = run_eval(rows, kb, out / "eval" / f"heldout_{name}{'_greedy' if d else ''}", world)
        rows = responses_for(model, tok, ctx["rl_sample"], tiers, n=cfg.eval_samples, seed=eval_seed, **kw)
        result["rl_prompts"]["t1"] = run_eval(rows, kb, out / "eval" / f"rl_prompts_{name}", world)
        result["validation"] = validation_blocks(model, tok, splits.val, tiers, kb, cfg, seed)
        base_model = AutoModelForCausalLM.from_pretrained(base).eval()
        abstain_id = tok.convert_tokens_to_ids(W.ABSTAIN_VALUE) if world.name == "synthetic" else None
        t_eff = effective_temperature(base_model, model, tok, splits.val, n=cfg.eval_samples, abstain_id=abstain_id,
                                      seed=seed + 5, **kw)
        result["effective_temperature"] = t_eff
        rows = responses_for(base_model, tok, splits.heldout, tiers, n=cfg.eval_samples, seed=eval_seed, temperature=t_eff, **kw)
        result["heldout"]["base_at_t_eff"] = run_eval(rows, kb, out / "eval" / f"heldout_base_at_t_eff_{name}", world)
    samples = _samples_per_step(method.stage, stage_cfg)
    result["training"] = {"stage": method.stage, "steps": _steps_run(history), "best_step": validator.best_step,
                          "val_reward_base": validator.log[0]["val/reward"], "val_reward_best": validator.best_value,
                          "policy_samples_budget": samples * _budget_steps(method.stage, stage_cfg),
                          "val": validator.log, "timings": timings}
    return result


def _samples_per_step(stage: str, c: Any) -> int:
    if stage == "grpo":
        return c.grpo.num_prompts_per_step * c.grpo.num_rollouts_per_prompt
    if stage == "ppo":
        return c.ppo.num_prompts_per_step
    return c.kto.prompts_per_iteration * c.kto.samples_per_prompt


def _budget_steps(stage: str, c: Any) -> int:
    return c.kto.num_iterations if stage == "kto" else c.trainer.max_steps


def _steps_run(history: list[dict]) -> int:
    return max((int(h["step"]) for h in history if "step" in h), default=0)


# ---------------------------------------------------------------------------------------------- the scheduler
class _Inline:
    """``ProcessPoolExecutor``'s ``submit`` for ``jobs=1``: run now, in this process."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _worker_init(threads: int) -> None:
    from nemo_factuality.stopping import ignore_stop_signals_in_workers

    ignore_stop_signals_in_workers()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    configure_threads(threads)


# in the output folder while a run has not finished (a crash or a stop leaves it, saying which)
INCOMPLETE = "INCOMPLETE"


def run_lab(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """The whole lab over ``cfg.seeds``; writes every artefact under ``out`` and returns the report dict."""
    from nemo_factuality.lab.report import write_report
    from nemo_factuality.stopping import Stopped, stop_on_signals

    out.mkdir(parents=True, exist_ok=True)
    incomplete = out / INCOMPLETE
    incomplete.write_text("running: this run has not finished (no report yet)\n", encoding="utf-8")
    with lab_process(cfg.threads):
        start = _usage()
        try:
            with stop_on_signals("lab"):
                results = _run_tasks(cfg, out)
        except Stopped as err:
            incomplete.write_text(f"incomplete: {err}; rerun the command for a report\n", encoding="utf-8")
            raise
        end = _usage()
        report = write_report(cfg, results, out, {"wall_s": end[0] - start[0], "cpu_s": end[1] - start[1]})
        incomplete.unlink()
        return report


def _run_tasks(cfg: LabConfig, out: Path) -> dict[int, dict[str, Any]]:
    """Each seed's prepare task, then its method tasks as soon as it is done, on ``cfg.jobs`` workers."""
    results: dict[int, dict[str, Any]] = {}
    if cfg.jobs > 1:
        import multiprocessing

        pool: Any = ProcessPoolExecutor(cfg.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                        initargs=(cfg.threads,))
    else:
        pool = _Inline()
    try:
        _schedule(cfg, out, pool, results)
    except BaseException:
        # a stop, or a failed task: the workers and the servers they started go now, not after their running tasks
        # (the pool's shutdown would wait for them)
        from nemo_factuality.stopping import stop_process_trees

        workers = list(getattr(pool, "_processes", None) or {})
        stopped = stop_process_trees(workers)
        log.warning("lab: stopped %d worker processes and the processes they had started", stopped)
        if cfg.jobs > 1:
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    if cfg.jobs > 1:
        pool.shutdown(wait=True)
    return results


def _schedule(cfg: LabConfig, out: Path, pool: Any, results: dict[int, dict[str, Any]]) -> None:
    """Submit each seed's prepare task, then its method tasks once it is done; collect into ``results``."""
    pending: dict[Future, tuple[int, str | None]] = {
        pool.submit(prepare_seed, cfg, s, out / f"seed{s}"): (s, None) for s in cfg.seeds}
    while pending:
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for fut in done:
            seed, method = pending.pop(fut)
            value = fut.result()  # a failed task fails the run, with its own traceback
            if method is None:
                results[seed] = {"context": value, "methods": {}}
                for name in cfg.methods:
                    pending[pool.submit(run_method, cfg, value, name)] = (seed, name)
            else:
                results[seed]["methods"][method] = value
                log.info("lab: seed %d: %s done", seed, method)

