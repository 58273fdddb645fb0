"""Decoding-time references and the "learned temperature" check, all decided on validation entities.

* ``tune_references``: the base policy's temperature and decode-time threshold, each picked on the
  *validation* entities by SAFE F1@K (precision and recall of the answer's K slots: neither saying nothing nor
  guessing everything wins, where FActScore alone would pick the coldest T and the highest τ). The threshold
  is picked twice, on T=1 samples and on greedy responses: it applies at either decoding, and a trained
  policy that abstains more is compared with the base thresholded at its own decoding. Held-out entities are
  then scored once at the picked values; each reference's validation scores are kept, for the report to pick
  the best reference on validation too.
* ``effective_temperature``: the final norm's gains multiply every logit, so RL on them can act as an inverse
  temperature. On the trained policy's own responses, the trained logits are regressed on the base logits
  (each position centred over the vocabulary, the abstention token left out, since its row is trained
  directly): ``slope = Σ z_base·z_trained / Σ z_base²`` and ``T_eff = 1 / slope``. A pure temperature
  change gives back exactly that temperature; the report then scores the *base* at ``T_eff`` next to the
  trained policy at T=1, and greedy decoding, which no temperature changes, isolates the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.lab.evaluate import SYNTHETIC, rows_from, sample_world, score_rows
from nemo_factuality.lab.worlds import LabWorld

TUNE_METRIC = "safe_f1"  # SAFE F1@K, K the world's slots (lab/evaluate.py)


def tune_references(model: Any, tokenizer: Any, names: Sequence[str], tiers: dict[str, str], kb: Path, *, n: int,
                    temperatures: Sequence[float], thresholds: Sequence[float], seed: int, world: LabWorld = SYNTHETIC,
                    max_new_tokens: int = 64) -> dict[str, Any]:
    """Pick the base's temperature and its thresholds (at T=1 and at greedy) on validation ``names``; returns
    the picks, the sweeps and ``validation``: each reference's scores at its pick (keys as the report's)."""
    draw = lambda **kw: sample_world(world, model, tokenizer, names, seed=seed, max_new_tokens=max_new_tokens, **kw)  # noqa: E731
    score = lambda samples, k, tau=None: _headline(score_rows(rows_from(samples, names, tiers, n=k, tau=tau, world=world),  # noqa: E731
                                                              kb, world))
    t_sweep: dict[str, dict[str, float]] = {}
    for t in sorted({*temperatures, 1.0}):
        samples = draw(n=n, temperature=t)
        t_sweep[f"{t:g}"] = score(samples, n)
        if t == 1.0:
            at_one = samples
    greedy = draw(n=1, greedy=True)
    tau_sweep = {f"{tau:g}": score(at_one, n, tau) for tau in thresholds}
    greedy_tau_sweep = {f"{tau:g}": score(greedy, 1, tau) for tau in thresholds}
    best_t = max(t_sweep, key=lambda k: (t_sweep[k][TUNE_METRIC], -abs(float(k) - 1.0)))
    best_tau, best_greedy_tau = _pick_threshold(tau_sweep), _pick_threshold(greedy_tau_sweep)
    validation = {"t1": t_sweep["1"], "greedy": score(greedy, 1), "tuned_temperature": t_sweep[best_t],
                  "tuned_threshold": tau_sweep[best_tau], "greedy_threshold": greedy_tau_sweep[best_greedy_tau]}
    return {"metric": TUNE_METRIC, "temperature": float(best_t), "threshold": float(best_tau),
            "greedy_threshold": float(best_greedy_tau), "temperature_sweep": t_sweep, "threshold_sweep": tau_sweep,
            "greedy_threshold_sweep": greedy_tau_sweep, "validation": validation}


def _pick_threshold(sweep: dict[str, dict[str, float]]) -> str:
    """The best τ by the tuning metric; on a tie the lowest, which turns the fewest answers into abstentions."""
    return max(sweep, key=lambda k: (sweep[k][TUNE_METRIC], -float(k)))


def _headline(block: dict[str, Any]) -> dict[str, float]:
    return {k: block[k] for k in ("factscore", TUNE_METRIC, "claims_per_response", "abstain_rate")}


@torch.no_grad()
def effective_temperature(base: Any, trained: Any, tokenizer: Any, names: Sequence[str], *, n: int, abstain_id: int | None,
                          seed: int, world: LabWorld = SYNTHETIC, max_new_tokens: int = 64, batch: int = 128) -> float:
    """``1 / slope`` of the trained policy's centred logits on the base's, over its own T=1 responses to ``names``
    (the abstention token's column, when the world has one, left out)."""
    samples = sample_world(world, trained, tokenizer, names, n=n, seed=seed, max_new_tokens=max_new_tokens)
    keep = torch.ones(base.config.vocab_size, dtype=torch.bool)
    if abstain_id is not None:
        keep[abstain_id] = False
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    num = den = 0.0
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        rows = [s.prompt_ids + s.response_ids for s in chunk]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        scored = torch.zeros((len(rows), width - 1, 1))  # positions whose next token is a response token
        for r, (row, s) in enumerate(zip(rows, chunk, strict=True)):
            ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
            scored[r, len(s.prompt_ids) - 1 : len(row) - 1] = 1.0
        zb, zt = (_centred(m(input_ids=ids, attention_mask=mask).logits[:, :-1, keep]) for m in (base, trained))
        num += float((zb * zt * scored).sum())
        den += float((zb * zb * scored).sum())
    return den / num if num > 0 else float("nan")


def _centred(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() - logits.float().mean(dim=-1, keepdim=True)
