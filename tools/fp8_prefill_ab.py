"""fp8 block prefill A/B (issue 18): whole-config candidates for the index-gather table at prefill
batches, and the permute layout beside them, after the block-scale K loop's fix (one weight scale per
tile and step, tools/block_scale_ab.py): the tables' prefill entries were vLLM-like 64-row, 4-warp
tiles chosen on the old loop, where 8-warp 128-row tiles spilled.

Each candidate is the whole experts call (quantiser, GEMM 1, GEMM 2 and the top-k sum; permute and
unpermute on the permute layout), replayed from a CUDA graph of one call, the L2 flushed before each
replay, two rounds interleaved, the lower round median kept; TFLOP/s over the routed GEMMs' FLOPs.

    PYTHONPATH=. python tools/fp8_prefill_ab.py [models] [batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 1024,2048,4096,8192,16384   (records results/<device>/fp8-prefill-ab.json)
"""
import sys

import torch

from moe_kernels.bench.ceilings import measure_fp8_gemm_rate
from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import time_candidates
from moe_kernels.kernels.config import GemmTiles, MoEConfig, get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import permute_experts
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 2048, 4096, 8192, 16384]
BLOCK = FORMATS["block"]


def pair(block_m, gate_up, down, **switches):
    """A config from two (block_n, block_k, warps, stages) tuples and the switches both GEMMs share."""
    def tiles(spec):
        n, k, warps, stages = spec
        return GemmTiles(n, k, group_m=8, num_warps=warps, num_stages=stages, **switches)
    return MoEConfig(block_m, tiles(gate_up), tiles(down))


# name -> (layout, config): index-gather configs for the table, permute ones for layout='auto'
CANDIDATES = {
    "ig m128 w8 s4": ("index_gather", pair(128, (64, 128, 8, 4), (128, 128, 8, 4))),
    "ig m128 w8 s3": ("index_gather", pair(128, (64, 128, 8, 3), (128, 128, 8, 3))),
    "ig m128 w8 s4 tma": ("index_gather", pair(128, (64, 128, 8, 4), (128, 128, 8, 4), tma=True)),
    "ig m128 w8 s4 tma p1": ("index_gather", pair(128, (64, 128, 8, 4), (128, 128, 8, 4), tma=True, persistent=1)),
    "ig m64 w8 s3": ("index_gather", pair(64, (128, 128, 8, 3), (128, 128, 8, 4))),
    "ig m64 w4 s4": ("index_gather", pair(64, (64, 128, 4, 4), (128, 128, 4, 4))),
    "permute m128 tma p1": ("permute", pair(128, (64, 128, 8, 3), (128, 128, 8, 4), tma=True, persistent=1)),
    "permute m64 tma p1": ("permute", pair(64, (128, 128, 8, 3), (128, 128, 8, 4), tma=True, persistent=1)),
}
if device == "cpu":
    CANDIDATES = {"ig m32": ("index_gather", pair(32, (32, 32, 4, 2), (32, 32, 4, 2))),
                  "permute m32": ("permute", pair(32, (32, 32, 4, 2), (32, 32, 4, 2), tma=True, persistent=1))}
fp8_rate = measure_fp8_gemm_rate() if device == "cuda" else None
rows = []


def save():
    return record_tool("fp8-prefill-ab", rows, {
        "models": models, "batches": batches, "fp8_gemm_rate": fp8_rate,
        "candidates": {n: {"layout": layout, "config": c.to_dict()} for n, (layout, c) in CANDIDATES.items()}})


for key in models:
    model, dtype, w1, w1s, w2, w2s = tool_weights(key, BLOCK, device)
    e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    scales = dict(w1_scale=w1s, w2_scale=w2s, validate_ids=False)
    for batch in batches:
        x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
        table = get_config(batch, e, f, d, w1.dtype, x.device)
        candidates = {"table": lambda: fused_experts(x, w1, w2, weights, ids, config=table, **scales)}
        for name, (layout, config) in CANDIDATES.items():
            if layout == "index_gather":
                candidates[name] = lambda c=config: fused_experts(x, w1, w2, weights, ids, config=c, **scales)
            else:
                candidates[name] = lambda c=config: permute_experts(x, w1, w2, weights, ids, config=c,
                                                                    align=c.block_m, **scales)
        times, errors, rel = time_candidates(candidates, candidates["table"]().float(), tolerance=0.02,
                                             warmup_ms=5, rep_ms=40)
        us = {n: min(t) for n, t in times.items()}
        flops = 2 * batch * k * 3 * d * f
        row = {"model": key, "batch": batch, "us": us, "tflops": {n: flops / t / 1e6 for n, t in us.items()},
               "rounds_us": times, "errors": errors, "rel_err": rel, "table": table.to_dict()}
        rows.append(row)
        save()
        print(f"{key} {batch}: " + ", ".join(f"{n} {t:.0f} us ({row['tflops'][n]:.0f})" for n, t in us.items()),
              errors or "", flush=True)
        del x, weights, ids
        if device == "cuda":
            torch.cuda.empty_cache()
    del w1, w2

print(f"recorded {save()}")
