"""Import every module of nemo_factuality and print one JSON object: {module: "ok" | "needs torch" | error}.

    PYTHONPATH=. some-python tools/check_imports.py

Run by tests/test_container_stack.py under the container's Python (a venv without torch, see
tools/setup_container_python_env.sh): a module may fail only because it needs torch.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path


def main() -> int:
    warnings.simplefilter("ignore")  # third-party import-time warnings are not what this checks
    import nemo_factuality

    root = Path(nemo_factuality.__file__).parent
    names = sorted(".".join(("nemo_factuality", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
                   for p in root.rglob("*.py"))
    results = {}
    for name in names:  # every file, also below a package that needs torch
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except ModuleNotFoundError as err:
            results[name] = "needs torch" if err.name == "torch" else f"{type(err).__name__}: {err}"
        except Exception as err:  # reported, not raised: every module gets its line
            results[name] = f"{type(err).__name__}: {err}"
    json.dump({"python": sys.version.split()[0], "modules": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
