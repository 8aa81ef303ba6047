"""Issue 17: the two-phase kernel (moe_kernels/kernels/two_phase.py) in its variants, and where its time goes.

For each (model, format, batch) and each two-phase tile: the tuned two GEMMs (``fused_experts`` with the table's
tiles, never its one launch, the block map made beforehand), a plain read of the same bytes, and the kernel in each
variant below, replayed from CUDA graphs with L2 flushed before each replay, two interleaved rounds, the lower round
median kept. Then, for the first tile in each variant, one call's timeline (each unit's start, end and SM, from the
GPU's global clock, after a clean flush of the L2), summarised: when the last GEMM 1 unit ended, when GEMM 2 ended, and
how long units took.

Variants (``TWO_PHASE_VARIANTS``, a comma list; default the first two): ``token A`` (the token as the MMA's A
operand: 16-row tiles on mma.sync, which converts fp8 to fp16 first), ``swap_ab`` (the weights as A: tiles of 64 rows
or more run on Hopper's wgmma, fp8 read from shared memory as it is; fewer rows stay on mma.sync), and ``swap_ab 2
chunks`` / ``swap_ab 4 chunks`` (``k_chunks``: each step reads 2 or 4 chunks of ``block_k`` values of every row).
``TWO_PHASE_UNITS=0`` keeps only the timelines' summaries. A GEMM 2 unit's bar in a timeline includes its wait for
h; a variant that failed (out of shared memory, say) gets no timeline. The batches are ``bench.problems.tool_batch``'s
(routed with the seed ``batch``; session 38's records used ``1 + batch``). Session 38's first run measured three more
(a GEMM 2 unit waiting for all of GEMM 1, an L2 prefetch of its weights before the wait, self-resetting counters):
``two-phase-variants-s38.json``.

    PYTHONPATH=. python tools/two_phase_variants.py [models] [batches] [formats] [tiles] [name]
    # tiles as f,d,w,s,p;... (default 32,64,4,4,2;32,64,4,4,4); records results/<device>/<name>.json
"""
import dataclasses
import os
import sys

import torch

from moe_kernels.bench.ceilings import ReadFloor
from moe_kernels.bench.problems import tool_batch, tool_weights
from moe_kernels.bench.read_kernel import weight_reader
from moe_kernels.bench.timing import clean_flush, time_lowest
from moe_kernels.kernels import two_phase
from moe_kernels.kernels.config import OneLaunchTiles
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.one_launch import one_launch_experts
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["block", "none"]
tile_specs = sys.argv[4] if len(sys.argv) > 4 else "32,64,4,4,2;32,64,4,4,4"
name = sys.argv[5] if len(sys.argv) > 5 else "two-phase-variants"
TILES = [OneLaunchTiles(f, d, w, s, phases=2, programs_per_sm=p)
         for f, d, w, s, p in (tuple(int(v) for v in spec.split(",")) for spec in tile_specs.split(";"))]
ALL_VARIANTS = {"token A": dict(swap_ab=False), "swap_ab": dict(swap_ab=True),
                "swap_ab 2 chunks": dict(swap_ab=True, k_chunks=2), "swap_ab 4 chunks": dict(swap_ab=True, k_chunks=4)}
VARIANTS = {v: ALL_VARIANTS.get(v) for v in os.environ.get("TWO_PHASE_VARIANTS", "token A,swap_ab").split(",")}
if None in VARIANTS.values():
    raise SystemExit(f"TWO_PHASE_VARIANTS: {sorted(v for v, c in VARIANTS.items() if c is None)} unknown; "
                     f"variants are {sorted(ALL_VARIANTS)}")
KEEP_UNITS = os.environ.get("TWO_PHASE_UNITS", "1") != "0"   # (0: the timelines' summaries only)
if device == "cpu":
    TILES = [OneLaunchTiles(16, 32, 4, 1, phases=2, block_k=128, programs_per_sm=1)]

floor = ReadFloor(device)
rows = []


def save():
    return record_tool(name, rows, {"models": models, "batches": batches, "formats": formats,
                                    "read_bandwidth": floor.bandwidth, "tiles": [t.as_dict() for t in TILES],
                                    "variants": VARIANTS})


def tag_of(t):
    return f"f{t.block_f} d{t.block_d} w{t.num_warps} s{t.num_stages} p{t.programs_per_sm}"


