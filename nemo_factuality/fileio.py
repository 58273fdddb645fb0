"""Writing results: atomic replacement, with the file mode an ordinary ``open()`` would give.

``tempfile.mkstemp`` creates its file 0600, and safetensors writes through such a temporary file too,
so a result renamed into place keeps a private mode whatever the umask. Every command's outputs
(eval's reports and plot, a stage's ``final/`` policy, checkpoints) go through here instead: under
umask 022 they are 0644 (directories 0755), as any other file the user writes.

Reading inputs: ``input_file`` is the one check of a file a command reads (a knowledge store, a prompt, pairs or
passages file), so a directory given where a file belongs is said to be one, with what to pass, instead of "does not
exist"; ``output_file`` the check of a file a command is about to write, before any work.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from nemo_factuality.types import FactualityInputError


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


def input_file(path: str | Path, what: str, *, hint: str = "", suffixes: Sequence[str] = ()) -> Path:
    """``path`` when it is a file to read; else one ``FactualityInputError`` saying what it is instead — missing, a
    directory (naming the files ending in ``suffixes`` it holds: the ones likely meant), something else — then
    ``hint``, what to pass.

    >>> input_file(Path(__file__).parent, "data file", hint="pass one of its files", suffixes=[".py"])
    Traceback (most recent call last):
    ...
    nemo_factuality.types.FactualityInputError: data file .../nemo_factuality is a directory, not a file (it holds __init__.py, cli.py, config.py, …); pass one of its files
    """
    p = Path(path)
    if p.is_file():
        return p
    tail = f"; {hint}" if hint else ""
    if p.is_dir():
        held = sorted(f.name for f in p.iterdir() if f.is_file() and f.name.endswith(tuple(suffixes))) if suffixes else []
        inside = f" (it holds {', '.join(held[:3])}{', …' if len(held) > 3 else ''})" if held else ""
        raise FactualityInputError(f"{what} {p} is a directory, not a file{inside}{tail}")
    if p.exists():
        raise FactualityInputError(f"{what} {p} is not a regular file{tail}")
    raise FactualityInputError(f"{what} {p} does not exist{tail}")


def output_file(path: str | Path, what: str, example_name: str) -> Path:
    """``path`` when a file can be written there (nothing there yet, or a file to replace); a directory is one
    ``FactualityInputError`` naming a file path inside it (``example_name``), before the command does any work."""
    p = Path(path)
    if p.is_dir():
        raise FactualityInputError(f"{what} {p} is a directory; pass the file to write, e.g. {what} {p / example_name}")
    return p
