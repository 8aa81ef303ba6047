"""Recorded GPU measurements: write them with provenance, read them back for the book.

A record is a JSON file ``results/<device-slug>/<name>.json`` holding ``provenance`` (device,
torch, triton and CUDA versions, UTC date, git commit, command) and ``data``. The book plots these
when no GPU is present, and always says where the numbers came from.

Example::

    >>> device_slug("NVIDIA H200")
    'nvidia-h200'
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def provenance() -> dict:
    """Where and with what a measurement was taken."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # The GPU machine gets a copy of the tree without git history: the caller passes the commit.
    commit = os.environ.get("MOE_KERNELS_COMMIT")
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=RESULTS_DIR.parent, timeout=10).stdout.strip()
            commit = out if re.fullmatch(r"[0-9a-f]{40}", out) else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
    }


def record(name: str, data: dict, directory: Path | None = None) -> Path:
    """Write ``data`` with provenance to ``results/<device>/<name>.json`` and return the path."""
    prov = provenance()
    folder = (directory or RESULTS_DIR) / device_slug(prov["device"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"provenance": prov, "data": data}, indent=1) + "\n")
    return path


def load(name: str, device: str = "nvidia-h200") -> dict:
    """Read a recorded result; raises FileNotFoundError naming the file if it was never recorded."""
    path = RESULTS_DIR / device / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no recorded result {path.relative_to(RESULTS_DIR.parent)}")
    return json.loads(path.read_text())


def describe(rec: dict) -> str:
    """One line of provenance for a figure caption."""
    p = rec["provenance"]
    commit = str(p["git_commit"])
    dirty = " plus uncommitted changes" if commit.endswith("-dirty") else ""
    return (f"measured on {p['device']}, torch {p['torch']}, triton {p['triton']}, CUDA {p['cuda']}, "
            f"{p['date_utc'][:10]}, commit {commit[:8]}{dirty}")