def timeline(call, n1, n2):
    """One call's units: [start, end, SM] in us from the first start, after a clean flush; and a summary."""
    marks = torch.zeros((n1 + n2, 3), dtype=torch.int64, device=device)
    flush = clean_flush(device)
    call()
    torch.cuda.synchronize()
    flush()
    two_phase.timeline = marks
    try:
        call()
    finally:
        two_phase.timeline = None
    torch.cuda.synchronize()
    m = marks.cpu()
    t0 = int(m[:, 0].min())
    start, end = (m[:, 0] - t0).double() / 1e3, (m[:, 1] - t0).double() / 1e3
    took = end - start
    summary = {
        "span_us": float(end.max()),
        "gemm1_last_end_us": float(end[:n1].max()), "gemm1_first_end_us": float(end[:n1].min()),
        "gemm2_first_start_us": float(start[n1:].min()), "gemm2_last_start_us": float(start[n1:].max()),
        "gemm1_unit_us": [float(took[:n1].median()), float(took[:n1].max())],
        "gemm2_unit_us": [float(took[n1:].median()), float(took[n1:].max())],
        "sms_used": int(m[:, 2].unique().numel()),
    }
    return summary, [[round(float(a), 3), round(float(b), 3), int(c)] for a, b, c in zip(start, end, m[:, 2])]


for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        k, d, f = model.top_k, model.hidden_size, model.moe_intermediate_size
        scales = dict(w1_scale=w1s, w2_scale=w2s)
        for batch in batches:
            x, weights, ids, config, blocks = tool_batch(model, batch, dtype, fmt, device)
            config = dataclasses.replace(config, one_launch=None)   # (the two GEMMs, never the table's one launch)
            touched = torch.unique(ids)
            read = weight_reader(w1[touched], w2[touched]) if device == "cuda" else (lambda: None)
            candidates = {
                "two GEMMs": lambda: fused_experts(x, w1, w2, weights, ids, config=config, blocks=blocks,
                                                   validate_ids=False, **scales),
                "read": read,
            }
            for tiles in TILES:
                for vname, variant in VARIANTS.items():
                    candidates[f"{tag_of(tiles)} {vname}"] = (lambda t=dataclasses.replace(tiles, **variant):
                                                              one_launch_experts(x, w1, w2, weights, ids, tiles=t,
                                                                                 validate_ids=False, **scales))
            reference = candidates["two GEMMs"]().float()
            us, rounds, errors, rel = time_lowest(candidates, reference, tolerance=0.02 if fmt.quantized else 0.01,
                                                  warmup_ms=2, rep_ms=20, unchecked=("read",))
            row = {"model": key, "format": fname, "batch": batch, **floor.of_experts(ids, w1, w1s, w2, w2s),
                   "us": us, "rounds_us": rounds, "errors": errors, "rel_err_vs_two_gemms": rel,
                   "two_gemm_config": config.to_dict(), "timelines": {}}
            if device == "cuda":
                for tiles in TILES[:1]:
                    n1, n2 = two_phase.units(batch, k, d, f, tiles)
                    tag = tag_of(tiles)
                    for vname, variant in VARIANTS.items():
                        if f"{tag} {vname}" in errors:
                            continue
                        summary, units = timeline(lambda t=dataclasses.replace(tiles, **variant): one_launch_experts(
                            x, w1, w2, weights, ids, tiles=t, validate_ids=False, **scales), n1, n2)
                        row["timelines"][f"{tag} {vname}"] = {"summary": summary, "n1": n1, "n2": n2,
                                                               "units": units if batch <= 2 and KEEP_UNITS else None}
                        print(f"   timeline {tag} {vname}: {summary}", flush=True)
            rows.append(row)
            save()
            best = min((n for n in us if n not in ("two GEMMs", "read")), key=us.get, default=None)
            print(f"{key} {fname} {batch}: floor {row['floor_us']:.1f} read {us.get('read', 0):.1f} two GEMMs "
                  f"{us.get('two GEMMs', 0):.1f}; " + ", ".join(f"{n} {t:.1f}" for n, t in us.items()
                                                               if n not in ("two GEMMs", "read"))
                  + f"; best {best}", errors or "", flush=True)
            del x, weights, ids, reference, blocks, read
            if device == "cuda":
                torch.cuda.empty_cache()
        del w1, w2


print(f"recorded {save()}")
