"""The chapter's source as one zip on the site, ``moe-chapter.zip``, and a note on every section
that says so.

A notebook downloaded alone from a page (the download button) cannot run: its figures are files
beside it (``figures/*.svg``) and its code is the ``moe_kernels`` package. After the build this
extension writes every file git tracks (the notebooks and their figures, the package, the recorded
results, the Makefile) into ``_build/html/moe-chapter.zip`` under ``moe-chapter/``; the
introduction links to it, and every notebook's page gets a short note right under its title (added
to the doctree when the page is read: the notebooks themselves are not changed) that links to it.
Entries are sorted and dated 2026-01-01, so the same tree gives the same bytes. Without git (a tree
that is not a clone) no archive is written and the build says why.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging

ARCHIVE = "moe-chapter.zip"
_DATE = (2026, 1, 1, 0, 0, 0)
logger = logging.getLogger(__name__)


def tracked_files(root: Path) -> list[str]:
    """The files git tracks under ``root`` (empty when ``root`` is not a git work tree)."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(name for name in listing.stdout.decode().split("\0") if name and (root / name).is_file())


def write_archive(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    root = Path(app.srcdir)
    files = tracked_files(root)
    if not files:
        logger.info(f"{ARCHIVE}: not written ({root} is not a git work tree)")
        return
    with zipfile.ZipFile(Path(app.outdir) / ARCHIVE, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in files:
            entry = zipfile.ZipInfo(f"moe-chapter/{name}", date_time=_DATE)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = ((root / name).stat().st_mode & 0o777) << 16
            archive.writestr(entry, (root / name).read_bytes())


# The class the note carries on the page (tests/test_site.py finds it by it).
NOTE_CLASS = "moe-source-note"


def source_note(docname: str) -> nodes.admonition:
    """The note for the page of ``docname``: how to get the whole source, with a link to the
    archive relative to the page (``notebooks/05_grouped_gemm`` -> ``../moe-chapter.zip``)."""
    href = "../" * docname.count("/") + ARCHIVE
    para = nodes.paragraph()
    para += nodes.Text("The download button saves this notebook alone, without its figures or the ")
    para += nodes.literal("", "moe_kernels")
    para += nodes.Text(" package it imports. To run it, download the whole chapter, ")
    para += nodes.reference("", ARCHIVE, refuri=href, internal=False)
    para += nodes.Text(", unzip it and run ")
    para += nodes.literal("", "make lab")
    para += nodes.Text(" there (")
    para += addnodes.pending_xref("", nodes.inline("", "the introduction"), refdomain="std", reftype="doc",
                                  reftarget="/book/intro", refexplicit=True, refdoc=docname)
    para += nodes.Text(" says more).")
    note = nodes.admonition(classes=["note", NOTE_CLASS])
    note += nodes.title("", "Running this notebook")
    note += para
    return note


def add_source_note(app, doctree) -> None:
    """Put the note under the title of every notebook's page."""
    docname = app.env.docname
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not section.children or not isinstance(section[0], nodes.title):
        logger.warning(f"{docname}: no title to put the note about {ARCHIVE} under")
        return
    section.insert(1, source_note(docname))


def setup(app):
    app.connect("build-finished", write_archive)
    app.connect("doctree-read", add_source_note)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
