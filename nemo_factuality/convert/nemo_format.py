"""HF ↔ ``.nemo`` (Megatron-Core ``torch_dist`` weights), streamed tensor by tensor, resumable.

``.nemo`` layout written here (what NeMo / NeMo-Aligner 0.7.0 restore):

    model_config.yaml        mcore GPT config (activation, norm, rotary base, qkv_bias, tied embeddings, TP/PP, ...)
    model_weights/           Megatron-Core dist checkpoint (torch_dist): keys ``model.<mcore name>`` with the
                             Transformer Engine layer-norm names; per-layer tensors stacked on a leading layer axis,
                             chunked as a TP=``tp`` run would store them (see ``layout``)
    tokenizer/               the HF tokenizer files (``tokenizer.type`` points here, never at a Hub id)
    tokenizer.json           (or tokenizer.model / vocab.json) NeMo's registered ``tokenizer.model`` artifact
    hf_config.json           the source config.json (makes NeMo → HF exact)
    manifest.json            sha256 of every converted tensor (checked by the reverse converter and ``verify``)

Memory: one HF layer's tensors at a time (read with ``readinto``, see ``safetensors_io``). Work goes
to ``.<out>.partial/`` next to the output; rerunning the same command after an interruption resumes
at the first unwritten group, and the output appears only when complete (rename at the end).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from nemo_factuality.convert.hf_config import to_installed_layout
from nemo_factuality.convert.layout import check_parallelism, checkpoint_name, chunks_for, extra_state_objects
from nemo_factuality.convert.mapping import ModelSpec, hf_to_mcore_groups, mcore_to_hf, spec_from_hf_config
from nemo_factuality.convert.safetensors_io import DEFAULT_SHARD_BYTES, write_sharded
from nemo_factuality.convert.torch_dist import TorchDistReader, TorchDistWriter
from nemo_factuality.local_models import TOKENIZER_MAIN_FILES, open_safetensors, read_json_object, safetensors_shards
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
ACTIVATIONS_CHECKPOINT_KEYS = ("granularity", "method", "num_layers", "layers_per_pipeline")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JOB_FILE = "job.json"


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


class HFCheckpoint:
    """Lazy tensor access over the safetensors shards of an HF model directory (validated on open)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not self.path.is_dir():
            raise FactualityInputError(f"{self.path} does not exist or is not a directory: pass an HF model directory")
        if not cfg.is_file():
            raise FactualityInputError(f"{self.path} has no config.json: pass an HF model directory (save_pretrained output)")
        self.config = read_json_object(cfg)
        self.files, _ = safetensors_shards(self.path)
        self.reader = open_safetensors(self.path)  # every shard's header checked: a truncated one is named
        if self.reader is None:
            raise FactualityInputError(f"{self.path}: no model.safetensors or model.safetensors.index.json "
                                       "(only safetensors is supported; re-save with save_pretrained(safe_serialization=True))")

    def keys(self) -> list[str]:
        return self.reader.keys()

    def get(self, key: str) -> torch.Tensor:
        if key not in self.reader.entries:
            raise FactualityInputError(f"{self.path}: tensor {key!r} not found; is this the right family? (keys like "
                                       f"{sorted(self.reader.keys())[:3]})")
        return self.reader.get(key)

    def fingerprint(self) -> dict:
        """What identifies this source for resuming: file names, sizes and modification times."""
        files = ["config.json", *self.files]
        return {f: [(self.path / f).stat().st_size, int((self.path / f).stat().st_mtime)] for f in files}


def _refuse_overwriting_source(source: Path, out: Path) -> None:
    """The output replaces whatever is at ``out``: never let that be the source or a folder holding it."""
    if out == source or out in source.parents:
        raise FactualityInputError(f"--out {out} would replace the input {source}: write the result somewhere else")


