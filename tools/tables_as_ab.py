"""Run ``python -m moe_kernels.bench fp8`` with the tile tables looked up as on another GPU (issue 17).

A GPU with no tuned table of its own runs :func:`~moe_kernels.kernels.config.default_config`'s tiles: on an
H100 that was every routed shape until session 36 (only the H200 had tables), and its Qwen3-30B-A3B fp8 decode
took 2.18 times the fp8 floor at 128 tokens where two plain reads took 1.08 (``fp8-sweep-zero-s36.json``). This
times the same sweep with every table lookup answered as the GPU named here would answer it
(``config._device_name``), so that the other GPU's tuned tiles can be measured on this one before they are copied
into its own tables.

    PYTHONPATH=. python tools/tables_as_ab.py "NVIDIA H200" --batches 1,8,64,512 --record --name fp8-sweep-h200-tables
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/tables_as_ab.py "NVIDIA H200" --check   # CPU: the lookup only
"""
from __future__ import annotations

import sys

import torch

from moe_kernels.kernels import config


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    as_gpu, rest = argv[0], argv[1:]
    config._device_name = lambda index=None: as_gpu   # every lookup from here on, tables and crossovers
    config._cached_choice.cache_clear()
    if rest == ["--check"]:   # the lookup a Qwen3-30B-A3B fp8 call at 512 tokens would make, from any machine
        choice = config.choose_config(512, 128, 768, 2048, torch.float8_e4m3fn, "cpu", device_name=as_gpu)
        print(f"as {as_gpu}: {choice.source} {choice.table} entry {choice.entry}")
        return 0
    from moe_kernels.bench.fp8 import main as fp8_main

    return fp8_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
