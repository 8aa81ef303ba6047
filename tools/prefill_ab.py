"""Prefill A/B on a GPU (issue 18): the permute layout's switches against index-gather and against
cuBLAS on balanced groups, both GEMMs, bf16 and fp8 block, at prefill batches.

For each (model, format, batch), every candidate is replayed from a CUDA graph of one call (the L2
flushed before each replay by triton's do_bench), two rounds interleaved over the candidates,
the lower round median kept; TFLOP/s counts the routed GEMMs' FLOPs (2 * rows * 3 * d * F).

    PYTHONPATH=. python tools/prefill_ab.py [models] [batches] [formats]
    # e.g. qwen3-30b-a3b,deepseek-v3 1024,4096,16384 none,block     (the record also as $OUT/prefill-ab.json)

Candidates (permute: 128-row segments; "tma": both operands through tensor descriptors):
  index-gather          fused_experts with its tuned table (the default path)
  permute default       permute_experts with its table (or the borrowed index-gather entry)
  permute tma p1        128x256x64 tiles (128x128x128 in fp8), 8 warps, GROUP_M 8, TMA, persistent grid
  permute tma p1 sum    the same with GEMM 2 adding each row into its token (sum_in_gemm)
  bmm balanced          torch.bmm on ceil(T k / E) rows per expert, SiLU-mul between (bf16 only)
"""
import dataclasses
import sys

import torch

from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.sweep import _balanced_bmm
from moe_kernels.bench.timing import time_candidates
from moe_kernels.kernels.config import GemmTiles, MoEConfig
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import permute_experts

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]


def tma_config(fp8: bool, summed: bool) -> MoEConfig:
    if fp8:   # the block-fp8 K loop: one 128-wide scale group per K step, 8 warps, 4 stages
        tiles = GemmTiles(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=1)
    else:
        tiles = GemmTiles(block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=1)
    gate_up = dataclasses.replace(tiles, block_n=tiles.block_n // 2)   # GEMM 1 loads 2 x block_n weight rows
    return MoEConfig(128, gate_up, tiles, sum_in_gemm=summed)


rows = []
for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device, moe_intermediate_size=256)
        e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
        for batch in batches:
            x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
            scales = dict(w1_scale=w1s, w2_scale=w2s)
            fp8 = fmt.quantized
            candidates = {
                "index-gather": lambda: fused_experts(x, w1, w2, weights, ids, validate_ids=False, **scales),
                "permute default": lambda: permute_experts(x, w1, w2, weights, ids, validate_ids=False, **scales),
                "permute tma p1": lambda c=tma_config(fp8, False): permute_experts(x, w1, w2, weights, ids, config=c,
                                                                                   validate_ids=False, **scales),
                "permute tma p1 sum": lambda c=tma_config(fp8, True): permute_experts(x, w1, w2, weights, ids,
                                                                                      config=c, validate_ids=False,
                                                                                      **scales),
            }
            if not fp8 and device == "cuda":
                candidates["bmm balanced"] = _balanced_bmm(model, batch, dtype, device)
            reference = candidates["index-gather"]().float()
            times, errors, _ = time_candidates(candidates, reference, tolerance=0.05, warmup_ms=5, rep_ms=40,
                                               unchecked=("bmm balanced",))
            flops = 2 * batch * k * 3 * d * f
            row = {"model": key, "format": fname, "batch": batch, "errors": errors,
                   "us": {n: min(t) for n, t in times.items()},
                   "tflops": {n: flops / min(t) / 1e6 for n, t in times.items()}}
            rows.append(row)
            print(key, fname, batch, {n: round(v, 1) for n, v in row["us"].items()},
                  {n: round(v) for n, v in row["tflops"].items()}, errors or "", flush=True)
            del x, weights, ids, reference
            torch.cuda.empty_cache()
        del w1, w2
# A record with provenance (results/<device>/prefill-ab.json, packed by gpu_check.sh), and a copy in $OUT.
from moe_kernels.results import record_tool  # noqa: E402

# The tiles of the fixed variants (the others take their tables): what a layout choice made from this
# record runs (moe_kernels/kernels/layout-choices.json).
variants = {f"permute tma p1{' sum' if summed else ''} ({'fp8' if fp8 else 'bf16'})": tma_config(fp8, summed).to_dict()
            for fp8 in (False, True) for summed in (False, True)}
path = record_tool("prefill-ab", rows, {"models": models, "batches": batches, "formats": formats,
                                        "variant_configs": variants})
print(f"recorded {path}")
