"""The lab's real policy: a pretrained chat model from the model zoo (``nemo-factuality models get``) or an HF folder.

* ``resolve_policy``: a model-zoo name (converted once into ``$NEMO_FACTUALITY_MODELS`` or
  ``~/.cache/nemo_factuality/lab_models``, reused after) or an existing HF folder.
* ``sample_chat``: responses to chat prompts, with each sentence's **confidence** — the geometric mean of its
  tokens' probabilities under the distribution they were drawn from (``exp`` of the mean token log-probability,
  the length-normalised sequence likelihood of selective prediction) — and the token ids (the learned-temperature
  check re-scores them).
* ``restrict_real``: what training may change on a 30-layer model. ``top_layers`` (default): the top
  ``TOP_LAYERS`` decoder layers and the final norm (the tied embedding stays frozen: it is also the input
  table); ``lora``: rank-``LORA_RANK`` LoRA adapters (``peft``) on every projection, merged back after training.
  Measured on the 2-core machine (``docs/benchmarks.md``, Real lab): the top layers train faster per step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.lab.methods import REAL_TRAINABLE
from nemo_factuality.lab.policy import Sample
from nemo_factuality.lab.readings import sentences_of
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

TOP_LAYERS = 4
LORA_RANK = 16


def models_root() -> Path:
    return Path(os.environ.get("NEMO_FACTUALITY_MODELS") or Path.home() / ".cache" / "nemo_factuality" / "lab_models")


def resolve_policy(policy: str) -> Path:
    """The HF folder of ``policy``: a model-zoo name (converted once, reused) or a folder with a ``config.json``."""
    folder = Path(policy).expanduser()
    if (folder / "config.json").is_file():
        return folder.absolute()
    from nemo_factuality.model_zoo import KNOWN_MODELS, get_model

    if policy not in KNOWN_MODELS:
        raise FactualityInputError(f"--policy {policy!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor an HF "
                                   "folder with a config.json; name one of those")
    return get_model(policy, models_root() / policy)


def load_policy(path: Path | str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def _token_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The character length of the decoded response after each token (a token's text ends there)."""
    return [len(tokenizer.decode(ids[: t + 1], skip_special_tokens=True)) for t in range(len(ids))]


def _last_sentence_end(tokenizer: Any, ids: Sequence[int]) -> int:
    """How many of ``ids`` make whole sentences: up to the last token whose text ends a sentence (0: none)."""
    for t in range(len(ids), 0, -1):
        if tokenizer.decode(ids[:t], skip_special_tokens=True).rstrip().endswith((".", "!", "?")):
            return t
    return 0


def sentence_confidences(text: str, ends: Sequence[int], logprobs: Sequence[float]) -> list[float]:
    """``exp(mean log p)`` of the tokens of each sentence of ``sentences_of(text)`` (a token belongs to the sentence
    its text ends in). ``ends[t]``: the decoded length after token ``t``; ``logprobs[t]``: its log-probability."""
    import math

    out, start, t = [], 0, 0
    for sent in sentences_of(text):
        at = text.find(sent, start)
        stop = at + len(sent)
        picked = []
        while t < len(ends) and ends[t] <= stop:
            picked.append(logprobs[t])
            t += 1
        out.append(math.exp(sum(picked) / len(picked)) if picked else 1.0)
        start = stop
    return out


@torch.no_grad()
def sample_chat(model: Any, tokenizer: Any, messages: Sequence[list[dict[str, str]]], prompts: Sequence[str], *, n: int = 1,
                greedy: bool = False, temperature: float = 1.0, max_new_tokens: int = 96, batch_size: int = 32,
                seed: int = 0) -> list[Sample]:
    """``n`` responses per chat (prompt-major), each with its sentences' confidences and its token ids."""
    torch.manual_seed(seed)
    rows = [i for i in range(len(messages)) for _ in range(n)]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[Sample] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompt_ids = [list(tokenizer.apply_chat_template(messages[i], add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]) for i in chunk]
        width = max(map(len, prompt_ids))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(prompt_ids):  # left padding: every row's response starts at the same column
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy, **sampling,
                             max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=pad, eos_token_id=eos)
        new = gen.sequences[:, width:]
        # the distribution each token was drawn from (greedy: the model's own, at T=1)
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, k : k + 1]).squeeze(-1)
                                for k, s in enumerate(gen.scores)], dim=1)
        for r, i in enumerate(chunk):
            row = new[r].tolist()
            end = row.index(eos) if eos in row else len(row)
            ended = end < len(row)
            if not ended:  # cut at max_new_tokens: the unfinished last sentence is no claim, and is dropped
                end = _last_sentence_end(tokenizer, row)
            text = tokenizer.decode(row[:end], skip_special_tokens=True)
            confidences = sentence_confidences(text, _token_ends(tokenizer, row[:end]), logprobs[r, :end].tolist())
            out.append(Sample(prompts[i], text.strip(), confidences, ended, prompt_ids[r], row[:end]))
    return out


def restrict_real(model: Any, scope: str) -> tuple[Any, list[str]]:
    """Make only ``scope``'s parameters trainable; returns (the model to train, its trainable parameter names).
    ``lora`` wraps the model in ``peft``; ``merge_trained`` folds the adapters back before saving."""
    if scope not in REAL_TRAINABLE:
        raise FactualityInputError(f"lab: --trainable for a real policy must be one of {REAL_TRAINABLE}, got {scope!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    if scope == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                                 target_modules=targets, bias="none"))
    else:
        decoder = model.model  # the decoder stack of a causal LM and of the critic's token-classification model alike
        for layer in decoder.layers[len(decoder.layers) - TOP_LAYERS :]:
            layer.requires_grad_(True)
        decoder.norm.requires_grad_(True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    log.info("lab: %s: %d trainable tensors, %.1fM parameters", scope, len(names),
             sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6)
    return model, names


def merge_trained(model: Any) -> Any:
    """The plain model with any LoRA adapters merged in (what is saved and evaluated)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
