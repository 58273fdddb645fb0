"""Sphinx configuration: MyST Markdown pages, the reference generated from the code, autodoc of the public API.

Build (offline, warnings as errors; ``tests/docs/test_site.py`` runs exactly this):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext")]  # the package from this checkout; the reference generator

project = "nemo_factuality"
author = "nemo_factuality contributors"
copyright = "the nemo_factuality contributors"  # noqa: A001
from nemo_factuality import __version__ as release  # noqa: E402

version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "reference_gen",  # writes reference/{cli,config,metrics,exit_codes}.md at builder-inited
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: the documented modules import without the GPU stacks; mock them anyway so that a module that imports one
# lazily-but-at-top in the future does not break the build.
autodoc_mock_imports = ["pytriton", "tritonclient", "nemo", "nemo_aligner", "megatron", "vllm", "apex",
                        "transformer_engine", "tensorrt_llm"]
autodoc_typehints = "none"  # signatures show them; `from __future__ import annotations` leaves strings
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = "nemo_factuality"
html_theme_options = {
    "navigation_depth": 2,
    "show_toc_level": 2,
    "navbar_align": "left",
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path: list[str] = []
