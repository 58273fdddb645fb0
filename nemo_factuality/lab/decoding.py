"""Decoding-time references and the "learned temperature" check, all decided on validation entities.

* ``tune_references``: the base policy's temperature and decode-time threshold, each picked on the
  *validation* entities by SAFE F1@6 (precision and recall of the six slots: neither saying nothing nor
  guessing everything wins, where FActScore alone would pick the coldest T and the highest τ). Held-out
  entities are then scored once at the picked values.
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

from nemo_factuality.lab.evaluate import rows_from, score_rows
from nemo_factuality.lab.policy import sample
from nemo_factuality.lab.world import prompt_for

TUNE_METRIC = "safe_f1@6"


def tune_references(model: Any, tokenizer: Any, names: Sequence[str], tiers: dict[str, str], kb: Path, *, n: int,
                    temperatures: Sequence[float], thresholds: Sequence[float], seed: int) -> dict[str, Any]:
    """Pick the base's temperature and threshold on validation ``names``; returns the picks and both sweeps."""
    prompts = [prompt_for(x) for x in names]
    t_sweep: dict[str, dict[str, float]] = {}
    for t in sorted({*temperatures, 1.0}):
        samples = sample(model, tokenizer, prompts, n=n, temperature=t, seed=seed)
        t_sweep[f"{t:g}"] = _headline(score_rows(rows_from(samples, names, tiers, n=n), kb))
        if t == 1.0:
            at_one = samples
    tau_sweep = {f"{tau:g}": _headline(score_rows(rows_from(at_one, names, tiers, n=n, tau=tau), kb)) for tau in thresholds}
    best_t = max(t_sweep, key=lambda k: (t_sweep[k][TUNE_METRIC], -abs(float(k) - 1.0)))
    best_tau = max(tau_sweep, key=lambda k: (tau_sweep[k][TUNE_METRIC], -float(k)))
    return {"metric": TUNE_METRIC, "temperature": float(best_t), "threshold": float(best_tau),
            "temperature_sweep": t_sweep, "threshold_sweep": tau_sweep}


def _headline(block: dict[str, Any]) -> dict[str, float]:
    return {k: block[k] for k in ("factscore", TUNE_METRIC, "claims_per_response", "abstain_rate")}


@torch.no_grad()
def effective_temperature(base: Any, trained: Any, tokenizer: Any, names: Sequence[str], *, n: int, abstain_id: int,
                          seed: int) -> float:
    """``1 / slope`` of the trained policy's centred logits on the base's, over its own T=1 responses to ``names``."""
    samples = sample(trained, tokenizer, [prompt_for(x) for x in names], n=n, seed=seed)
    texts = [s.prompt + " " + s.response for s in samples]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    prompt_len = len(tokenizer(samples[0].prompt)["input_ids"])  # every lab prompt has the same shape
    keep = torch.ones(base.config.vocab_size, dtype=torch.bool)
    keep[abstain_id] = False
    num = den = 0.0
    for start in range(0, len(texts), 128):
        ids, mask = enc["input_ids"][start : start + 128], enc["attention_mask"][start : start + 128]
        zb, zt = (_centred(m(input_ids=ids, attention_mask=mask).logits[:, prompt_len - 1 : -1, keep]) for m in (base, trained))
        w = mask[:, prompt_len:].unsqueeze(-1).float()  # response positions only
        num += float((zb * zt * w).sum())
        den += float((zb * zb * w).sum())
    return den / num if num > 0 else float("nan")


def _centred(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() - logits.float().mean(dim=-1, keepdim=True)
