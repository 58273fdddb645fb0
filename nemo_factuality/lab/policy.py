"""The lab's tiny policy: a word-level tokenizer trained on the world's bios and a small Llama in HF format.

Both are saved with ``save_pretrained`` so every later stage (the GRPO stage's ``hf`` backend, the
reward server's token decoding, evaluation) loads them like any HF checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def train_tokenizer(texts: Sequence[str], out_dir: Path | None = None):
    """A word-level tokenizer (words and punctuation are tokens) trained on ``texts``.

    Encoding adds ``<bos>``; decoding re-attaches punctuation (``"1931 ."`` → ``"1931."``), so a
    response decodes to exactly the text the world writes and re-encodes to the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.train_from_iterator(texts, trainer=trainers.WordLevelTrainer(special_tokens=SPECIALS, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>")
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


@dataclass(frozen=True)
class PolicyConfig:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384
    max_positions: int = 80


def build_policy(vocab_size: int, cfg: PolicyConfig, seed: int, tokenizer) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (untied head, float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.heads, intermediate_size=cfg.intermediate, vocab_size=vocab_size,
                         max_position_embeddings=cfg.max_positions, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


def encode_docs(tokenizer, docs: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pretraining batch tensors: ``ids [N, S]`` (prompt + response + eos, right-padded) and
    ``loss_mask [N, S]`` (1 on response tokens incl. eos, the positions whose prediction is trained)."""
    rows, masks = [], []
    for d in docs:
        p = tokenizer(d["prompt"])["input_ids"]
        r = tokenizer(d["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def pretrain(model: torch.nn.Module, ids: torch.Tensor, loss_mask: torch.Tensor, *, budget_s: float, max_steps: int,
             batch_size: int = 64, lr: float = 2e-3, seed: int = 0) -> list[dict]:
    """Next-token training on response tokens until ``budget_s`` seconds or ``max_steps`` (cosine LR).

    Returns the loss curve ``[{"step", "loss", "elapsed_s"}]`` (every 50 steps and the last).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    # The schedule is laid out over the expected number of steps, so a time-limited run still ends cool.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, max_steps) / max_steps)))
    model.train()
    curve, start = [], time.monotonic()
    bar = tqdm(total=max_steps, desc="pretrain", unit="step")
    step = 0
    while step < max_steps and time.monotonic() - start < budget_s:
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        x, m = ids[idx], loss_mask[idx]
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        if step % 50 == 0 or step == max_steps:
            curve.append({"step": step, "loss": loss.item(), "elapsed_s": time.monotonic() - start})
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if bar.disable:  # no bar (the lab's workers): a line every 50 steps instead
                log.info("pretraining: step %d/%d, loss %.3f", step, max_steps, loss.item())
    bar.close()
    if not curve or curve[-1]["step"] != step:
        curve.append({"step": step, "loss": loss.item(), "elapsed_s": time.monotonic() - start})
    model.eval()
    log.info("pretraining: %d steps in %.0f s, final loss %.3f", step, curve[-1]["elapsed_s"], curve[-1]["loss"])
    return curve


@dataclass
class Sample:
    prompt: str
    response: str
    value_probs: list[float]  # each sentence's confidence, in order: p(value token) here, see real_policy.sample_chat
    ended: bool = True  # the response ended with EOS (not cut at max_new_tokens)
    prompt_ids: list[int] | None = None  # the prompt's tokens and the response's (without EOS), for re-scoring
    response_ids: list[int] | None = None


@torch.no_grad()
def sample(model: torch.nn.Module, tokenizer, prompts: Sequence[str], *, n: int = 1, greedy: bool = False,
           temperature: float = 1.0, max_new_tokens: int = 64, batch_size: int = 256, seed: int = 0) -> list[Sample]:
    """``n`` responses per prompt (prompt-major order) with each sentence's value-token probability.

    The value token of a sentence is the token before its final ``"."``; its probability comes
    from the same distribution it was sampled from.
    """
    torch.manual_seed(seed)
    period = tokenizer.convert_tokens_to_ids(".")
    rows = [p for p in prompts for _ in range(n)]
    out: list[Sample] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
        sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        gen = model.generate(**enc, do_sample=not greedy, **sampling, max_new_tokens=max_new_tokens, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        new = gen.sequences[:, enc["input_ids"].shape[1] :]
        probs = torch.stack([torch.softmax(s.float(), dim=-1) for s in gen.scores], dim=1)  # [b, T, V]
        taken = probs.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [b, T]
        for i, prompt in enumerate(chunk):
            ids = new[i].tolist()
            end = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else len(ids)
            vals = [float(taken[i, t - 1]) for t in range(1, end) if ids[t] == period]
            prompt_ids = [t for t, m in zip(enc["input_ids"][i].tolist(), enc["attention_mask"][i].tolist(), strict=True) if m]
            out.append(Sample(prompt, tokenizer.decode(ids[:end], skip_special_tokens=True), vals, end < len(ids),
                              prompt_ids, ids[:end]))
    return out
