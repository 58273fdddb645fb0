"""Policy, value and preference losses: pure torch, shapes in docstrings, metrics returned beside the loss.

* ``ppo_policy_loss``: clipped surrogate (Schulman et al. 2017, eq. 7) with optional asymmetric
  ``eps_high`` (DAPO clip-higher) and three aggregation modes.
* ``value_loss``: NeMo-Aligner's clipped critic loss ``0.5 * mean(max((clip(v) - R)^2, (v - R)^2))``.
* ``kl_loss``: GRPO's KL term in the loss (k1 / k3 ``low_var_kl``).
* ``kto_loss`` / ``fkto_loss`` / ``factalign_loss``: FactAlign (arXiv 2410.01691 §3.2): KTO on
  responses plus sentence-level fKTO with reference points z0 from mismatched prompt/completion pairs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from nemo_factuality.algorithms.advantages import kl_penalty, masked_mean
from nemo_factuality.algorithms.checks import check_same_shape, check_shape

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, agg: Aggregation, *, global_tokens: float | None = None,
              global_seqs: float | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    ``token-mean``: every unmasked token weighs the same (long answers weigh more);
    ``seq-mean-token-mean``: mean per sequence, then mean over sequences (GRPO paper);
    ``seq-mean-token-sum``: sum per sequence, then mean over sequences (Dr.GRPO-style, no length bias).

    With gradient accumulation, pass the *optimiser step's* totals: ``global_tokens`` (unmasked tokens
    in all micro batches) and ``global_seqs`` (sequences with at least one unmasked token). Each micro
    batch then returns its share — ``sum(micro terms) / global count`` — and the micro-batch losses
    add up to exactly the loss of the whole step (verl's ``agg_loss`` with a global normaliser). Without
    them, the micro batch is normalised by its own counts, which weighs a short micro batch like a long one.
    """
    check_same_shape(("loss", loss_mat), ("mask", mask))
    if agg not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"aggregation must be token-mean, seq-mean-token-mean or seq-mean-token-sum, got {agg!r}")
    if agg == "token-mean":
        if global_tokens is None:
            return masked_mean(loss_mat, mask)
        return (loss_mat * mask).sum() / max(float(global_tokens), 1.0)
    per_seq_sum = (loss_mat * mask).sum(-1)
    tokens = mask.sum(-1)
    valid = tokens > 0
    if not valid.any():
        return loss_mat.sum() * 0.0
    per_seq = per_seq_sum[valid] / tokens[valid] if agg == "seq-mean-token-mean" else per_seq_sum[valid]
    if global_seqs is None:
        return per_seq.mean()
    return per_seq.sum() / max(float(global_seqs), 1.0)


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    *, eps: float = 0.2, eps_high: float | None = None, clip_ratio_c: float | None = None,
                    agg: Aggregation = "token-mean", global_tokens: float | None = None,
                    global_seqs: float | None = None, entropy: torch.Tensor | None = None,
                    entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate ``-min(ρA, clip(ρ, 1-ε, 1+ε_high)A)``, ``ρ = exp(logp - logp_old)``.

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5; verl's
    ``clip_ratio_c``): for negative advantages the loss is also capped at ``-c·A``, so a token whose
    ratio has exploded cannot produce an unbounded update. ``c`` must be > 1 (verl's default 3.0).

    Args:
        logprobs: ``[B, T]`` current policy log-probs of the taken tokens (requires grad).
        old_logprobs: ``[B, T]`` log-probs at rollout time.
        advantages: ``[B, T]`` (sequence advantages broadcast over tokens for GRPO/RLOO).
        mask: ``[B, T]`` float {0, 1}; Aligner also multiplies by ``is_end`` so truncated rollouts give no gradient.
        eps, eps_high: clip range; ``eps_high=None`` means symmetric (DAPO clip-higher otherwise).
        clip_ratio_c: dual-clip constant, ``None`` = off.
        global_tokens, global_seqs: the optimiser step's totals (see ``aggregate``).
        entropy: optional ``[B, T]`` token entropies for an entropy bonus.

    Returns:
        ``(loss, metrics)`` with ``clipfrac``, ``dual_clipfrac``, ``approx_kl`` (k3 between old and new).
    """
    check_same_shape(("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask))
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    eps_high = eps if eps_high is None else eps_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - eps, 1 + eps_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, cap), loss_mat)
    norm = {"global_tokens": global_tokens, "global_seqs": global_seqs}
    loss = aggregate(loss_mat, mask, agg, **norm)
    if entropy is not None and entropy_coef:
        check_same_shape(("entropy", entropy), ("mask", mask))
        loss = loss - entropy_coef * aggregate(entropy, mask, agg, **norm)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(mask.dtype), mask).item()
        approx_kl = masked_mean(kl_penalty(old_logprobs, logprobs.detach(), "k3"), mask).item()
        metrics = {"clipfrac": clipfrac, "dual_clipfrac": masked_mean(dual.to(mask.dtype), mask).item(),
                   "approx_kl": approx_kl, "ratio_mean": masked_mean(ratio.detach(), mask).item()}
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2, *, global_tokens: float | None = None) -> torch.Tensor:
    """Clipped critic loss ``0.5 * masked_mean(max((clip(v, v_old ± c) - R)^2, (v - R)^2))``.

    Args:
        values, old_values, returns, mask: ``[B, T]``.
        global_tokens: the optimiser step's unmasked token count (gradient accumulation; see ``aggregate``).
    """
    check_same_shape(("values", values), ("old_values", old_values), ("returns", returns), ("mask", mask))
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = torch.maximum((v_clipped - returns) ** 2, (values - returns) ** 2)
    return 0.5 * aggregate(per_token, mask, "token-mean", global_tokens=global_tokens)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
            kind: Literal["k1", "k3", "abs"] = "k3", agg: Aggregation = "token-mean", *, global_tokens: float | None = None,
            global_seqs: float | None = None) -> torch.Tensor:
    """GRPO's KL-in-loss term with the same estimator the stage logs (``k3`` = verl's ``low_var_kl``, clamped to
    [-10, 10] for stability; ``abs`` = ``|logπ − logπ_ref|``, verl's ``abs``, gradient ``sign(k1)·∇logπ``)."""
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    if kind == "k3":
        kl = torch.clamp(kl, -10, 10)
    return aggregate(kl, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs)


def sequence_logratios(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``r = Σ_t (logπ - logπ_ref) * mask`` per sequence (``[B, T]`` → ``[B]``)."""
    check_same_shape(("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("mask", mask))
    return ((logprobs - ref_logprobs) * mask).sum(-1)


def sentence_logratios(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                       spans: list[list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum token log-ratios over each sentence's half-open token range ``[start, end)``.

    Args:
        logprobs, ref_logprobs: ``[B, T]``.
        spans: per sample, a list of ``(start, end)`` token ranges (one per sentence).

    Returns:
        ``(r_s, sample_index)``: ``[N]`` sentence log-ratios and the ``[N]`` sample each belongs to.
    """
    check_same_shape(("logprobs", logprobs), ("ref_logprobs", ref_logprobs))
    if len(spans) != logprobs.shape[0]:
        raise ValueError(f"spans has {len(spans)} samples but logprobs has batch {logprobs.shape[0]}")
    diff = logprobs - ref_logprobs
    values, owners = [], []
    for i, sample in enumerate(spans):
        for start, end in sample:
            if not (0 <= start < end <= diff.shape[1]):
                raise ValueError(f"sample {i}: sentence token range [{start}, {end}) outside [0, {diff.shape[1]})")
            values.append(diff[i, start:end].sum())
            owners.append(i)
    if not values:
        return diff.new_zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.stack(values), torch.tensor(owners, dtype=torch.long)


def reference_point(kl_pair_logratios: torch.Tensor) -> torch.Tensor:
    """KTO's ``z0 = clamp_min(mean(r on mismatched pairs), 0)``, detached (``[M]`` → scalar).

    Example:
        >>> reference_point(torch.tensor([0.3, 0.1]))
        tensor(0.2000)
        >>> reference_point(torch.tensor([0.2, -0.6]))  # a negative mean is clamped
        tensor(0.)
    """
    if kl_pair_logratios.numel() == 0:
        return kl_pair_logratios.new_zeros(())
    return kl_pair_logratios.detach().mean().clamp(min=0)


def kto_losses(logratios: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, *, beta: float = 0.1,
               w_desirable: float = 1.0, w_undesirable: float = 1.0) -> torch.Tensor:
    """Per-example KTO terms ``[N]`` (``kto_loss`` is their mean); sum and divide by a global count under accumulation."""
    check_shape("desirable", desirable, (logratios.shape[0],))
    desirable = desirable.to(torch.bool)
    chosen = w_desirable * (1 - torch.sigmoid(beta * (logratios - z0)))
    rejected = w_undesirable * (1 - torch.sigmoid(beta * (z0 - logratios)))
    return torch.where(desirable, chosen, rejected)


def kto_loss(logratios: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, *, beta: float = 0.1,
             w_desirable: float = 1.0, w_undesirable: float = 1.0) -> torch.Tensor:
    """``mean(w_d(1 - σ(β(r - z0))) for desirable, w_u(1 - σ(β(z0 - r))) otherwise)``.

    Args:
        logratios: ``[N]`` summed log-ratios (responses for KTO, sentences for fKTO).
        desirable: ``[N]`` bool labels.
        z0: scalar reference point (already detached).
    """
    check_shape("desirable", desirable, (logratios.shape[0],))
    if logratios.numel() == 0:
        return logratios.new_tensor(float("nan"))
    desirable = desirable.to(torch.bool)
    chosen = w_desirable * (1 - torch.sigmoid(beta * (logratios - z0)))
    rejected = w_undesirable * (1 - torch.sigmoid(beta * (z0 - logratios)))
    return torch.where(desirable, chosen, rejected).mean()


def factalign_loss(resp_logratios: torch.Tensor, resp_labels: torch.Tensor, resp_kl_logratios: torch.Tensor,
                   sent_logratios: torch.Tensor, sent_labels: torch.Tensor, sent_kl_logratios: torch.Tensor, *,
                   beta: float = 0.1, beta_f: float = 0.5, lam: float = 2.0, w_d: float = 1.0, w_u: float = 1.0,
                   w_fd: float = 1.0, w_fu: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """FactAlign: ``L = L_KTO + λ·L_fKTO`` (paper defaults λ=2, β=0.1, β_f=0.5).

    The sentence term uses its own reference point ``z0_f`` from mismatched-pair sentences and is
    a flat mean over all sentences in the batch (the released code's reduction). When the batch has
    no labelled sentences (general KTO data only) the loss is ``L_KTO`` alone.

    Args:
        resp_logratios: ``[B]``; resp_labels: ``[B]`` bool; resp_kl_logratios: ``[M]`` (mismatched pairs).
        sent_logratios: ``[N]``; sent_labels: ``[N]`` bool; sent_kl_logratios: ``[K]``.
    """
    z0 = reference_point(resp_kl_logratios)
    l_kto = kto_loss(resp_logratios, resp_labels, z0, beta=beta, w_desirable=w_d, w_undesirable=w_u)
    z0_f = reference_point(sent_kl_logratios)
    l_f = kto_loss(sent_logratios, sent_labels, z0_f, beta=beta_f, w_desirable=w_fd, w_undesirable=w_fu)
    total = l_kto if torch.isnan(l_f) else l_kto + lam * l_f
    return total, {"kto": l_kto.item(), "fkto": float(l_f.item()), "z0": z0.item(), "z0_f": z0_f.item()}


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position (``[B, T, V]`` → ``[B, T]``)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
