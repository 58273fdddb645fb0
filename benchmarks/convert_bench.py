"""Conversion throughput and peak memory: our HF → .nemo path vs a whole-model-in-memory baseline.

Builds a synthetic Llama checkpoint (~2 GB in float32 by default) as safetensors shards without ever
building the model, then, each in its own subprocess (so peak RSS is measured per method):

* ours:     ``hf_to_nemo`` (tensors read one at a time from the shards, Megatron-Core torch_dist save)
* baseline: ``AutoModelForCausalLM.from_pretrained`` of the whole model first (what NeMo's converter
            scripts do), then the same mapping and save.

    python benchmarks/convert_bench.py [--hidden 2048 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

CHILD = r"""
import json, resource, sys, time
mode, hf, out = sys.argv[1:4]
t = time.perf_counter()
if mode == "ours":
    from nemo_factuality.convert.nemo_format import hf_to_nemo
    hf_to_nemo(hf, out)
else:
    import torch
    from transformers import AutoModelForCausalLM
    from megatron.core import dist_checkpointing
    from nemo_factuality.convert.mapping import hf_to_mcore, spec_from_hf_config
    from nemo_factuality.convert.nemo_format import _sharded, ensure_process_group
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    sd = model.state_dict()
    spec = spec_from_hf_config(json.load(open(hf + "/config.json")))
    mcore = dict(hf_to_mcore(sd.__getitem__, spec))
    ensure_process_group()
    import os; os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(_sharded(mcore, spec), out)
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_checkpoint(root: Path, hidden: int, layers: int, vocab: int, shard_mb: int = 500) -> float:
    ffn, heads, kv = int(hidden * 2.75) // 64 * 64, hidden // 128, max(1, hidden // 512)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (root / "config.json").write_text(json.dumps(cfg))
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kv * d, hidden),
                       p + "self_attn.v_proj.weight": (kv * d, hidden), p + "self_attn.o_proj.weight": (hidden, heads * d),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shard, shard_bytes, weight_map, n, total = {}, 0, {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for key, shape in shapes.items():
        t = torch.randn(*shape, generator=gen) * 0.02
        shard[key] = t
        shard_bytes += t.numel() * 4
        total += t.numel() * 4
        if shard_bytes > shard_mb * 2**20:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(root / name))
            weight_map.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1
    if shard:
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(root / name))
        weight_map.update({k: name for k in shard})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer(root)
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        size_mb = make_checkpoint(hf, args.hidden, args.layers, args.vocab)
        rows = {}
        for mode in ("ours", "baseline"):
            out = Path(tmp) / f"{mode}.out"
            res = subprocess.run([sys.executable, "-c", CHILD, mode, str(hf), str(out)], capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{res.stderr[-3000:]}")
            rows[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"synthetic Llama checkpoint: {size_mb:.0f} MB float32 (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab})")
    print(f"{'method':<36}{'seconds':>9}{'MB/s':>9}{'peak RSS MB':>13}")
    for mode, label in (("ours", "ours (tensor-by-tensor read)"), ("baseline", "baseline (whole HF model in memory)")):
        r = rows[mode]
        print(f"{label:<36}{r['seconds']:>9.1f}{size_mb / r['seconds']:>9.1f}{r['peak_rss_mb']:>13.0f}")


if __name__ == "__main__":
    main()
