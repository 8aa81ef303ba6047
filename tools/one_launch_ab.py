"""Decode A/B (issue 17): both expert GEMMs in one launch (moe_kernels/kernels/one_launch.py, and its two-phase
kernel, moe_kernels/kernels/two_phase.py) against the tuned two-GEMM path, at decode batches, bf16 and fp8 block,
with the read floor measured in the same process.

For each (model, format, batch): the two GEMMs as the sweep times them (``fused_experts`` with its
tuned table and the block map made beforehand: GEMM 1, GEMM 2 and the top-k sum), the whole
``fused_experts`` call (its block map too), and the one-launch kernel at every tile of a small
grid (its fill included). Each candidate is replayed from a CUDA graph of one call with L2 flushed
before each replay (``do_bench``), two rounds interleaved over the candidates, the lower of the two
round medians kept. The floor is the touched experts' weight bytes over the read bandwidth
measured here; "read" is a plain read of the same bytes in one kernel.

    PYTHONPATH=. python tools/one_launch_ab.py [models] [batches] [formats] [kernels] [name] [two-phase tiles]
    # e.g. qwen3-30b-a3b,deepseek-v3 1,2,4,8 none,block one,two   (records results/<device>/one-launch-ab.json)

``kernels``: ``one`` (the one-phase tiles below), ``two`` (the two-phase tiles), or both (the default); ``name``
the record's name (default ``one-launch-ab``); the two-phase tiles as ``f,d,w,s,p;...`` (GEMM 1 rows, GEMM 2 rows,
warps, stages, programs per SM; default a grid of 16). fp8 runs W8A16 in the one-phase kernel and W8A8 in the two-phase
kernel and the two GEMMs (``rel_err_vs_two_gemms`` shows it).
"""
import itertools
import sys

import torch

from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.ceilings import ReadFloor
from moe_kernels.bench.timing import time_candidates
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.one_launch import OneLaunchTiles, one_launch_experts
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
kernels = sys.argv[4].split(",") if len(sys.argv) > 4 else ["one", "two"]
name = sys.argv[5] if len(sys.argv) > 5 else "one-launch-ab"
TILES = []
if "one" in kernels:
    TILES += ([OneLaunchTiles(f, 512, w, s) for f, w, s in itertools.product((16, 32, 64), (4, 8), (1, 3))]
              + [OneLaunchTiles(128, 256, 8, s) for s in (1, 3)])
if "two" in kernels:   # GEMM 1 rows, GEMM 2 rows per unit, warps, pipeline depth; programs per SM (K steps of 128)
    grid = ([tuple(int(v) for v in spec.split(",")) for spec in sys.argv[6].split(";")] if len(sys.argv) > 6 else
            [(f, d, w, s, p) for (f, d, w, s), p in itertools.product(
                ((32, 64, 4, 4), (32, 128, 4, 4), (32, 128, 4, 3), (64, 128, 8, 4), (64, 128, 8, 3), (64, 64, 8, 4),
                 (16, 128, 4, 4), (32, 256, 8, 3)), (1, 2))])
    TILES += [OneLaunchTiles(f, d, w, s, phases=2, programs_per_sm=p) for f, d, w, s, p in grid]
if device == "cpu":
    TILES = TILES[:1] + TILES[-1:]

floor = ReadFloor(device)

rows = []


def save():
    """The record so far (rewritten after every row: a run cut short keeps what it measured)."""
    return record_tool(name, rows, {"models": models, "batches": batches, "formats": formats,
                                               "read_bandwidth": floor.bandwidth,
                                               "tiles": [t.as_dict() for t in TILES],
                                      "kernels": kernels})


for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
        scales = dict(w1_scale=w1s, w2_scale=w2s)
        for batch in batches:
            x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
            config = get_config(batch, e, f, d, w1.dtype, x.device)
            blocks = assign_blocks(ids, config.block_m, e, validate_ids=False)
            candidates = {
                "two GEMMs": lambda: fused_experts(x, w1, w2, weights, ids, config=config, blocks=blocks,
                                                   validate_ids=False, **scales),
                "fused_experts": lambda: fused_experts(x, w1, w2, weights, ids, validate_ids=False, **scales),
            }
            for tiles in TILES:
                label = (f"one launch f{tiles.block_f} d{tiles.block_d} w{tiles.num_warps} s{tiles.num_stages}"
                         + (f" two-phase p{tiles.programs_per_sm}" if tiles.phases == 2 else ""))
                candidates[label] = (lambda t=tiles: one_launch_experts(x, w1, w2, weights, ids, tiles=t,
                                                                          validate_ids=False, **scales))
            reference = candidates["two GEMMs"]().float()
            # (fp8: the one launch is W8A16, the two GEMMs W8A8: a few percent apart)
            times, errors, rel = time_candidates(candidates, reference, tolerance=0.1 if fmt.quantized else 0.05,
                                                 warmup_ms=2, rep_ms=20)
            us = {n: min(t) for n, t in times.items()}
            best = min((n for n in us if n.startswith("one launch")), key=us.get, default=None)
            best_two = min((n for n in us if "two-phase" in n), key=us.get, default=None)
            row = {"model": key, "format": fname, "batch": batch, **floor.of_experts(ids, w1, w1s, w2, w2s),
                   "us": us, "rounds_us": times, "rel_err_vs_two_gemms": rel, "errors": errors,
                   "best_one_launch": best, "best_two_phase": best_two, "two_gemm_config": config.to_dict()}
            rows.append(row)
            save()
            print(f"{key} {fname} {batch}: floor {row['floor_us']:.1f} us, two GEMMs {us.get('two GEMMs', 0):.1f}, "
                  f"fused_experts {us.get('fused_experts', 0):.1f}, best one launch {best} "
                  f"{us.get(best, 0):.1f} (rel err {rel.get(best, 0):.1e}); best two-phase {best_two} "
                  f"{us.get(best_two, 0):.1f}; read {row.get('read_same_bytes_us') or 0:.1f}", errors or "", flush=True)
            del x, weights, ids, reference, blocks
            if device == "cuda":
                torch.cuda.empty_cache()
        del w1, w2


print(f"recorded {save()}")
