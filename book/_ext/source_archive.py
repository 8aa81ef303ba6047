"""The chapter's source as one zip on the site, ``moe-chapter.zip``.

A notebook downloaded alone from a page (the download button) cannot run: its figures are files
beside it (``figures/*.svg``) and its code is the ``moe_kernels`` package. After the build this
extension writes every file git tracks (the notebooks and their figures, the package, the recorded
results, the Makefile) into ``_build/html/moe-chapter.zip`` under ``moe-chapter/``; the
introduction links to it. Entries are sorted and dated 2026-01-01, so the same tree gives the same
bytes. Without git (a tree that is not a clone) no archive is written and the build says why.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

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


def setup(app):
    app.connect("build-finished", write_archive)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
