"""Sphinx configuration of kvfsm's docs (MyST Markdown, built with -W).

The package documented is the one in this checkout (not whatever is
installed), and every diagram and lifecycle table is rendered from it at
build time by the local extension in `_ext/kvfsm_sphinx.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))

import kvfsm  # noqa: E402  (after the path set-up above)

project = "kvfsm"
author = "the kvfsm authors"
copyright = "2026, the kvfsm authors"
version = release = kvfsm.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "kvfsm_sphinx",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "diagrams"]
templates_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings write `name` for code: resolve it as a Python object when it is one.
default_role = "py:obj"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

# The examples fail rooms on purpose: keep the library's warnings out of the build output.
doctest_global_setup = """
import logging
import kvfsm
logging.getLogger("kvfsm").addHandler(logging.NullHandler())
"""
# Only the examples written for doctest run; other code blocks are illustrations.
doctest_test_doctest_blocks = "default"

html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"kvfsm {release}"
html_theme_options = {
    "description": "The lifecycle layer for KV-cache transfers in disaggregated LLM serving",
    "fixed_sidebar": True,
    "page_width": "1100px",
}
