"""Conversion throughput and peak memory: our HF → .nemo path vs a whole-model-in-memory baseline.

Builds a synthetic Llama checkpoint (~2 GB in float32 by default) as safetensors shards without ever
building the model, then, each in its own subprocess (so peak RSS is measured per method):

* ours:     ``hf_to_nemo`` (tensors ``readinto`` one layer at a time, streamed into torch_dist chunks)
* baseline: ``AutoModelForCausalLM.from_pretrained`` of the whole model first (what NeMo's converter
            scripts do), then the same mapping and Megatron's ``dist_checkpointing.save``;
and the way back (``nemo_to_hf`` vs ``load_plain_tensors`` + ``save_file``). A child that only imports
gives the floor, so "above imports" is what the conversion itself holds.

    python benchmarks/convert_bench.py [--hidden 2048 --layers 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

CHILD = r"""
import json, sys, time
mode, src, out = sys.argv[1:4]
if __name__ == "__main__":
    import torch
    from nemo_factuality.convert import nemo_format
    t = time.perf_counter()
    if mode == "floor":  # the interpreter, torch and the converter imported, nothing converted
        pass
    elif mode == "ours":
        nemo_format.hf_to_nemo(src, out, extracted=True)
    elif mode == "ours-back":
        nemo_format.nemo_to_hf(src, out)
    elif mode == "baseline":
        from transformers import AutoModelForCausalLM
        from megatron.core import dist_checkpointing
        from nemo_factuality.convert.mapping import hf_to_mcore, spec_from_hf_config
        t = time.perf_counter()  # time the conversion, not the imports
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        sd = model.state_dict()
        spec = spec_from_hf_config(json.load(open(src + "/config.json")))
        mcore = dict(hf_to_mcore(sd.__getitem__, spec))
        nemo_format.ensure_process_group()
        import os; os.makedirs(out, exist_ok=True)
        dist_checkpointing.save(nemo_format.megatron_sharded_state_dict(mcore, spec), out)
    elif mode == "baseline-back":
        from megatron.core import dist_checkpointing
        from safetensors.torch import save_file
        nemo_format.ensure_process_group()
        t = time.perf_counter()
        plain = dist_checkpointing.load_plain_tensors(src + "/model_weights")
        save_file({k: v.contiguous() for k, v in plain.items()}, out)
    seconds = time.perf_counter() - t
    # VmHWM is this process's own high-water mark; ru_maxrss survives execve and would include the parent's peak
    hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": seconds, "peak_rss_mb": hwm_kb / 1024}))
"""


def make_checkpoint(root: Path, hidden: int, layers: int, vocab: int, shard_mb: int = 500) -> tuple[float, float]:
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
    largest = max(math.prod(shape) for shape in shapes.values()) * 4
    return total / 2**20, largest / 2**20


def _child(mode: str, src: Path, out: Path) -> dict:
    script = out.parent / "bench_child.py"
    script.write_text(CHILD)
    res = subprocess.run([sys.executable, str(script), mode, str(src), str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        size_mb, largest_mb = make_checkpoint(hf, args.hidden, args.layers, args.vocab)
        rows = {"floor": _child("floor", hf, Path(tmp) / "none")}
        for mode in ("ours", "baseline"):  # HF → NeMo
            rows[mode] = _child(mode, hf, Path(tmp) / f"{mode}.out")
        rows["ours-back"] = _child("ours-back", Path(tmp) / "ours.out", Path(tmp) / "back")  # NeMo → HF
        rows["baseline-back"] = _child("baseline-back", Path(tmp) / "ours.out", Path(tmp) / "back.safetensors")
    print(f"synthetic Llama checkpoint: {size_mb:.0f} MB float32 (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}); largest tensor {largest_mb:.0f} MB; imports alone: {rows['floor']['peak_rss_mb']:.0f} MB RSS")
    print(f"{'method':<46}{'seconds':>9}{'MB/s':>9}{'peak RSS MB':>13}{'above imports':>15}")
    labels = {"ours": "HF→NeMo ours (streamed, per-layer groups)", "baseline": "HF→NeMo baseline (whole model in memory)",
              "ours-back": "NeMo→HF ours (streamed, per-layer reads)", "baseline-back": "NeMo→HF baseline (load_plain_tensors)"}
    for mode, label in labels.items():
        r = rows[mode]
        print(f"{label:<46}{r['seconds']:>9.1f}{size_mb / r['seconds']:>9.1f}{r['peak_rss_mb']:>13.0f}"
              f"{r['peak_rss_mb'] - rows['floor']['peak_rss_mb']:>15.0f}")


if __name__ == "__main__":
    main()
