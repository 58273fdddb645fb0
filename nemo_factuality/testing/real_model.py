"""The real model's HF folder for tests, converted once per machine: ``smollm2_dir()``.

``nemo-factuality models get smollm2-135m-instruct`` takes about a minute of CPU (the GGUF's tokenizer and weights
loaded and dequantised, 538 MB written), so the folder is cached like the stack venvs: under
``${NEMO_FACTUALITY_VENV_ROOT:-~/.cache/nemo_factuality}/models/<name>-<key>`` (``key``: 12 hex digits of the hash
of the GGUF's sha256 and the conversion version, so a new conversion gets a folder of its own), shared by every
checkout. The first caller builds it under a file lock beside it; concurrent callers (xdist workers, other
checkouts' runs) wait on the lock and then reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

from nemo_factuality.model_zoo import CONVERSION_VERSION, existing_folder, get_model, model_spec
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
#: How far two float32 computations of SmolLM2's logits (or log-probs) may lie apart when they are the same model in
#: another summation order (Megatron-Core's fused QKV and SwiGLU, NeMo, another transformers): 30 layers, logits up
#: to ~33. Measured on ``convert verify``'s random tokens: transformers' own float32 forward is 5.8e-5 from its
#: float64 forward, Megatron-Core's 5.0e-5 (TP=1) and 4.8e-5 (TP=3) from transformers'. A conversion or loading bug
#: is far above it: the same folder with RoPE at 10000 instead of 100000 is 5.9 away.
FP32_LOGIT_TOLERANCE = 2e-4


def cache_root() -> Path:
    """Where the stack venvs and the converted models live (``tools/setup_stack_env.sh``'s root)."""
    return Path(os.environ.get("NEMO_FACTUALITY_VENV_ROOT") or Path.home() / ".cache" / "nemo_factuality")


def cached_model_dir(name: str) -> Path:
    """The cache folder of the known model ``name`` (whether or not it is built yet)."""
    spec = model_spec(name)
    key = hashlib.sha256(f"{spec.gguf_sha256}:{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{name}-{key}"


def cached_model(name: str) -> Path:
    """``name``'s converted folder in the cache, built once under a file lock (waiters reuse it)."""
    spec = model_spec(name)
    out = cached_model_dir(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process builds it
        for partial in out.parent.glob(f".{out.name}.*.partial"):  # a build that was killed (we hold the lock)
            shutil.rmtree(partial, ignore_errors=True)
        try:
            if existing_folder(spec, out):
                return out
        except FactualityInputError as err:  # the cache's own folder, damaged (a file removed): rebuild it
            log.warning("rebuilding %s: %s", out, err)
            shutil.rmtree(out)
        log.warning("converting %s into the test cache %s once (about a minute)", name, out)
        return get_model(name, out)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's HF folder (float32 safetensors, tokenizer, chat template), cached per machine."""
    return cached_model(SMOLLM2)


#: Questions about countries the model knows and ones it does not (greedy: right for France and Japan, wrong for
#: Bhutan and Moldova), as chat prompts for the real model's training-step tests.
QUESTIONS = ("What is the capital of France?", "What is the capital of Bhutan?", "What is the capital of Japan?",
             "What is the capital of Moldova?")


def capital_prompts(n: int) -> list:
    """``n`` chat prompts (``PromptRecord``) cycling through ``QUESTIONS``."""
    from nemo_factuality.trainers.data import PromptRecord

    return [PromptRecord(q, [{"role": "user", "content": q}]) for q in (QUESTIONS * n)[:n]]


def even_token_fraction(prompts, completions, completion_ids, **_):
    """A toy scalar reward for the real model's step tests: the fraction of a response's token ids that are even.
    Any sample of a few tokens varies in it, so a group's advantages are never all zero and a step always moves the
    weights (what the capital is named is left to the lab's reward)."""
    import numpy as np

    from nemo_factuality.types import RewardBatch

    return RewardBatch(np.array([sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]))
