"""Sphinx configuration: MyST Markdown pages and an API reference from the docstrings.

Sphinx with MyST, as JAX and Flax build theirs: the docstrings are already written in Sphinx's roles
(``:mod:``, ``:func:``, ``:class:``), so autodoc renders them as they are, and the pages stay Markdown that
GitHub shows too. ``make docs`` builds it with warnings as errors; ``tests/test_docs.py`` runs that build
and every code block of the pages and the README.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "paged-jax"
author = "the paged-jax authors"
copyright = "2026, the paged-jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "diagram/screenshot.png"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings give shapes and dtypes; annotations alone would repeat them badly
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # dataclass fields are documented once, by autodoc



def _copy_results() -> None:
    """The committed tables and figures of ``results/`` become pages of the site (``results.md`` lists
    them), copied anew at each build so they never drift from the files; a table whose first heading
    is a section gets its file name as a title."""
    import shutil

    src, dst = ROOT / "results", pathlib.Path(__file__).parent / "results"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for path in sorted(src.iterdir()):
        if path.suffix == ".md":
            text = path.read_text()
            if not text.lstrip().startswith("# "):
                text = f"# {path.stem}\n\n{text}"
            (dst / path.name).write_text(text)
        elif path.suffix in (".png", ".csv"):
            shutil.copy2(path, dst / path.name)


_copy_results()


def _site_results_links(app, docname, source) -> None:
    """A page links the committed tables as ``../results/x`` (right where the
    Markdown is read, on GitHub or in a clone); in the site they are the
    copies beside the pages (:func:`_copy_results`), ``results/x``."""
    source[0] = source[0].replace("](../results/", "](results/")


def setup(app):
    app.connect("source-read", _site_results_links)

html_theme = "sphinx_book_theme"
html_title = "paged-jax"
html_theme_options = {"show_toc_level": 2}
html_static_path = []
# The draggable diagram is one self-contained page: copied next to the site as it is.
html_extra_path = ["_extra"]  # _extra/diagram links to diagram/: the site serves it at diagram/index.html
suppress_warnings = []