def nemo_model_config(spec: ModelSpec, dtype: str, tp: int = 1, pp: int = 1, tokenizer_file: str = "tokenizer.json",
                      tokenizer_type: str = "tokenizer") -> dict:
    """The ``model_config.yaml`` NeMo's MegatronGPTModel / Aligner reward models read.

    ``tokenizer_type``: the extracted form points at its own packed ``tokenizer/`` by absolute path (what
    NeMo 2.x resolves); a tar can only say ``tokenizer`` (relative; NeMo 1.x restored with the archive as
    working directory), so with a tar pass ``++model.tokenizer.type=<dir with the tokenizer files>``.
    """
    cfg = {
        "mcore_gpt": True, "num_layers": spec.num_layers, "hidden_size": spec.hidden, "ffn_hidden_size": spec.ffn,
        "num_attention_heads": spec.heads, "num_query_groups": spec.kv_heads, "kv_channels": spec.head_dim,
        "encoder_seq_length": spec.max_positions, "max_position_embeddings": spec.max_positions,
        "position_embedding_type": "rope", "rotary_base": spec.rope.theta, "rotary_percentage": 1.0,
        "activation": "fast-swiglu", "normalization": "rmsnorm", "layernorm_epsilon": spec.rms_eps,
        "bias": False, "qkv_bias": spec.qkv_bias, "share_embeddings_and_output_weights": spec.tied,
        "make_vocab_size_divisible_by": spec.divisor,
        "override_vocab_size": spec.vocab, "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02,
        "precision": {"float32": 32, "bfloat16": "bf16", "float16": 16}[dtype], "megatron_amp_O2": False,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "dist_ckpt_format": "torch_dist",
        # NeMo hands ``type`` unresolved to HF AutoTokenizer.from_pretrained (NeMo 2.x no longer chdirs into the
        # checkpoint while building the model): see ``tokenizer_type``. ``model`` is a registered artifact
        # (``nemo:`` = inside the archive), which NeMo's save_to carries over.
        # The artifact sits at the archive root: NeMo's save_to re-packs ``nemo:`` artifacts by base name from
        # a flat folder, so a ``nemo:tokenizer/...`` path makes every later save_to (a trained policy) fail.
        "tokenizer": {"library": "huggingface", "type": tokenizer_type, "model": f"nemo:{tokenizer_file}",
                      "use_fast": True},
        "target": "nemo.collections.nlp.models.language_modeling.megatron_gpt_model.MegatronGPTModel",
    }
    # NeMo's generation path reads these unconditionally (megatron_gpt_model.py, at the first rollout of
    # Aligner's PPO/REINFORCE actors); neither Aligner's configs nor ours set them otherwise. null = off.
    cfg.update({f"activations_checkpoint_{k}": None for k in ACTIVATIONS_CHECKPOINT_KEYS})
    # NeMo applies Llama-3 scaling to the frequencies when scale_positional_embedding is set and divides the
    # positions by seq_len_interpolation_factor when that is set: one or the other, never both (that would scale twice)
    if spec.rope.kind == "llama3":
        cfg.update({"scale_positional_embedding": True, "rope_scaling_factor": spec.rope.factor})
    elif spec.rope.kind == "linear":
        cfg["seq_len_interpolation_factor"] = spec.rope.factor
    if spec.reward_head:
        # Aligner builds reward models untied (it overrides share_embeddings_and_output_weights to False)
        cfg.update({"reward_model_type": "binary_ranking", "output_sequence": False, "use_avg_pool": False,
                    "share_embeddings_and_output_weights": False,
                    "target": "nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model.MegatronGPTRewardModel"})
    return cfg


