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
        "command": command_line(),
        "python": platform.python_version(),
        **_l2_flush(),
    }


def _l2_flush() -> dict:
    """How ``bench.timing.median_ms`` empties the L2 (``MOE_KERNELS_L2_FLUSH``), where it was set: ``{"l2_flush":
    "clean"}``; records without the key were timed with do_bench's zeroing (tools that call ``do_bench`` themselves,
    as ``launch_floor.py`` and ``l2_flush_ab.py`` do, name their own methods). A bad value fails here too."""
    if not os.environ.get("MOE_KERNELS_L2_FLUSH"):
        return {}
    from .bench.timing import l2_flush

    return {"l2_flush": l2_flush()}


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, with no machine-specific paths: ``python -m moe_kernels.bench sweep
    ...`` for a module run, a script's path relative to the repository otherwise.

        >>> command_line([str(RESULTS_DIR.parent / "moe_kernels" / "bench" / "__main__.py"), "sweep", "--record"])
        'python -m moe_kernels.bench sweep --record'
        >>> command_line([str(RESULTS_DIR.parent / "tools" / "tune_align.py")])
        'python tools/tune_align.py'
    """
    argv = list(sys.argv if argv is None else argv)
    root = RESULTS_DIR.parent
    head = Path(argv[0]).resolve() if argv and argv[0] not in ("", "-c") else None
    if head is not None and head.is_relative_to(root):
        relative = head.relative_to(root)
        if relative.parts[0] == "moe_kernels":
            module = ".".join(relative.with_suffix("").parts)
            argv[0] = "python -m " + module.removesuffix(".__main__")
        else:
            argv[0] = f"python {relative.as_posix()}"
    elif head is not None:
        argv[0] = head.name
    return " ".join(argv)


def record(name: str, data: dict, directory: Path | None = None) -> Path:
    """Write ``data`` with provenance to ``results/<device>/<name>.json`` and return the path."""
    prov = provenance()
    folder = (directory or RESULTS_DIR) / device_slug(prov["device"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"provenance": prov, "data": data}, indent=1) + "\n")
    return path


def record_tool(name: str, rows: list, config: dict) -> Path:
    """An A/B tool's record, ``{"rows": rows, "config": config}`` written by :func:`record`; where
    ``$OUT`` is set (a device run, whose files come back from that folder alone) the same file is
    copied there too, provenance included. Tools call it after every row, so a run cut short keeps
    what it measured."""
    path = record(name, {"rows": rows, "config": config})
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(path.read_text())
    return path


def print_timings(title: str, us: dict, tflops: dict, errors: dict) -> None:
    """An A/B tool's row as it prints it: a title, then each candidate's microseconds and TFLOP/s
    (0 where it has none), then the errors, if any.

        >>> print_timings("qwen3 4096:", {"gemm1": 430.25, "permute": 120.0}, {"gemm1": 468.4}, {})
        qwen3 4096:
           gemm1         430.2 us     468 TFLOP/s
           permute       120.0 us       0 TFLOP/s
    """
    print(title, flush=True)
    width = max(map(len, us), default=0) + 2
    for name, t in us.items():
        print(f"   {name:{width}s} {t:9.1f} us {tflops.get(name, 0):7.0f} TFLOP/s", flush=True)
    if errors:
        print("   errors:", errors, flush=True)


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
