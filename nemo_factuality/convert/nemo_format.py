"""Read HF checkpoints tensor by tensor, write/read ``.nemo`` archives with Megatron-Core ``torch_dist`` weights.

``.nemo`` layout written here (what NeMo / NeMo-Aligner 0.7.0 restore):

    model_config.yaml        mcore GPT config (activation, norm, rotary base, qkv_bias, tied embeddings, ...)
    model_weights/           Megatron-Core dist checkpoint (torch_dist): keys ``model.<mcore name>`` with the
                             Transformer Engine layer-norm names; per-layer tensors stacked on a leading layer axis
    tokenizer/               the HF tokenizer files (config points at them: ``nemo:tokenizer``, never a Hub id)
    hf_config.json           the source config.json (makes NeMo → HF exact)
    manifest.json            sha256 of every converted tensor (checked by the reverse converter and ``verify``)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import yaml
from tqdm import tqdm

from nemo_factuality.convert.mapping import ModelSpec, from_te_name, spec_from_hf_config, to_te_name
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class HFCheckpoint:
    """Lazy tensor access over the safetensors shards of an HF model directory."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise FactualityInputError(f"{self.path} has no config.json: pass an HF model directory (save_pretrained output)")
        self.config = json.loads(cfg.read_text())
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FactualityInputError(f"{self.path}: no model.safetensors or model.safetensors.index.json (only safetensors is supported)")
            weight_map = None
        self._handles: dict[str, object] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            try:
                self._handles[name] = safe_open(str(self.path / name), "pt")
            except Exception as err:  # safetensors raises its own error types for bad headers
                raise FactualityInputError(f"{self.path / name} is corrupted or truncated ({err}); re-download or re-save the shard") from None
        self.weight_map = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise FactualityInputError(f"{self.path}: tensor {key!r} not found; is this the right family? (keys like "
                                       f"{sorted(self.weight_map)[:3]})")
        name = self.weight_map[key]
        try:
            return self._handles[name].get_tensor(key)
        except Exception as err:
            raise FactualityInputError(f"{self.path / name}: cannot read tensor {key!r} ({err}); the shard is corrupted or truncated") from None


def ensure_process_group() -> None:
    """Megatron's dist_checkpointing needs a process group; create a 1-process gloo group if none exists."""
    import torch.distributed as dist

    from nemo_factuality.convert import cpu

    cpu.apply()
    if dist.is_initialized():
        return
    store = tempfile.mkdtemp(prefix="nf_pg_")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)


def nemo_model_config(spec: ModelSpec, dtype: str) -> dict:
    """The ``model_config.yaml`` NeMo's MegatronGPTModel / Aligner reward models read."""
    cfg = {
        "mcore_gpt": True, "num_layers": spec.num_layers, "hidden_size": spec.hidden, "ffn_hidden_size": spec.ffn,
        "num_attention_heads": spec.heads, "num_query_groups": spec.kv_heads, "kv_channels": spec.head_dim,
        "encoder_seq_length": spec.max_positions, "max_position_embeddings": spec.max_positions,
        "position_embedding_type": "rope", "rotary_base": spec.rope_theta, "rotary_percentage": 1.0,
        "activation": "fast-swiglu", "normalization": "rmsnorm", "layernorm_epsilon": spec.rms_eps,
        "bias": False, "qkv_bias": spec.qkv_bias, "share_embeddings_and_output_weights": spec.tied,
        "make_vocab_size_divisible_by": spec.divisor,
        "override_vocab_size": spec.vocab, "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02,
        "precision": {"float32": 32, "bfloat16": "bf16", "float16": 16}[dtype], "megatron_amp_O2": False,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "dist_ckpt_format": "torch_dist",
        "tokenizer": {"library": "huggingface", "type": "nemo:tokenizer", "model": "nemo:tokenizer/tokenizer.json",
                      "use_fast": True},
        "target": "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel",
    }
    if spec.rope_scaling and spec.rope_scaling.get("rope_type", spec.rope_scaling.get("type")) in ("llama3", "linear"):
        cfg["seq_len_interpolation_factor"] = spec.rope_scaling.get("factor")
        cfg["scale_positional_embedding"] = spec.rope_scaling.get("rope_type") == "llama3"
    if spec.reward_head:
        cfg.update({"reward_model_type": "binary_ranking", "output_sequence": False, "use_avg_pool": False,
                    "target": "nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model.MegatronGPTRewardModel"})
    return cfg


