"""Writing results: atomic replacement, with the file mode an ordinary ``open()`` would give.

``tempfile.mkstemp`` creates its file 0600, and safetensors writes through such a temporary file too,
so a result renamed into place keeps a private mode whatever the umask. Every command's outputs
(eval's reports and plot, a stage's ``final/`` policy, checkpoints) go through here instead: under
umask 022 they are 0644 (directories 0755), as any other file the user writes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it (Linux ``/proc``); elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def respect_umask(path: str | Path) -> None:
    """``chmod`` ``path`` (and, for a directory, everything under it) to 0666/0777 less the umask."""
    mask = current_umask()
    root = Path(path)
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path`` (mode as ``open()``'s).

    A failure leaves ``path`` as it was and no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        respect_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
