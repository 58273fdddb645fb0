"""Build a tiny byte-level BPE tokenizer (with a chat template) and tiny Qwen2/Llama models locally.

Nothing is downloaded: the tokenizer is trained on a built-in corpus in about a second and the
models are built from configs with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

_CORPUS = [
    "The Eiffel Tower is located in Paris, France, and was completed in 1889.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
    "<think>The question asks about the capital. Paris is the capital of France.</think><answer>Paris</answer>",
    "Albert Einstein was born in Ulm in 1879. He developed the theory of relativity.",
    "東京は日本の首都です。 北京是中国的首都。 Café naïve résumé — emoji 🙂🚀 and combining e\u0301.",
    "I don't know. I'm not sure about that person. Unknown facts should be avoided.",
    "Water boils at 100 degrees Celsius at sea level. The Moon orbits the Earth.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10 numbers and punctuation: ; : ! ? ( ) [ ] { } \" '",
]


def build_tiny_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 400, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        out_dir: if given, ``save_pretrained`` there (``tokenizer.json``, config, chat template).
        vocab_size: BPE vocabulary size including the 256 byte symbols and specials.
        corpus: training sentences (default: a built-in mix of English, CJK, accents and emoji);
            another corpus gives other merges, e.g. a second tokenizer for alignment tests.

    Returns:
        The HF fast tokenizer (with offsets mapping support and a ChatML-like template).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_CORPUS if corpus is None else corpus) * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
    )
    hf.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(str(out_dir))
    return hf


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def build_tiny_causal_lm(family: str = "qwen2", *, vocab_size: int = 512, tie_word_embeddings: bool = False,
                         num_layers: int = 2, seed: int = 0, out_dir: str | Path | None = None,
                         head_dim: int | None = None, rope_theta: float | None = None, rope_scaling: dict | None = None,
                         legacy_config_layout: bool = False, hidden_size: int = 64):
    """A 2-layer GQA ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` built from config (float32, CPU).

    ``hidden_size`` 128 gives head_dim 32 (vLLM's CPU attention refuses 16, and its Qwen2 ignores a
    ``head_dim`` other than hidden/heads). ``head_dim`` other than hidden/heads (= 16), a non-default ``rope_theta`` and ``rope_scaling`` (e.g.
    ``LLAMA3_SCALING``) exercise what converters must carry over. ``save_pretrained`` writes the installed
    transformers' layout (5.x: ``rope_parameters``); ``legacy_config_layout`` rewrites ``config.json`` the
    transformers-4 way (top-level ``rope_theta`` / ``rope_scaling``, ``torch_dtype``).
    """
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=256,
                  tie_word_embeddings=tie_word_embeddings)
    if head_dim is not None:
        common["head_dim"] = head_dim
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta or 10000.0}
    torch.manual_seed(seed)
    from nemo_factuality.convert.hf_config import installed_layout

    if installed_layout() == "rope_parameters":
        common["rope_parameters"] = rope
    else:
        common.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope_scaling)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"family must be 'qwen2' or 'llama', got {family!r}")
    model.eval()
    if out_dir is not None:
        model.save_pretrained(str(out_dir))
        if legacy_config_layout:
            path = Path(out_dir) / "config.json"
            cfg = json.loads(path.read_text())
            params = cfg.pop("rope_parameters", None) or {"rope_type": "default", **(rope_scaling or {})}
            cfg["rope_theta"] = params.pop("rope_theta", cfg.get("rope_theta", rope_theta or 10000.0))
            cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
            cfg["torch_dtype"] = cfg.pop("dtype", "float32")
            path.write_text(json.dumps(cfg, indent=2))
    return model


def build_tiny_sequence_classifier(out_dir: str | Path, *, family: str = "bert", num_labels: int = 1, seed: int = 0,
                                   head_bias: float | None = None, label2id: dict[str, int] | None = None):
    """A tiny ``*ForSequenceClassification`` (BERT cross-encoder or Llama reward model) saved with the tiny tokenizer.

    Args:
        family: ``bert`` (NLI/HHEM-style cross-encoder, biased classifier head) or ``llama`` (reward model:
            last-token ``score`` head, no bias).
        num_labels: 1 for a single-logit head (HHEM consistency score, Skywork-style reward).
        head_bias: if given (BERT only), zero the head's weight and set its bias, so the logit is exactly
            this value for every input (deterministic verdicts in tests).
        label2id: label names of a multi-class head.
    """
    import torch
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    tok = build_tiny_tokenizer(out_dir)
    torch.manual_seed(seed)
    labels = dict(label2id or {}) or None
    common = dict(num_labels=num_labels, pad_token_id=tok.pad_token_id, vocab_size=len(tok),
                  **({"label2id": labels, "id2label": {v: k for k, v in labels.items()}} if labels else {}))
    if family == "bert":
        model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                         intermediate_size=48, max_position_embeddings=512, **common))
        if head_bias is not None:
            with torch.no_grad():
                model.classifier.weight.zero_()
                model.classifier.bias.fill_(head_bias)
    elif family == "llama":
        model = LlamaForSequenceClassification(LlamaConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=2,
                                                           num_key_value_heads=1, intermediate_size=96,
                                                           max_position_embeddings=512, **common))
    else:
        raise ValueError(f"family must be 'bert' or 'llama', got {family!r}")
    model.eval()
    model.save_pretrained(str(out_dir))
    return model, tok