def _layer_key(key: str) -> tuple[str, int] | None:
    """``decoder.layers.3.x`` → (``decoder.layers.x``, 3); None for non-layer keys."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers" and parts[2].isdigit():
        return ".".join(parts[:2] + parts[3:]), int(parts[2])
    return None


def _sharded(mcore: dict[str, torch.Tensor], spec: ModelSpec) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    out = {}
    for key, t in mcore.items():
        stacked = _layer_key(key)
        if stacked is None:
            name = "model." + key
            out[name] = ShardedTensor.from_rank_offsets(name, t, replica_id=0)
        else:
            base, layer = stacked
            name = "model." + to_te_name(base)
            out[f"{name}.{layer}"] = ShardedTensor.from_rank_offsets(name, t, (0, layer, spec.num_layers), replica_id=0,
                                                                     prepend_axis_num=1)
    return out


def hf_to_nemo(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32", extracted: bool = False,
               make_vocab_size_divisible_by: int | None = None) -> Path:
    """Convert an HF Llama/Qwen2 (or sequence-classification RM) directory to ``.nemo`` (or an extracted dir)."""
    from megatron.core import dist_checkpointing

    from nemo_factuality.convert.mapping import hf_to_mcore

    if dtype not in _DTYPES:
        raise FactualityInputError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    hf = HFCheckpoint(hf_dir)
    spec = spec_from_hf_config(hf.config, make_vocab_size_divisible_by)
    tok_files = [f for f in TOKENIZER_FILES if (Path(hf_dir) / f).is_file()]
    if not any(f in tok_files for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FactualityInputError(f"{hf_dir} has no tokenizer files (tokenizer.json / tokenizer.model / vocab.json): "
                                   "save the tokenizer next to the weights; a .nemo must carry its tokenizer")
    out = Path(out)
    work = Path(tempfile.mkdtemp(prefix=".nemo_build_", dir=out.parent if out.parent.exists() else None))
    try:
        mcore, manifest = {}, {}
        n_expected = len(hf.keys())
        for key, t in tqdm(hf_to_mcore(hf.get, spec), desc="hf→mcore", unit="tensor", total=None, leave=False):
            t = t.to(_DTYPES[dtype]).contiguous()
            mcore[key] = t
            manifest[key] = {"shape": list(t.shape), "dtype": dtype, "sha256": tensor_sha256(t)}
        log.info("converted %d HF tensors into %d Megatron-Core tensors", n_expected, len(mcore))
        ensure_process_group()
        (work / "model_weights").mkdir()
        dist_checkpointing.save(_sharded(mcore, spec), str(work / "model_weights"))
        (work / "model_config.yaml").write_text(yaml.safe_dump(nemo_model_config(spec, dtype), sort_keys=False))
        (work / "hf_config.json").write_text(json.dumps(hf.config, indent=2))
        (work / "manifest.json").write_text(json.dumps({"family": spec.family, "tensors": manifest}, indent=1))
        (work / "tokenizer").mkdir()
        for f in tok_files:
            shutil.copy2(Path(hf_dir) / f, work / "tokenizer" / f)
        if extracted:
            if out.exists():
                shutil.rmtree(out)
            os.replace(work, out)
        else:
            tmp_tar = out.with_name(f".{out.name}.partial")
            with tarfile.open(tmp_tar, "w") as tar:
                for item in sorted(work.iterdir()):
                    tar.add(item, arcname=f"./{item.name}")
            os.replace(tmp_tar, out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out


@contextmanager
def opened_nemo(path: str | Path) -> Iterator[Path]:
    """A directory view of a ``.nemo`` (tar extracted to a temp dir) or an extracted checkpoint."""
    path = Path(path)
    if path.is_dir():
        yield path
        return
    if not tarfile.is_tarfile(path):
        raise FactualityInputError(f"{path} is neither a .nemo tar archive nor an extracted checkpoint directory")
    with tempfile.TemporaryDirectory(prefix="nemo_extract_") as tmp:
        try:
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError, OSError) as err:
            raise FactualityInputError(f"{path} is corrupted or truncated ({err})") from None
        yield Path(tmp)


def load_nemo_tensors(root: Path, check_manifest: bool = True) -> tuple[dict[str, torch.Tensor], ModelSpec, dict]:
    """Megatron-Core (local spec) tensors, the model spec and the HF config from an opened checkpoint."""
    from megatron.core import dist_checkpointing

    for needed in ("model_weights", "hf_config.json", "model_config.yaml"):
        if not (root / needed).exists():
            raise FactualityInputError(f"checkpoint is missing {needed}; was it written by nemo-factuality convert?")
    hf_config = json.loads((root / "hf_config.json").read_text())
    divisor = yaml.safe_load((root / "model_config.yaml").read_text()).get("make_vocab_size_divisible_by")
    spec = spec_from_hf_config(hf_config, divisor)
    ensure_process_group()
    try:
        plain = dist_checkpointing.load_plain_tensors(str(root / "model_weights"))
    except Exception as err:
        raise FactualityInputError(f"cannot read the dist checkpoint in {root / 'model_weights'}: {err}") from None
    tensors: dict[str, torch.Tensor] = {}
    for name, t in plain.items():
        if not isinstance(t, torch.Tensor):
            continue
        key = from_te_name(name[len("model."):] if name.startswith("model.") else name)
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            for layer in range(t.shape[0]):
                tensors[f"decoder.layers.{layer}.{rest}"] = t[layer].contiguous()
        else:
            tensors[key] = t
    if check_manifest and (root / "manifest.json").is_file():
        verify_manifest(tensors, json.loads((root / "manifest.json").read_text())["tensors"])
    return tensors, spec, hf_config


def verify_manifest(tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    missing = sorted(set(manifest) - set(tensors))
    if missing:
        raise FactualityInputError(f"checkpoint lacks tensors listed in its manifest: {missing[:5]}")
    for key, meta in manifest.items():
        if tensor_sha256(tensors[key]) != meta["sha256"]:
            raise FactualityInputError(f"tensor {key!r} does not match its manifest checksum: the checkpoint is corrupted")


def nemo_to_hf(nemo: str | Path, out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` + ``config.json`` + tokenizer files from a ``.nemo`` written by ``hf_to_nemo``."""
    from safetensors.torch import save_file

    from nemo_factuality.convert.mapping import mcore_to_hf

    out_dir = Path(out_dir)
    with opened_nemo(nemo) as root:
        tensors, spec, hf_config = load_nemo_tensors(root)
        hf = dict(mcore_to_hf(tensors.__getitem__, spec))
        tmp = Path(tempfile.mkdtemp(prefix=".hf_build_", dir=out_dir.parent if out_dir.parent.exists() else None))
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        for f in (root / "tokenizer").iterdir():
            shutil.copy2(f, tmp / f.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    hf = HFCheckpoint(hf_dir)
    return {k: hf.get(k) for k in hf.keys()}


def mcore_state(hf_dir: str | Path, make_vocab_size_divisible_by: int | None = None) -> tuple[dict[str, torch.Tensor], ModelSpec]:
    """HF → Megatron-Core (local spec) state dict in memory (used by tests and the verifier)."""
    from nemo_factuality.convert.mapping import hf_to_mcore

    hf = HFCheckpoint(hf_dir)
    spec = spec_from_hf_config(hf.config, make_vocab_size_divisible_by)
    return dict(hf_to_mcore(hf.get, spec)), spec


Getter = Callable[[str], torch.Tensor]
