"""Sphinx configuration of nanscan's user guide and API reference.

Built by `python -m sphinx -W --keep-going -n -b html docs docs/_build/html` (CI runs exactly that):
warnings are errors and every cross-reference must resolve, so a renamed or removed function that a
page documents (``autofunction``) or names (``{py:func}``) breaks the build. The pages are Markdown
(MyST), the same files GitHub shows; the reference is generated from the docstrings by autodoc,
which imports the built package, so what it shows is what runs. Sphinx rather than MkDocs with
mkdocstrings for that reason, and for the nitpicky check of every cross-reference; it is what
PyTorch, Lightning and TransformerEngine build their references with, so its conventions are the
ones this project's readers know.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the package built in place (`pip install -e .`) or installed

import nanscan  # noqa: E402  (after the path: autodoc reads the real, built package)

project = "nanscan"
author = "nanscan contributors"
release = nanscan.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Args:/Returns:/Raises: sections
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/dev holds design notes for contributors, built too; the prototype folder is C++ sources.
exclude_patterns = ["_build", "dev/stable-abi-prototype"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve, and are checked
# The lab notebook (benchmarks/RESULTS.md, NOTES.md) is included as written: its headings skip levels.
suppress_warnings = ["myst.header"]

autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # nanscan's pages say what nanscan does (torch's refer to its own labels)
autodoc_typehints = "description"  # the types beside each argument, not in a long signature line
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Nitpicky mode checks every cross-reference; what lives outside this project (torch, numpy, the
# standard library: no intersphinx, since CI reaches no documentation host) is not ours to resolve.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|collections|typing|typing_extensions|os|pathlib|enum|types|abc)(\..*)?"),
    (
        r"py:.*",
        r"(Tensor|Module|Optimizer|Iterable|Iterator|Sequence|Mapping|Callable|Any|Path|PathLike|Figure|Tensors|iterable|Hook|Writer)",
    ),
    (r"py:.*", r"(matplotlib|lightning|transformers|tensorboard)(\..*)?"),
    (r"py:.*", r"_.*|.*\._[A-Za-z].*"),  # private helpers named in a signature
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|None|object|type|Exception)"),
]

html_theme = "furo"
html_title = f"nanscan {release}"
