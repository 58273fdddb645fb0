"""The presets' GPU settings executed on CPU/gloo in the NeMo-Aligner venv (``aligner_settings_driver.py``).

The settings come from a shipped preset's ``common.aligner`` block (``conf/train/aligner/qwen2.5-7b.yaml``):
Megatron-Core's distributed optimizer, sequence parallelism, full activation recompute, Adam-state offload
around generation and bf16 weights with fp32 main weights (``megatron_amp_O2``). At TP=2, at DP=2 (where
Megatron refuses sequence parallelism: every preset has TP > 1) and at TP=2 × DP=2 — the presets' own
combination, all settings together on 4 ranks — three GRPO steps on one fixed batch (a greedy generation between
the first and second) run as:

* ``plain`` — float32, torch AdamW, none of the settings: the reference;
* ``exact`` — every setting but bf16: losses, gradient norms, gradients, updates and greedy tokens equal ``plain``
  up to reduction order (TP=2 and DP=2);
* ``preset`` — every setting in bf16: within bf16 tolerance of ``plain``. The first step's reduced gradient (before
  clipping, on the slices this rank's optimiser owns) is compared with ``plain``'s, its norm within 0.5%: Adam's
  first updates are about lr·sign(g), so comparing updates alone would miss a gradient off by any factor.

Each also checks that its setting's own code ran (a setting silently off would match ``plain`` trivially) and
that save → load → step equals the uninterrupted step exactly, in the same process and in a new one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nemo_factuality.testing.aligner_env import run_in_aligner_venv

DRIVER = "tests/trainers/aligner_settings_driver.py"
# name: tensor-parallel size, processes (DP = processes / TP), the settings run
LAYOUTS = {"tp2": (2, 2, ("plain", "exact", "preset")), "dp2": (1, 2, ("plain", "exact", "preset")),
           "tp2dp2": (2, 4, ("plain", "preset"))}
pytestmark = pytest.mark.slow


def _program(nemo: Path, out: Path, setting: str, tp: int, *extra: str) -> list[str]:
    return [DRIVER, f"--nemo={nemo}", f"--out={out}", f"--setting={setting}", f"--tp={tp}", *extra]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, venv, stage_policy, tmp_path_factory):
    """(layout name, {setting: per-rank results}) for plain, exact and preset at one layout, and ``resumed``: new
    processes loading the preset run's checkpoint, as a requeued job would. One launcher (``testing.forkrun``) runs
    them in order, each in ranks of its own, NeMo's import paid once for all of them."""
    tp, nproc, settings = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    programs = [_program(stage_policy, root / s, s, tp) for s in settings]
    programs.append(_program(stage_policy, root / "resumed", "preset", tp, f"--resume-from={root / 'preset'}"))
    res = run_in_aligner_venv(venv, programs[0], nproc=nproc, timeout=900, preload=True, then=tuple(programs[1:]))
    assert res.returncode == 0, res.stdout[-6000:]
    runs = {s: [json.loads((root / s / f"rank{r}.json").read_text()) for r in range(nproc)] for s in (*settings, "resumed")}
    for first, resumed in zip(runs["preset"], runs["resumed"], strict=True):  # the resumed ranks were new processes
        assert resumed["pid"] != first["pid"]
    return request.param, runs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _update_error(run: dict, reference: dict) -> float:
    """‖Δ_main − Δ_ref‖ / ‖Δ_ref‖ over the slices of each parameter this rank's optimiser steps."""
    num = den = 0.0
    for name, (start, values) in run["master_update"].items():
        ref = reference["update"][name][start:start + len(values)]
        num += sum((v - r) ** 2 for v, r in zip(values, ref, strict=True))
        den += sum(r * r for r in ref)
    assert den > 0, "the reference run did not move the weights"
    return math.sqrt(num / den)


def _gradient_error(run: dict, reference: dict) -> tuple[float, float]:
    """(‖g − g_ref‖ / ‖g_ref‖, ‖g‖ / ‖g_ref‖) of the first step's reduced gradient over this rank's owned slices."""
    num = den = norm = 0.0
    for name, (start, values) in run["first_gradient"].items():
        ref_start, ref_values = reference["first_gradient"][name]
        ref = ref_values[start - ref_start:start - ref_start + len(values)]
        num += sum((v - r) ** 2 for v, r in zip(values, ref, strict=True))
        den += sum(r * r for r in ref)
        norm += sum(v * v for v in values)
    assert den > 0, "the reference run has no gradient"
    return math.sqrt(num / den), math.sqrt(norm / den)


