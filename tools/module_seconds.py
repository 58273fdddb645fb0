"""Seconds per test module from a pytest ``--durations=0`` log (setup + call + teardown of each test, summed), as
``tests/module_seconds.json``: tests/conftest.py runs the longest modules first within their stack rank.

    NEMO_FACTUALITY_DURATIONS=0 bash tools/run_tests.sh > run.log 2>&1
    python tools/module_seconds.py run.log > tests/module_seconds.json
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+(\S+?\.py)(?:::|\s|$)")


def module_seconds(log: str) -> dict[str, float]:
    """``{module path: seconds}`` from the durations section of a pytest log, the longest first.

    >>> module_seconds("12.50s call     tests/a.py::test_x\\n0.50s setup    tests/a.py::test_x\\n3.00s call tests/b.py::t[1]")
    {'tests/a.py': 13.0, 'tests/b.py': 3.0}
    """
    total: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        match = LINE.match(line)
        if match:
            total[match.group(2)] += float(match.group(1))
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(module_seconds(Path(argv[0]).read_text(errors="replace")), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