def megatron_sharded_state_dict(mcore: dict[str, torch.Tensor], spec: ModelSpec) -> dict:
    """The same tensors as Megatron ShardedTensors (for ``dist_checkpointing.save``: the whole-model reference path)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out = {}
    for key, t in mcore.items():
        fqn, layer = checkpoint_name(key)
        if layer is None:
            out[fqn] = ShardedTensor.from_rank_offsets(fqn, t, replica_id=0)
        else:
            out[f"{fqn}.{layer}"] = ShardedTensor.from_rank_offsets(fqn, t, (0, layer, spec.num_layers), replica_id=0,
                                                                    prepend_axis_num=1)
    return out


def _tokenizer_files(hf_dir: Path) -> list[str]:
    found = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
    if not any(f in found for f in TOKENIZER_MAIN_FILES):
        raise FactualityInputError(f"{hf_dir} has no tokenizer files (tokenizer.json / tokenizer.model / vocab.json): "
                                   "save the tokenizer next to the weights; a .nemo must carry its tokenizer")
    return found


def _write_loadable_tokenizer_config(tok_dir: Path) -> None:
    """Make the packed ``tokenizer_config.json`` loadable by the transformers 4.x of the NeMo 2.x stack.

    transformers 5 saves ``tokenizer_class: TokenizersBackend`` (a class 4.x lacks: AutoTokenizer fails) and
    may keep the chat template only in ``chat_template.jinja`` (read from 4.50 on). A ``tokenizer.json``
    makes the tokenizer a ``PreTrainedTokenizerFast`` in every version, and the template is inlined.
    """
    path = tok_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        if not (tok_dir / "tokenizer.json").is_file():
            raise FactualityInputError(f"{path} names TokenizersBackend (transformers 5) but there is no tokenizer.json "
                                       "beside it: re-save the tokenizer with a tokenizer.json")
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.pop("backend", None)
    template = tok_dir / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _open_work_dir(work: Path, job: dict, restart: bool) -> None:
    """Create the work dir, or keep it when it holds a partial run of the same job (then we resume)."""
    job_file = work / JOB_FILE
    if work.exists() and not restart:
        previous = json.loads(job_file.read_text()) if job_file.is_file() else None
        if previous == job:
            return
        shown = ("source", "dtype", "tp", "pp", "extracted")
        raise FactualityInputError(f"{work} holds an unfinished conversion with other inputs or settings (it has "
                                   f"{previous and {k: previous.get(k) for k in shown}}, this run has "
                                   f"{ {k: job[k] for k in shown} }, or the source files changed since); "
                                   "pass --restart to discard it, or rerun with its settings to resume it")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    job_file.write_text(json.dumps(job))


def _write_weights(hf: HFCheckpoint, spec: ModelSpec, work: Path, dtype: str, tp: int) -> dict:
    """Stream every group into ``work/model_weights`` (skipping what a previous run finished); returns the manifest.

    ``manifest.json`` is written before the weights' ``.metadata``, so a run that finds both knows the
    weights are complete (it was interrupted while packaging) and goes straight to packaging.
    """
    weights, manifest_path = work / "model_weights", work / "manifest.json"
    if (weights / ".metadata").is_file() and manifest_path.is_file():
        log.info("resuming: the weights in %s are complete; packaging", weights)
        return json.loads(manifest_path.read_text())["tensors"]
    writer = TorchDistWriter(weights)
    done = writer.groups_done()
    groups = hf_to_mcore_groups(hf.get, spec)
    if done:
        log.info("resuming: %d of %d groups already written in %s", len(done), len(groups), weights)
    manifest: dict[str, dict] = {}
    for group, produce in tqdm(groups, desc="hf→nemo", unit="group"):
        if group in done:
            manifest.update(done[group])
            continue
        entries: dict[str, dict] = {}  # filled while the group streams; stored with the group's journal record

        def chunks(produce=produce, entries=entries, group=group):
            for key, t in produce():
                t = t.to(_DTYPES[dtype]).contiguous()
                entries[key] = {"shape": list(t.shape), "dtype": dtype, "sha256": tensor_sha256(t)}
                yield from chunks_for(key, t, spec, tp)
            if group.startswith("layer."):
                yield from extra_state_objects(spec, int(group.split(".")[1]))

        writer.write_group(group, chunks(), extra=entries)
        manifest.update(entries)
        _maybe_simulate_crash(f"group:{len(writer.groups_done())}")
    manifest_path.write_text(json.dumps({"family": spec.family, "tensors": manifest}, indent=1))
    writer.finish()
    return manifest


def _maybe_simulate_crash(point: str) -> None:
    """Fault injection for the resume tests: ``NF_CONVERT_CRASH_AT=group:<k>|package`` dies there like SIGKILL."""
    if os.environ.get("NF_CONVERT_CRASH_AT") == point:
        os._exit(137)


def hf_to_nemo(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32", extracted: bool = False,
               make_vocab_size_divisible_by: int | None = None, tp: int = 1, pp: int = 1, restart: bool = False) -> Path:
    """Convert an HF Llama/Qwen2 (or sequence-classification RM) directory to ``.nemo`` (or an extracted dir).

    ``tp``/``pp`` pre-shard for that layout: vocabulary padded to ``divisor × tp``, chunks as a TP run stores
    them, and ``model_config.yaml`` set to it. Any TP/PP can still load the result.
    """
    if dtype not in _DTYPES:
        raise FactualityInputError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    hf_dir, out = Path(hf_dir).resolve(), Path(out).resolve()
    _refuse_overwriting_source(hf_dir, out)
    hf = HFCheckpoint(hf_dir)
    spec = spec_from_hf_config(hf.config, make_vocab_size_divisible_by, tp=tp)
    check_parallelism(spec, tp, pp)
    tok_files = _tokenizer_files(hf_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial"
    job = {"format": 2, "source": str(hf_dir), "files": hf.fingerprint(), "dtype": dtype, "tp": tp, "pp": pp,
           "divisor": spec.divisor, "extracted": extracted}
    _open_work_dir(work, job, restart)
    manifest = _write_weights(hf, spec, work, dtype, tp)
    main_file = next(f for f in TOKENIZER_MAIN_FILES if f in tok_files)
    tokenizer_type = str(out / "tokenizer") if extracted else "tokenizer"
    (work / "model_config.yaml").write_text(yaml.safe_dump(nemo_model_config(spec, dtype, tp, pp, main_file, tokenizer_type),
                                                           sort_keys=False))
    (work / "hf_config.json").write_text(json.dumps(hf.config, indent=2))
    (work / "tokenizer").mkdir(exist_ok=True)
    for f in tok_files:
        shutil.copy2(hf_dir / f, work / "tokenizer" / f)
    if "tokenizer_config.json" in tok_files:
        _write_loadable_tokenizer_config(work / "tokenizer")
    shutil.copy2(hf_dir / main_file, work / main_file)  # the registered artifact (see nemo_model_config)
    # AutoTokenizer falls back to config.json when tokenizer_config.json names no class it knows (older transformers)
    shutil.copy2(hf_dir / "config.json", work / "tokenizer" / "config.json")
    _maybe_simulate_crash("package")
    if extracted:
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        (out / JOB_FILE).unlink()
    else:
        tmp_tar = out.with_name(f".{out.name}.tar.partial")
        with tarfile.open(tmp_tar, "w") as tar:
            for item in sorted(work.iterdir()):
                if item.name != JOB_FILE:
                    tar.add(item, arcname=f"./{item.name}")
        os.replace(tmp_tar, out)
        shutil.rmtree(work)
    log.info("wrote %s (%d tensors, TP=%d PP=%d, %s)", out, len(manifest), tp, pp, dtype)
    return out


@contextmanager
def opened_nemo(path: str | Path) -> Iterator[Path]:
    """A directory view of a ``.nemo`` (tar extracted to a temp dir) or an extracted checkpoint."""
    path = Path(path)
    if path.is_dir():
        yield path
        return
    if not path.is_file():
        raise FactualityInputError(f"{path} does not exist")
    if not tarfile.is_tarfile(path):
        raise FactualityInputError(f"{path} is neither a .nemo tar archive nor an extracted checkpoint directory")
    with tempfile.TemporaryDirectory(prefix="nemo_extract_", dir=path.parent) as tmp:
        try:
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError, OSError) as err:
            raise FactualityInputError(f"{path} is corrupted or truncated ({err})") from None
        yield Path(tmp)


def read_packed_file(path: str | Path, name: str) -> bytes | None:
    """One top-level file of a ``.nemo`` (tar, read in place: a 32B archive is not extracted for a config) or of an
    extracted checkpoint; None when it has none."""
    path = Path(path)
    if path.is_dir():
        return (path / name).read_bytes() if (path / name).is_file() else None
    if not path.is_file() or not tarfile.is_tarfile(path):
        raise FactualityInputError(f"{path} is neither a .nemo tar archive nor an extracted checkpoint directory")
    with tarfile.open(path) as tar:
        for member in (f"./{name}", name):
            try:
                handle = tar.extractfile(member)
            except KeyError:
                continue
            return handle.read() if handle is not None else None
    return None


def checkpoint_family(path: str | Path) -> str:
    """``qwen2`` or ``llama``: the HF family of a ``.nemo``, from the ``hf_config.json`` our converter packs, else
    (a checkpoint NeMo saved, which drops it) from ``model_config.yaml``: Qwen2 has QKV biases and no others, Llama
    no biases. Any other architecture is a ``FactualityInputError`` naming what it found."""
    packed = read_packed_file(path, "hf_config.json")
    if packed is not None:
        family = json.loads(packed).get("model_type")
        if family in ("qwen2", "llama"):
            return family
        raise FactualityInputError(f"{path}: hf_config.json has model_type={family!r}; only qwen2 and llama are known")
    raw = read_packed_file(path, "model_config.yaml")
    if raw is None:
        raise FactualityInputError(f"{path} has no model_config.yaml; is this a NeMo checkpoint?")
    cfg = yaml.safe_load(raw)
    if not isinstance(cfg, dict):
        raise FactualityInputError(f"{path}: model_config.yaml is not a mapping")
    qkv_bias = bool(cfg.get("qkv_bias") or cfg.get("add_qkv_bias"))
    if cfg.get("bias"):  # every linear layer biased (GPT-2 style): neither family
        raise FactualityInputError(f"{path}: model_config.yaml has bias=true (biases on every linear layer): neither "
                                   "Qwen2 nor Llama")
    return "qwen2" if qkv_bias else "llama"


def read_nemo_config(root: Path, hf_config_path: str | Path | None = None) -> tuple[dict, dict]:
    """(model_config.yaml, HF config) of an opened checkpoint; the HF config is derived when not packed."""
    for needed in ("model_weights", "model_config.yaml"):
        if not (root / needed).exists():
            raise FactualityInputError(f"checkpoint is missing {needed}; is this a NeMo mcore GPT checkpoint?")
    try:
        nemo_cfg = yaml.safe_load((root / "model_config.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise FactualityInputError(f"model_config.yaml of the checkpoint is not valid YAML ({err})") from None
    if not isinstance(nemo_cfg, dict):
        raise FactualityInputError("model_config.yaml of the checkpoint is not a mapping")
    if hf_config_path is not None:
        return nemo_cfg, read_json_object(Path(hf_config_path))
    if (root / "hf_config.json").is_file():
        return nemo_cfg, read_json_object(root / "hf_config.json")
    from nemo_factuality.convert.nemo_config import hf_config_from_nemo

    weights = TorchDistReader(root / "model_weights")
    return nemo_cfg, hf_config_from_nemo(nemo_cfg, weights)


def checkpoint_getter(weights: TorchDistReader, manifest: dict | None):
    """``get(local mcore key)`` reading one layer's chunks, checked against the manifest when there is one."""

    def get(key: str) -> torch.Tensor:
        fqn, layer = checkpoint_name(key)
        t = weights.read(fqn, layer)
        if manifest is not None:
            meta = manifest.get(key)
            if meta is None:
                raise FactualityInputError(f"tensor {key!r} is not in the checkpoint's manifest")
            if tensor_sha256(t) != meta["sha256"]:
                raise FactualityInputError(f"tensor {key!r} does not match its manifest checksum: the checkpoint is corrupted")
        return t

    return get


