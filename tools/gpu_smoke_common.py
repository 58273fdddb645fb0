"""What the GPU smoke kit's phases share (``tools/gpu_smoke.py`` runs them, ``tools/gpu_smoke_megatron.py`` is the
megatron backend's): the model shapes and the HF model + tokenizer they start from, the run's sizes, the fixed prompts
and the toy reward, and the measurements (generation tok/s and peak memory, the GRPO stage's per-step split).
Each phase module imports this one; none imports another phase."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {  # Qwen2 configs: Qwen2.5-0.5B's shape, and a tiny one for the CPU path
    "qwen2-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                   "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6,
                   "max_position_embeddings": 4096},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024, "tie_word_embeddings": True, "rope_theta": 5e4,
             "max_position_embeddings": 512},
}
SPECIALS = ["<unk>", "<|endoftext|>", "<pad>", "<|im_end|>"]

def shape(args) -> dict:
    """The run's sizes: GPU (0.5B) or CPU (tiny)."""
    if args.cpu:
        return {"model": "tiny", "prompt_tokens": 8, "new_tokens": 16, "prompts_per_step": 4, "group": 4,
                "micro_batch": 4, "lr": 1e-4}
    return {"model": "qwen2-0.5b", "prompt_tokens": 64, "new_tokens": 256, "prompts_per_step": 4, "group": 4,
            "micro_batch": 4, "lr": 1e-6}


def prompts(n: int, tokens: int, vocab: int) -> list[str]:
    """``n`` fixed prompts of ``tokens`` words (one token each with the word-level tokenizer)."""
    import random

    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(vocab - len(SPECIALS))}" for _ in range(tokens)) for _ in range(n)]


def toy_reward_scores(completions: list[str]) -> list[float]:
    """The fraction of a completion's words whose id is a multiple of 7 (a learnable, judge-free signal)."""
    out = []
    for text in completions:
        words = [w for w in text.split() if w.startswith("w") and w[1:].isdigit()]
        out.append(sum(int(w[1:]) % 7 == 0 for w in words) / max(len(words), 1))
    return out


def build(out: Path, model: str, *, nemo_too: bool = True) -> tuple[Path, Path]:
    """HF model + word-level tokenizer in ``out/hf``, converted to an extracted ``.nemo`` in ``out/policy`` (the
    aligner backend's input; ``nemo_too=False``: the HF folder only)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from nemo_factuality.local_models import dtype_keyword

    hf, nemo = out / "hf", out / "policy"
    if (nemo / "model_config.yaml").is_file() or (not nemo_too and (hf / "config.json").is_file()):
        return hf, nemo
    cfg = MODELS[model]
    vocab = {w: i for i, w in enumerate([f"w{i}" for i in range(cfg["vocab_size"] - len(SPECIALS))] + SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<pad>")
    fast.save_pretrained(str(hf))
    torch.manual_seed(0)
    config = Qwen2Config(**cfg, **{dtype_keyword(): "bfloat16"}, pad_token_id=fast.pad_token_id,
                         eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(hf))
    if not nemo_too:
        return hf, nemo
    cmd = [sys.executable, "-m", "nemo_factuality.cli", "convert", "hf-to-nemo", "--hf", str(hf), "--out", str(nemo),
           "--extracted"]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=_pythonpath()))
    return hf, nemo


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def gib_cell(value: float | None, on_gpu: bool) -> str:
    """A peak-GPU-memory cell of the report: GiB on a GPU; on the CPU path, which has no GPU to measure, it says so
    (the value is NaN there: "nan" read as a measurement)."""
    return f"{value:.1f}" if on_gpu and value is not None else "not on a GPU"


def oom_text(tried: list[int], on_gpu: bool) -> str:
    """The batches that ran out of memory before the largest that fit, as the report says them."""
    if not on_gpu:
        return "no memory limit off a GPU: the CPU path's cap"
    return f"out of memory at {', '.join(map(str, tried))}" if tried else "none ran out of memory"


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure_generation(actor, ids: list[list[int]], batch: int, new_tokens: int, set_batch=None) -> dict:
    """Tokens/s generating ``batch`` sequences at once (sampled, T=1), and the peak memory while doing it.
    ``set_batch(n)`` makes the actor generate ``n`` rows per call (default: the aligner actor's runtime setting)."""
    from nemo_factuality.trainers.interfaces import SamplingParams

    rows = [ids[i % len(ids)] for i in range(batch)]
    if set_batch is None:
        actor.runtime.rollout_micro_batch_size = batch
    else:
        set_batch(batch)
    reset_peak()
    _, seconds, tokens = _timed_generate(actor, rows, SamplingParams(max_new_tokens=new_tokens, temperature=1.0))
    return {"batch": batch, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": peak_gib()}


def _timed_generate(actor, rows: list[list[int]], sampling) -> tuple:
    """(the rollout, wall seconds with the GPU synchronised before the clock stops, tokens generated) of one
    ``actor.generate`` call."""
    import torch

    start = time.perf_counter()
    rollout = actor.generate(rows, sampling)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return rollout, seconds, int((rollout.response_lengths - rollout.prompt_lengths).sum())


def timed_greedy(actor, rows: list[list[int]], new_tokens: int) -> dict:
    """One greedy generation of ``rows`` at once: each row's response tokens (``Rollout.response_ids``), the tokens
    generated and the wall seconds (the GPU synchronised before the clock stops)."""
    from nemo_factuality.trainers.interfaces import SamplingParams

    rollout, seconds, count = _timed_generate(actor, rows, SamplingParams(max_new_tokens=new_tokens, use_greedy=True))
    return {"tokens": [rollout.response_ids(i) for i in range(len(rollout))], "seconds": seconds, "count": count}


def fit_toy_grpo(cfg, actor, texts: list[str], run_dir: Path) -> list[dict]:
    """The real GRPO stage on ``actor`` with the toy reward over ``texts`` (one user turn each), peak memory counted
    from its start; the stage's per-step metrics."""
    from nemo_factuality.trainers.data import PromptRecord
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.types import RewardBatch

    def reward(prompts_, completions, **_):
        return RewardBatch(toy_reward_scores(completions))

    records = [PromptRecord(t, [{"role": "user", "content": t}]) for t in texts]
    trainer = GRPOTrainer(cfg, actor, reward, records, run_dir=run_dir)
    reset_peak()
    return trainer.fit()


def step_split(history: list[dict]) -> dict[str, float]:
    """The stage's per-step times (``time/*`` metrics), averaged over the steps after the first (step 1 pays one-time
    costs: optimizer state allocation, kernel selection)."""
    steady = history[1:] or history
    return {k.removeprefix("time/"): sum(h[k] for h in steady) / len(steady)
            for k in ("time/generate", "time/reward", "time/logprobs", "time/train", "time/step") if k in steady[0]}
