"""Where a checkpoint's reference policy comes from, and the check that it is still there.

GRPO's and PPO's reference is the initial checkpoint (``model.path`` / ``model.restore_from_path``): a
checkpoint records its path and a fingerprint (``reference.json``) instead of another copy of the weights —
at the 32B preset every rank writing its shard made each checkpoint ~128 GB larger — and a resumed run
rebuilds the reference from it: found by fingerprint (the same files mounted at another path are accepted, with
one log line), refused in one line when they changed or are gone. KTO's reference is
each iteration's starting policy: the backend stores it once (hf: one file; aligner: a Megatron distributed
checkpoint, sharded like the policy and restorable on another TP/PP/DP).

The fingerprint is cheap and content-based: SHA-256 over the checkpoint's file names and sizes, each file's
first 64 KiB (a safetensors/torch-dist header: tensor names, dtypes, shapes, offsets; a config file whole)
and 16 evenly spaced 4 KiB samples of the rest. It reads ~130 KiB per file whatever the model's size (a
full hash of a 32B checkpoint reads 65 GB at every save and resume), does not depend on mtimes (a copy to
node-local disk keeps it), and catches another model, a re-save, a truncated file or retrained weights
written over the same path (training moves essentially every stored byte).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
RECORD = "reference.json"
_HEAD, _SAMPLES, _SAMPLE = 64 * 1024, 16, 4 * 1024


def fingerprint(path: str | Path) -> str:
    """Content fingerprint of a checkpoint file or directory (see the module docstring)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            digest.update(fh.read(_HEAD))
            if size > _HEAD:
                for i in range(_SAMPLES):
                    fh.seek(_HEAD + (size - _HEAD - _SAMPLE) * i // max(_SAMPLES - 1, 1))
                    digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()


def initial_record(path: str | Path, key: str) -> dict[str, Any]:
    """``reference.json`` for a reference that is the initial checkpoint at ``path`` (config key ``key``)."""
    resolved = Path(path).resolve()
    return {"kind": "initial", "path": str(resolved), "key": key, "fingerprint": fingerprint(resolved)}


def stored_record(where: str) -> dict[str, Any]:
    """``reference.json`` for a reference stored in the checkpoint itself (``where``: its file or directory)."""
    return {"kind": "stored", "where": where}


def write_record(checkpoint: Path, record: Mapping[str, Any]) -> None:
    (Path(checkpoint) / RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")


def read_record(checkpoint: Path) -> dict[str, Any] | None:
    f = Path(checkpoint) / RECORD
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None


def check_initial(record: Mapping[str, Any], configured: str | Path, checkpoint: Path) -> Path:
    """The initial checkpoint a resumed run rebuilds its reference from is the one the run started from; returns
    its path now. Matched by fingerprint, not path: a container (or a copy to node-local disk) may mount the same
    files elsewhere, which is accepted with one log line; another checkpoint there, or a missing one, is one line."""
    path, key, now = Path(record["path"]), record["key"], Path(configured).resolve()
    if now != path:
        if not now.exists():
            raise FactualityInputError(f"{checkpoint}: this run started from {key}={path} (its reference policy) and "
                                       f"{key}={configured} now does not exist: resume with {key}={path} or a copy of it")
        if fingerprint(now) != record["fingerprint"]:
            raise FactualityInputError(f"{checkpoint}: this run started from {key}={path} (its reference policy) but "
                                       f"{key}={configured} now holds another checkpoint (fingerprint differs): "
                                       f"resume with {key}={path} or a copy of it")
        log.info("%s: the reference policy (%s) moved from %s to %s; same fingerprint, resuming", checkpoint, key,
                 path, now)
        return now
    if not path.exists():
        raise FactualityInputError(f"{checkpoint}: the reference policy is the run's initial checkpoint {path} ({key}), "
                                   f"which is missing: put it back there (or a copy anywhere, named by {key}) to "
                                   "resume, or start a new run (exp_manager.explicit_log_dir)")
    if fingerprint(path) != record["fingerprint"]:
        raise FactualityInputError(f"{checkpoint}: the initial checkpoint {path} ({key}, the reference policy) changed "
                                   "since the run started (fingerprint differs): restore the original files to resume, "
                                   "or start a new run (exp_manager.explicit_log_dir)")
    return path