def check_manifest(root: Path) -> int:
    """Re-hash every tensor listed in ``manifest.json``, one layer at a time; returns how many were checked."""
    if not (root / "manifest.json").is_file():
        return 0
    manifest = json.loads((root / "manifest.json").read_text())["tensors"]
    get = checkpoint_getter(TorchDistReader(root / "model_weights"), manifest)
    for key in tqdm(manifest, desc="manifest", unit="tensor", leave=False):
        get(key)
    return len(manifest)


def nemo_to_hf(nemo: str | Path, out_dir: str | Path, *, hf_config: str | Path | None = None,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES, drop_rm_bias: bool = False) -> Path:
    """Write HF safetensors (sharded like ``save_pretrained``) + ``config.json`` + tokenizer from a ``.nemo``.

    Works on checkpoints written by ``hf_to_nemo`` and on NeMo/Aligner-trained ones (any TP/PP layout);
    without a packed ``hf_config.json`` the HF config is derived from ``model_config.yaml`` (or pass one).
    """
    out_dir = Path(out_dir).resolve()
    _refuse_overwriting_source(Path(nemo).resolve(), out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with opened_nemo(nemo) as root:
        _, config = read_nemo_config(root, hf_config)
        spec = spec_from_hf_config(config)
        weights = TorchDistReader(root / "model_weights")
        manifest_path = root / "manifest.json"
        manifest = json.loads(manifest_path.read_text())["tensors"] if manifest_path.is_file() else None
        get = checkpoint_getter(weights, manifest)
        if spec.reward_head and "model.rm_head.bias" in weights.tensors:
            bias = weights.read("model.rm_head.bias")
            if bool(bias.ne(0).any()) and not drop_rm_bias:
                raise FactualityInputError(f"rm_head.bias is {bias.tolist()}, but HF *ForSequenceClassification has no bias: "
                                           "the HF model's rewards would be lower by that constant. Pass --drop-rm-bias "
                                           "to convert anyway (preferences are unchanged, absolute rewards shift)")
            if bool(bias.ne(0).any()):
                log.warning("dropping rm_head.bias %s: HF rewards are shifted by minus that", bias.tolist())

        plan = [(name, t.dtype, tuple(t.shape)) for name, t in mcore_to_hf(lambda key: weights.meta(*checkpoint_name(key)), spec)]
        stored = str(plan[0][1]).removeprefix("torch.")  # record the dtype the weights really have
        config = to_installed_layout(config, dtype=stored)  # what the installed transformers reads back
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
        try:
            stream = tqdm(mcore_to_hf(get, spec), desc="nemo→hf", unit="tensor", total=len(plan), leave=False)
            write_sharded(tmp, plan, iter(stream), max_shard_bytes)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if (root / "tokenizer").is_dir():
                for f in (root / "tokenizer").iterdir():
                    if f.name != "config.json":  # the model config written above wins
                        shutil.copy2(f, tmp / f.name)
            else:
                log.warning("%s packs no tokenizer/ directory: copy the tokenizer files into %s yourself", nemo, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    hf = HFCheckpoint(hf_dir)
    return {k: hf.get(k) for k in hf.keys()}


def mcore_state(hf_dir: str | Path, make_vocab_size_divisible_by: int | None = None) -> tuple[dict[str, torch.Tensor], ModelSpec]:
    """HF → Megatron-Core (local spec) state dict in memory (tests and the whole-model baseline)."""
    from nemo_factuality.convert.mapping import hf_to_mcore

    hf = HFCheckpoint(hf_dir)
    spec = spec_from_hf_config(hf.config, make_vocab_size_divisible_by)
    return dict(hf_to_mcore(hf.get, spec)), spec


def ensure_process_group() -> None:
    """Megatron's dist_checkpointing needs a process group; create a 1-process gloo group if none exists."""
    import torch.distributed as dist

    from nemo_factuality.convert import cpu

    cpu.apply()
    if dist.is_initialized():
        return
    # an in-memory store: one process needs no rendezvous, and a file store would leave its directory behind
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
