"""Factuality RL for the lab policy: GRPO with the package's RL math on a HF causal LM.

One step: ``prompts_per_step`` RL prompts (each entity about once per epoch, so no entity is
memorised) × ``samples_per_prompt`` samples at T=1 → the lab reward → advantages → one PPO-clip
step with a k3 KL to the frozen reference. Every ``val_every`` steps the validation entities are
scored and the best policy is kept (early stopping with ``patience``).

Advantages (``advantage``):

* ``response``: GRPO group advantage of the response score, flipped per token by the reward's
  ``token_signs`` (FSPO), as the GRPO stage does.
* ``slot``: each sentence (slot ``k`` of the fixed bio layout) gets its own slot reward minus the
  group's mean reward for slot ``k`` (RLFH/FSPO-style sentence credit, ``--compare``).

``trainable``: ``all`` parameters, or ``abstain_head``: only the output-layer row of the abstention
token, i.e. a learned, state-dependent "unknown" logit that cannot learn facts.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from nemo_factuality.algorithms.advantages import expand_to_tokens, fspo_flip, grpo_advantages, response_mask
from nemo_factuality.algorithms.losses import kl_loss, ppo_policy_loss
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLConfig:
    max_steps: int = 200
    budget_s: float = 240.0
    prompts_per_step: int = 32
    samples_per_prompt: int = 4
    lr: float = 3e-4
    kl_coef: float = 0.05
    advantage: str = "response"  # response | slot
    trainable: str = "all"  # all | abstain_head
    val_every: int = 10
    patience: int = 4
    max_new_tokens: int = 60
    seed: int = 0

    def __post_init__(self) -> None:
        if self.advantage not in ("response", "slot"):
            raise FactualityInputError(f"lab rl: advantage must be 'response' or 'slot', got {self.advantage!r}")
        if self.trainable not in ("all", "abstain_head"):
            raise FactualityInputError(f"lab rl: trainable must be 'all' or 'abstain_head', got {self.trainable!r}")


@dataclass
class Batch:
    """Rollouts in Aligner's layout: ``tokens [B, S]``, ``prompt_lengths``/``response_lengths [B]``."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]


