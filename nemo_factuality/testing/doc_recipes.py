"""The getting-started page's offline recipes as the tests read them (``docs/getting_started.md``, section "Training
that learns, offline"): its bash blocks, and each ``nemo-factuality train`` command in one as argv. Shared by the
docs test (every command parses into its stage's config) and the lab's quick run (the first one trains on its base)."""

from __future__ import annotations

import re
import shlex

from nemo_factuality.config import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "getting_started.md"
SECTION = "## Training that learns, offline"


def recipe_blocks() -> list[str]:
    """The bash blocks of the section, in order."""
    text = PAGE.read_text(encoding="utf-8")
    if SECTION not in text:
        raise AssertionError(f"{PAGE} lost its section {SECTION!r}")
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def train_commands(block: str, variables: dict[str, str]) -> list[list[str]]:
    """Each ``nemo-factuality train`` command of ``block`` as argv after ``train``, continuation lines joined,
    comments dropped and ``$NAME`` expanded from ``variables``.

    >>> train_commands("x=1\\nnemo-factuality train grpo a=$B \\\\\\n    b=2  # note\\n", {"B": "/base"})
    [['grpo', 'a=/base', 'b=2']]
    """
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["nemo-factuality", "train"]:
            out.append([re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], w) for w in words[2:]])
    return out
