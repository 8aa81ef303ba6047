"""Issue 17: index-gather's decode call on its table entry against the same entry with deeper (or shallower)
software pipelines in each GEMM, and on the other M tile.

``bench tune`` offers five pipeline stages only where an expert averages fewer than 16 rows (the "streaming"
tiles); from 16 rows up it tries at most four. DeepSeek-V3 reaches 16 rows an expert at 512 tokens, and its
tables' entries drop from five stages (256 tokens: 1.077x the fp8 read floor in ``fp8-sweep-s48.json``) to three
(512 tokens: 1.116x), while the experts' GEMMs still stream weights (their FLOPs are under a tenth of the read's
time). This times, in one process, the table's entry and each variant of it with GEMM 1's and GEMM 2's
``num_stages`` in ``STAGE_AB_STAGES`` (those that fit in shared memory, by the tuner's own rule) and, with
``STAGE_AB_BLOCK_M``, the M tiles named there, and with ``STAGE_AB_WARPS`` each GEMM's warps (4 or 8; the
entry's stages kept), and with ``STAGE_AB_SWAP=1`` each GEMM the entry runs untransposed on 16 or 32 token rows
(``mma.sync``), transposed through TMA: the whole experts call as the layer runs it (both GEMMs, the quantisers,
the top-k sum; a CUDA graph, do_bench's L2 flush), four rounds interleaved, the order reversed every other round,
each candidate's output checked against the entry's. ``STAGE_AB_SET`` adds any other variants by name, ``;``
between variants and ``,`` between the fields one variant changes, each ``field=value`` on the entry's
``MoEConfig.to_dict()`` (``down.block_n=128;down.persistent=1;sum_in_gemm=true;pdl=true``; values as JSON). A
config that two names give is timed once, under the first.

    PYTHONPATH=. python tools/stage_depth_ab.py deepseek-v3 block 256,512 [record name]
    PYTHONPATH=. STAGE_AB_STAGES=3,4,5,6 STAGE_AB_BLOCK_M=16,32 python tools/stage_depth_ab.py qwen3-30b-a3b none 512
    PYTHONPATH=. STAGE_AB_STAGES= STAGE_AB_SET="down.persistent=1;sum_in_gemm=true" python tools/stage_depth_ab.py \
        deepseek-v3 block 512
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/stage_depth_ab.py qwen3-30b-a3b none 8   # CPU: a plan, nothing timed

Without a GPU the tool prints the variants of the CPU's tiles (the default tiles of a shrunk model, not the
table's entry) and times nothing. An entry with a stream lag runs both GEMMs as one kernel on GEMM 1's stages and
warps, so only GEMM 1's are varied there. Formats: ``block`` (fp8, 128 x 128 block scales) and ``none`` (bf16).
The record (``results/<device>/``) keeps every candidate's round medians, the variant's tiles and switches, and the
floor (``count_work``'s bytes, as ``bench fp8`` counts them, over the read bandwidth measured in the same process).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from moe_kernels.bench.ceilings import measure_read_bandwidth
from moe_kernels.bench.cli import write_record
from moe_kernels.bench.problems import tool_batch, tool_blocks, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.bench.tune_candidates import fits
from moe_kernels.kernels.config import GemmTiles, MoEConfig, check_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.model.costs import count_work


def variants(config, fmt, stages: list[int], block_ms: list[int], warps: list[int] = (), swap: bool = False) -> dict:
    """Name -> MoEConfig: the entry itself first, then each (GEMM 1 stages, GEMM 2 stages) pair that fits and
    differs from it, then the entry on each other M tile of ``block_ms`` that fits, then each (GEMM 1 warps,
    GEMM 2 warps) pair of ``warps`` that differs from the entry's; with ``swap``, each GEMM that the entry runs
    untransposed on a 16- or 32-row token tile, transposed with TMA."""
    out = {"table": config}
    # An entry with a stream lag runs both GEMMs as one kernel (index_gather._streams), on GEMM 1's stages and warps:
    # GEMM 2's would change nothing there, so they are not varied.
    streamed = config.stream_lag is not None
    for s1 in stages:
        for s2 in stages:
            if (s1, s2) == (config.gate_up.num_stages, config.down.num_stages) or (
                    streamed and s2 != config.down.num_stages):
                continue
            g1 = dataclasses.replace(config.gate_up, num_stages=s1)
            g2 = dataclasses.replace(config.down, num_stages=s2)
            if fits(config.block_m, g1.block_n, g1.block_k, s1, True, fmt, g1.k_chunks) and \
                    fits(config.block_m, g2.block_n, g2.block_k, s2, False, fmt, g2.k_chunks):
                out[f"stages {s1}/{s2}"] = dataclasses.replace(config, gate_up=g1, down=g2)
    for block_m in block_ms:
        if block_m == config.block_m:
            continue
        up, down = config.gate_up, config.down
        if fits(block_m, up.block_n, up.block_k, up.num_stages, True, fmt, up.k_chunks) and \
                fits(block_m, down.block_n, down.block_k, down.num_stages, False, fmt, down.k_chunks):
            out[f"block_m {block_m}"] = dataclasses.replace(config, block_m=block_m)
    for w1 in warps:
        for w2 in warps:
            if (w1, w2) != (config.gate_up.num_warps, config.down.num_warps) and not (
                    streamed and w2 != config.down.num_warps):
                out[f"warps {w1}/{w2}"] = dataclasses.replace(
                    config, gate_up=dataclasses.replace(config.gate_up, num_warps=w1),
                    down=dataclasses.replace(config.down, num_warps=w2))
    if swap and config.block_m <= 32:   # a GEMM on 16- or 32-row token tiles that is not transposed: transposed
        for gemm in ("gate_up", "down"):   # (wgmma from 64 weight rows), its weight tiles by TMA
            tiles = getattr(config, gemm)
            if not tiles.swap_ab and tiles.block_n >= 64:
                out[f"swap {gemm}"] = dataclasses.replace(
                    config, **{gemm: dataclasses.replace(tiles, swap_ab=True, tma=True)})
    return out


def set_variants(config, spec: str, skip_refused: bool = False) -> dict:
    """Name -> MoEConfig for ``STAGE_AB_SET``: each ``;``-separated variant is the entry with the ``,``-separated
    ``field=value`` changes applied to its ``to_dict()`` (``gate_up.`` or ``down.`` before a GEMM's field; values
    as JSON: ``128``, ``true``, ``null``). A variant equal to the entry is left out; a misspelt field is an error
    naming it, and so is a variant ``check_config`` refuses, unless ``skip_refused`` (then it is left out, named)."""
    out = {}
    for variant in (v.strip() for v in spec.split(";")):
        if not variant:
            continue
        d = config.to_dict()
        for change in variant.split(","):
            field, sep, value = change.strip().partition("=")
            *path, key = field.strip().split(".")
            if not sep or len(path) > 1 or (path and path[0] not in ("gate_up", "down")):
                raise ValueError(f"STAGE_AB_SET: {change!r} must be field=value, the field a MoEConfig key or "
                                 "gate_up.<GemmTiles field> / down.<GemmTiles field>")
            target = d[path[0]] if path else d
            known = {f.name for f in dataclasses.fields(GemmTiles if path else MoEConfig)}   # (to_dict leaves out
            if key not in known:                                                           # fields at defaults)
                raise ValueError(f"STAGE_AB_SET: {field.strip()!r} is not a field of the entry "
                                 f"({', '.join(sorted(known))})")
            target[key] = json.loads(value)
        variant_config = MoEConfig.from_dict(d, func="STAGE_AB_SET", name=variant)
        try:
            check_config("STAGE_AB_SET", variant_config)
        except (ValueError, TypeError) as error:   # (the entry cannot take it: chunks on a streamed entry, say)
            if skip_refused:
                print(f"left out {variant!r}: {error}")
                continue
            raise
        if variant_config != config:
            out[variant] = variant_config
    return out


def distinct(candidates: dict) -> dict:
    """The candidates with each config once: a later name for a config already listed (``stream_lag=null,X`` where
    the entry does not stream is ``X``) is left out, named, rather than timed twice in the same run."""
    out = {}
    for name, config in candidates.items():
        same = next((kept for kept, other in out.items() if other == config), None)
        if same is None:
            out[name] = config
        else:
            print(f"left out {name!r}: the same config as {same!r}")
    return out


def tiles_text(config) -> str:
    """One line for a config's M tile and both GEMMs' tiles."""
    def gemm(t):
        return (f"n{t.block_n} k{t.block_k}" + (f"x{t.k_chunks}" if t.k_chunks > 1 else "")
                + f" w{t.num_warps} s{t.num_stages}" + (" tma" if t.tma else "")
                + (" swap" if t.swap_ab else "") + (f" p{t.persistent}" if t.persistent else "")
                + (f" split{t.split_k}" if t.split_k > 1 else ""))
    switches = [name for name, on in (("sum", config.sum_in_gemm), ("pdl", config.pdl),
                                      ("quant in gemm", config.quant_in_gemm)) if on]
    if config.stream_lag is not None:
        switches.append(f"stream lag {config.stream_lag}")
    if config.one_launch is not None:
        switches.append("one launch")
    return f"m{config.block_m} | {gemm(config.gate_up)} | {gemm(config.down)}" + "".join(f" {s}" for s in switches)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    key, fmt_name, batches = argv[0], argv[1], [int(b) for b in argv[2].split(",")]
    record = argv[3] if len(argv) > 3 else "stage-depth-ab"
    stages = [int(s) for s in os.environ.get("STAGE_AB_STAGES", "3,4,5").split(",") if s]
    block_ms = [int(b) for b in os.environ.get("STAGE_AB_BLOCK_M", "").split(",") if b]
    warps = [int(w) for w in os.environ.get("STAGE_AB_WARPS", "").split(",") if w]
    swap = os.environ.get("STAGE_AB_SWAP", "") not in ("", "0")
    changes = os.environ.get("STAGE_AB_SET", "")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = FORMATS[fmt_name]
    model, dtype, w1, w1_scale, w2, w2_scale = tool_weights(key, fmt, device)
    plan_only = device == "cpu"
    read = None if plan_only else measure_read_bandwidth()
    rows = []
    for batch in batches:
        hidden, weights, ids, config, _ = tool_batch(model, batch, dtype, fmt, device)
        if config.one_launch is not None:   # (fused_experts given a block map would run the two GEMMs instead)
            print(f"{key} {fmt_name} {batch}: the entry runs both GEMMs in one launch; tools/two_phase_variants.py "
                  "varies its tiles")
            continue
        # (a variant this entry cannot take is left out, named; a misspelt field stops the run before any timing)
        candidates = distinct({**variants(config, fmt, stages, block_ms, warps, swap),
                               **set_variants(config, changes, skip_refused=True)})
        for name, cfg in candidates.items():
            print(f"{key} {fmt_name} {batch}: {name:<14} {tiles_text(cfg)}")
        if plan_only:
            continue
        calls = {}
        for name, cfg in candidates.items():
            blocks = tool_blocks(ids, cfg.block_m, model, fmt)   # (the map the layer takes for this format)
            calls[name] = (lambda cfg=cfg, blocks=blocks: fused_experts(
                hidden, w1, w2, weights, ids, config=cfg, blocks=blocks, validate_ids=False,
                w1_scale=w1_scale, w2_scale=w2_scale))
        reference = calls["table"]()
        lowest, rounds, errors, rel = time_lowest(calls, reference, tolerance=1e-2, warmup_ms=5, rep_ms=30,
                                                  rounds=4, alternate=True)
        work = count_work(model, ids, 1 if fmt.quantized else 2)
        floor_us = work.bytes / read * 1e6
        for name in candidates:
            text = errors.get(name) or f"{lowest[name]:8.1f} us {lowest[name] / floor_us:.3f}x floor"
            print(f"{key} {fmt_name} {batch}: {name:<14} {text}")
        rows.append({"model": key, "format": fmt_name, "batch": batch, "floor_us": floor_us,
                     "experts_touched": work.experts_touched, "bytes": work.bytes,
                     "tiles": {name: tiles_text(cfg) for name, cfg in candidates.items()},
                     "lowest_us": lowest, "rounds_us": rounds, "errors": errors, "rel_err": rel})
        torch.cuda.empty_cache()
    if not plan_only:
        write_record(record, {"rows": rows, "read_bandwidth": read, "stages": stages, "block_ms": block_ms,
                              "warps": warps, "swap": swap, "set": changes,
                              "method": "fused_experts on the table entry and its variants, CUDA graph, do_bench's L2 "
                                        "flush, four rounds interleaved (order reversed every other round), lowest "
                                        "round median; floor: count_work's bytes (the touched experts' weights, the "
                                        "activations in and out) over the read bandwidth"}, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
