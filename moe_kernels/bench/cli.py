"""Command-line pieces the bench commands share: argument types that check a value while argparse
parses it (model names, token counts, bounded numbers), the flags of a timed run over models and
batches, and writing a run's record.

Checking in the parser is what lets a mistyped flag fail at once, on any machine, with argparse's
usage and exit code 2, before a command looks for a GPU or spends minutes measuring ceilings.

    >>> model_names("qwen3-30b-a3b,deepseek-v3")
    ['qwen3-30b-a3b', 'deepseek-v3']
    >>> positive_ints("1,8,64")
    [1, 8, 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

from ..model.shapes import MODELS

DEFAULT_MODELS = ("deepseek-v3", "qwen3-30b-a3b")
DEFAULT_BATCHES = tuple(2**i for i in range(15))  # 1 .. 16384


def model_names(text: str) -> list[str]:
    """``--models``: a comma list of keys of :data:`~moe_kernels.model.shapes.MODELS`, in the order
    given (a name given twice counts once)."""
    names = list(dict.fromkeys(m for m in text.split(",") if m))
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if not names:
        raise argparse.ArgumentTypeError(f"no model named in {text!r}; choose from {sorted(MODELS)}")
    return names


def positive_ints(text: str) -> list[int]:
    """``--batches`` and the like: a comma list of at least one int, each >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints >= 1, got {text!r}")
    return values


def at_least(kind: type, low: float):
    """An argparse type: ``kind(text)`` (int or float), refused below ``low`` and when NaN.

        >>> at_least(float, 0)("inf")
        inf
    """
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not value >= low:  # written so that NaN fails too
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} >= {low}, got {text!r}")
        return value

    return parse


def add_run_arguments(parser: argparse.ArgumentParser, *, warmup_ms: float, rep_ms: float) -> None:
    """The flags of a run over models and batches timed by ``do_bench``: ``--models``, ``--batches``,
    ``--seed``, ``--warmup-ms``, ``--rep-ms``."""
    parser.add_argument("--models", type=model_names, default=list(DEFAULT_MODELS),
                        help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--batches", type=positive_ints, default=list(DEFAULT_BATCHES),
                        help="comma list of token counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-ms", type=at_least(float, 0), default=warmup_ms)
    parser.add_argument("--rep-ms", type=at_least(float, 0), default=rep_ms)


def add_record_arguments(parser: argparse.ArgumentParser, default_name: str) -> None:
    """``--record``, ``--name`` and ``--results-dir``: where :func:`write_record` puts the run."""
    parser.add_argument("--record", action="store_true", help="write results/<device>/<name>.json")
    parser.add_argument("--name", default=None, help=f"record name (default {default_name})")
    parser.add_argument("--results-dir", default=None, help="where results/<device>/ lives (default: the repo's)")


def start_run(parser: argparse.ArgumentParser, argv: list[str] | None, dtype: torch.dtype):
    """Parse ``argv`` (a bad argument exits there, before anything looks for a GPU), then set torch up
    for a run over the models and batches asked for, in ``dtype``. Returns ``args`` and the settings
    the record keeps, the settings None (once it has said so) where there is no CUDA GPU."""
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench: needs a CUDA GPU (timings on the CPU interpreter mean nothing)", file=sys.stderr)
        return args, None
    torch.backends.cuda.matmul.allow_tf32 = False
    settings = {"models": {m: dataclasses.asdict(MODELS[m]) for m in args.models}, "batches": args.batches,
                "dtype": str(dtype), "seed": args.seed, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                "routing": "uniform: top-k of iid normal logits (fused_topk, renormalised)"}
    return args, settings


def log_line(line: str) -> None:
    """Print a line at once: a long run's progress shows while it runs, also through a pipe."""
    print(line, flush=True)


def write_record(name: str, data: dict, results_dir: str | None, log=log_line) -> None:
    from ..results import record

    path = record(name, data, Path(results_dir) if results_dir else None)
    log(f"recorded {path}")