@torch.no_grad()
def rollout(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], n: int, max_new_tokens: int) -> Batch:
    """``n`` samples per prompt at T=1 (prompt-major rows). Lab prompts all have the same length."""
    rows = [p for p in prompts for _ in range(n)]
    enc = tokenizer(rows, return_tensors="pt", padding=True, padding_side="left")
    if bool((enc["attention_mask"] == 0).any()):
        raise FactualityInputError("lab rl: prompts must tokenise to the same length (two-word names)")
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    p_len = enc["input_ids"].shape[1]
    new = out[:, p_len:]
    eos, ids_list, lengths = tokenizer.eos_token_id, [], []
    for row in new.tolist():
        end = row.index(eos) + 1 if eos in row else len(row)  # keep one EOS as an action
        ids_list.append(row[: end - 1] if row[end - 1] == eos else row[:end])
        lengths.append(p_len + end)
    tokens = out.clone()
    for i, length in enumerate(lengths):
        tokens[i, length:] = tokenizer.pad_token_id
    return Batch(tokens, torch.full((len(rows),), p_len), torch.tensor(lengths), rows,
                 [tokenizer.decode(ids, skip_special_tokens=True) for ids in ids_list], ids_list)


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` log-prob of ``tokens[:, t+1]`` at position ``t``."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def _place(values: Sequence[Any], batch: Batch, width: int, dtype=torch.float32) -> torch.Tensor:
    """Per-response-token arrays → ``[B, width]`` in the action layout (response token j at ``p_len-1+j``)."""
    out = torch.zeros((len(values), width), dtype=dtype)
    for i, v in enumerate(values):
        p = int(batch.prompt_lengths[i]) - 1
        v = torch.as_tensor(v, dtype=dtype)[: width - p]
        out[i, p : p + v.numel()] = v
    return out


def slot_advantages(batch: Batch, dense: Sequence[Any], period_id: int, n: int, width: int) -> torch.Tensor:
    """``[B, width]``: each sentence's tokens get (its slot reward − the group's mean for that slot).

    ``dense`` holds each sentence's reward on its final ``"."`` token (the lab reward's ``token_rewards``).
    """
    slot_r: list[list[float]] = []
    spans: list[list[tuple[int, int]]] = []
    for ids, d in zip(batch.completion_ids, dense):
        ends = [j for j, t in enumerate(ids) if t == period_id]
        slot_r.append([float(d[j]) for j in ends])
        spans.append([(0 if k == 0 else ends[k - 1] + 1, e + 1) for k, e in enumerate(ends)])
    adv = torch.zeros((len(dense), width))
    for g in range(0, len(dense), n):
        rows = range(g, g + n)
        for i in rows:
            for k, (a, b) in enumerate(spans[i]):
                peers = [slot_r[j][k] for j in rows if len(slot_r[j]) > k]
                base = sum(peers) / len(peers)
                p = int(batch.prompt_lengths[i]) - 1
                adv[i, p + a : p + b] = slot_r[i][k] - base
    scale = adv[adv != 0].std() if bool((adv != 0).sum() > 1) else torch.tensor(1.0)
    return adv / (scale + 1e-6)


def select_trainable(model: torch.nn.Module, trainable: str, abstain_id: int) -> list[torch.nn.Parameter]:
    """Freeze all but the chosen parameters; ``abstain_head`` keeps only the abstention token's output row."""
    if trainable == "all":
        return [p for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.requires_grad_(False)
    head = model.get_output_embeddings().weight
    head.requires_grad_(True)
    row_mask = torch.zeros_like(head)
    row_mask[abstain_id] = 1.0
    head.register_hook(lambda g: g * row_mask)  # only the "unknown" row moves
    return [head]


def rl_step(model, ref_model, opt, batch: Batch, rewards, cfg: RLConfig, period_id: int) -> dict[str, float]:
    """One on-policy GRPO update; returns the step's metrics."""
    width = batch.tokens.shape[1] - 1
    mask = response_mask(batch.prompt_lengths, batch.response_lengths, width)
    scores = torch.as_tensor(rewards.scores, dtype=torch.float32)
    if cfg.advantage == "slot":
        adv = slot_advantages(batch, rewards.token_rewards, period_id, cfg.samples_per_prompt, width) * mask
    else:
        groups = torch.arange(len(scores)) // cfg.samples_per_prompt
        adv = expand_to_tokens(grpo_advantages(scores, groups), mask)
        if rewards.token_signs is not None:
            adv = fspo_flip(adv, _place(rewards.token_signs, batch, width))
    with torch.no_grad():
        ref_lp = token_logprobs(ref_model, batch.tokens)
    lp = token_logprobs(model, batch.tokens)
    pg, metrics = ppo_policy_loss(lp, lp.detach(), adv, mask, agg="seq-mean-token-sum")
    kl = kl_loss(lp, ref_lp, mask, "k3", agg="seq-mean-token-sum")
    loss = pg + cfg.kl_coef * kl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    comp = rewards.components
    claims = comp["claims"]
    return {"reward": float(scores.mean()), "kl": float(kl), "pg_loss": float(pg), "grad_norm": float(grad_norm),
            "precision": float(comp["supported"].sum() / max(claims.sum(), 1)),
            "claims_per_response": float(claims.mean()), "abstained_per_response": float(comp["abstained"].mean()),
            "approx_kl": metrics["approx_kl"]}


def train_rl(model, tokenizer, reward: Callable, rl_prompts: Sequence[str], cfg: RLConfig,
             validate: Callable[[int], dict[str, float]], monitor: str = "val_reward") -> tuple[list[dict], list[dict]]:
    """Run RL with early stopping on ``validate(step)[monitor]`` (higher is better); restores the best weights.

    Returns ``(train_metrics, val_metrics)`` lists (one dict per step / per validation).
    """
    ref_model = copy.deepcopy(model).eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    abstain_id = tokenizer.convert_tokens_to_ids("unknown")
    period_id = tokenizer.convert_tokens_to_ids(".")
    opt = torch.optim.Adam(select_trainable(model, cfg.trainable, abstain_id), lr=cfg.lr)
    rng = random.Random(cfg.seed)
    order: list[str] = []
    train_log, val_log = [], [dict(step=0, **validate(0))]
    best, best_state, bad = val_log[0][monitor], copy.deepcopy(model.state_dict()), 0
    start = time.monotonic()
    bar = tqdm(total=cfg.max_steps, desc="rl", unit="step")
    for step in range(1, cfg.max_steps + 1):
        if time.monotonic() - start > cfg.budget_s:
            log.info("rl: time budget of %.0f s reached at step %d", cfg.budget_s, step - 1)
            break
        if len(order) < cfg.prompts_per_step:  # epochs over the shuffled RL entities
            fresh = list(rl_prompts)
            rng.shuffle(fresh)
            order += fresh
        prompts, order = order[: cfg.prompts_per_step], order[cfg.prompts_per_step :]
        model.eval()
        batch = rollout(model, tokenizer, prompts, cfg.samples_per_prompt, cfg.max_new_tokens)
        rewards = reward(batch.prompts, batch.completions, completion_ids=batch.completion_ids)
        model.train()
        metrics = rl_step(model, ref_model, opt, batch, rewards, cfg, period_id)
        model.eval()
        train_log.append({"step": step, "elapsed_s": time.monotonic() - start, **metrics})
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", prec=f"{metrics['precision']:.2f}")
        if step % cfg.val_every == 0:
            val_log.append({"step": step, "elapsed_s": time.monotonic() - start, **validate(step)})
            if val_log[-1][monitor] > best:
                best, best_state, bad = val_log[-1][monitor], copy.deepcopy(model.state_dict()), 0
            else:
                bad += 1
                if bad >= cfg.patience:
                    log.info("rl: early stop at step %d (best %s %.4f)", step, monitor, best)
                    break
    bar.close()
    model.load_state_dict(best_state)
    return train_log, val_log