def _check_settings_ran(runs: list[dict], name: str) -> None:
    tp2, dp2 = name.startswith("tp2"), name.endswith("dp2")
    for rank, r in enumerate(runs):
        probes = r["probes"]
        assert r["optimizer"] == "McoreDistributedOptimizer", r["optimizer"]
        assert probes["recompute"] > 0, probes  # full recompute: every layer's forward checkpointed
        assert probes["offload"] > 0 and probes["onload"] == probes["offload"], probes  # around generation
        assert (probes["reduce_scatter"] > 0) == tp2, probes  # sequence parallelism's reduce-scatter over TP
        if dp2:  # the distributed optimizer's main weights: each DP rank steps its own half of every buffer
            owned = sum(len(v) for _, v in r["master_update"].values())
            total = sum(len(v) for v in r["update"].values())
            assert 0 < owned < total, (rank, owned, total)


def _check_resume_exact(runs: list[dict]) -> None:
    for r in runs:
        assert r["metrics_a"] == r["metrics_b"]
        assert r["lp_a"] == r["lp_b"]


def test_preset_settings_without_bf16_equal_the_plain_run(layout):
    name, runs = layout
    if "exact" not in runs:
        pytest.skip(f"{name} runs the presets' combination in bf16 only (TP=2 and DP=2 check each setting exactly)")
    _check_settings_ran(runs["exact"], name)
    for plain, exact in zip(runs["plain"], runs["exact"], strict=True):
        for mp, me in zip(plain["metrics"], exact["metrics"], strict=True):
            assert _rel(me["loss"], mp["loss"]) < 1e-5 and _rel(me["grad_norm"], mp["grad_norm"]) < 1e-5, (mp, me)
        error, scale = _gradient_error(exact, plain)
        assert error < 1e-5 and abs(scale - 1) < 1e-5, (error, scale)
        assert _update_error(exact, plain) < 1e-4
        assert exact["greedy_tokens"] == plain["greedy_tokens"]
        assert exact["param_dtypes"] == ["torch.float32"]
    _check_resume_exact(runs["exact"])
    _check_resume_exact(runs["plain"])


def test_preset_settings_in_bf16_match_the_plain_run_within_bf16_tolerance(layout):
    name, runs = layout
    _check_settings_ran(runs["preset"], name)
    for plain, preset in zip(runs["plain"], runs["preset"], strict=True):
        assert preset["param_dtypes"] == ["torch.bfloat16"]
        losses = [m["loss"] for m in plain["metrics"]]
        assert len(set(losses)) == len(losses), "the reference losses must move for the comparison to mean anything"
        for mp, mb in zip(plain["metrics"], preset["metrics"], strict=True):
            assert _rel(mb["loss"], mp["loss"]) < 2e-2 and _rel(mb["grad_norm"], mp["grad_norm"]) < 2e-2, (mp, mb)
        # the gradient itself, not only Adam's sign-like first updates: bf16 rounding, never a scale
        error, scale = _gradient_error(preset, plain)
        assert error < 3e-2 and abs(scale - 1) < 5e-3, (error, scale)  # measured: 0.6% and 0.07%
        # bf16 forward/backward, fp32 main weights: Adam's normalised updates agree to a few percent
        assert _update_error(preset, plain) < 0.1
        worst = max(abs(a - b) for ra, rb, rm in zip(plain["lp0"], preset["lp0"], plain["mask"], strict=True)
                    for a, b, m in zip(ra, rb, rm, strict=True) if m)
        assert worst < 0.05, worst  # the response tokens' log-probs in bf16
    _check_resume_exact(runs["preset"])


def test_a_new_process_resumes_the_preset_run_exactly(layout):
    """The checkpoint of the bf16 / distributed-optimizer run, loaded by a fresh process before any step (a requeued
    job), steps exactly as the uninterrupted run did."""
    _, runs = layout
    for first, resumed in zip(runs["preset"], runs["resumed"], strict=True):
        assert resumed["metrics_resumed"] == first["metrics_a"]
        assert resumed["lp_resumed"] == first["lp_a"]
