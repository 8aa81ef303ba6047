"""Issue 17: decode with the weights on wgmma's M side and an expert's tokens on its N side (the transposed Gluon
kernel, ``gluon_transposed.grouped_transposed``), fp8 block and bf16, against the package's decode path.

Qwen3-30B-A3B's fp8 GEMMs ran at 1.19-1.40 times two plain reads of their weights at 8-512 tokens
(``fp8-sweep.json``, session 24), DeepSeek-V3's at 1.02-1.13. Both decode GEMMs stream the touched experts'
weights; a Triton program pipelines the K loop of its own tile only, so each tile starts from an empty
pipeline (Qwen3's GEMM 2 has six K steps a tile). The transposed kernel's programs, one per SM, walk their
tiles with a ring of TMA loads that runs on across tiles. Its tokens come in the permute layout's segments
of ``align`` rows (one TMA box a step); the call is ``permute_experts(..., align=...)`` with
``permute_gluon.FP8_GEMM`` (or ``BF16_GEMM``) ``= "gluon"``: (fp8: the input quantised and) permuted, GEMM 1
gated, (fp8: the quantiser,) GEMM 2, the gather back. Candidates, each the experts' call on the same routed tokens (``[T, d]`` out):

  index_gather       fused_experts on its tuned table, block map precomputed (what the layer runs)
  permute triton a16  permute_experts with 16-row segments on the Triton kernel (its table)
  gluon a16 / a32 / a64  permute_experts with 16-, 32- or 64-row segments on the transposed Gluon kernel (64:
                     for 512-1024 tokens, where DeepSeek-V3's experts get 16-32 rows each and the layer still
                     streams its weights: 11.3 GB of fp8 take 2.5 ms to read, its 0.72 PFLOP about 0.9 at 800
                     TFLOP/s)
  gluon a16 s5       the same with five TMA stages (two programs an SM's shared memory) instead of six
  gluon a16 w8       16-row segments at 8 warps (each warpgroup one m64 half of the tile) instead of 4
  gluon a16 one-pass  fp8: the input quantised once and written to its rows with its scales
                     (``permute.ONE_PASS_FP8_INPUT``: one launch for the quantiser, the copy and the scales' gather;
                     at one token the permute path's launches count, not its bytes)
  gluon a16 quantising  fp8: GEMM 1's epilogue writes GEMM 2's fp8 input and scales (a program takes each
                     128-column group's two tiles; ``permute_gluon.TRANSPOSED_QUANTIZE_IN_GEMM1``: no quantiser
                     launch between the GEMMs), and with the one-pass input too

Each output is checked against the index-gather call's (relative error <= 3e-2: the fp8 paths round
GEMM 1's output once more or less), then replayed from a CUDA graph of one call with the L2 flushed,
two rounds in alternating order, the lower round median kept. Beside them, the floor (the touched experts'
weight bytes over the read bandwidth measured in the same process) and two plain reads of those bytes, GEMM
1's weights then GEMM 2's, in one graph (``bench.fp8.read_bounds``).

    PYTHONPATH=. python tools/transposed_decode_ab.py [models] [batches]   # records transposed-decode-ab.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/transposed_decode_ab.py   # CPU: a small shape, the plumbing
    (TRANSPOSED_AB_ROWS: the candidates besides index_gather, comma-separated; at prefill, e.g. "permute triton
    a128,gluon a128,gluon a64,gluon a64 one-pass": the transposed kernel's 64-row tiles against the 128-row ones)
"""
import os
import sys

import torch

from moe_kernels.bench.fp8 import decode_bounds
from moe_kernels.bench.problems import tool_batch, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import _gluon_transposed as transposed, permute as permute_module, permute_gluon
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import permute_experts
from moe_kernels.model.costs import count_work
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 256]
GLUON = {   # name: (align, permute_gluon.TRANSPOSED_STAGES, transposed.NUM_WARPS, permute.ONE_PASS_FP8_INPUT,
    #             permute_gluon.TRANSPOSED_QUANTIZE_IN_GEMM1)
    "gluon a16": (16, 6, None, False, False), "gluon a32": (32, 6, None, False, False),
    "gluon a64": (64, 6, None, False, False), "gluon a16 s5": (16, 5, None, False, False),
    "gluon a16 w8": (16, 6, 8, False, False), "gluon a16 one-pass": (16, 6, None, True, False),
    "gluon a16 quantising": (16, 6, None, False, True), "gluon a16 one-pass quantising": (16, 6, None, True, True),
    # at prefill (fp8; bf16 has no 128-row Gluon kernel): the 64-row transposed tiles against the 128-row kernel
    "gluon a64 one-pass": (64, 6, None, True, False), "gluon a128": (128, 6, None, True, False)}
#: The candidates to time besides index_gather (all by default): names from GLUON and "permute triton a16" /
#: "permute triton a128" (the Triton permute GEMMs on 16- or 128-row segments), comma-separated.
ROWS = os.environ.get("TRANSPOSED_AB_ROWS")
ROWS = None if ROWS is None else ROWS.split(",")
UNKNOWN = sorted(set(ROWS or ()) - set(GLUON) - {"permute triton a16", "permute triton a128"})
if UNKNOWN:
    sys.exit(f"TRANSPOSED_AB_ROWS names no such candidate: {UNKNOWN}")
if device == "cuda":
    from moe_kernels.bench.ceilings import measure_read_bandwidth

    bandwidth = measure_read_bandwidth()
else:
    bandwidth = None
rows = []


def on_gluon(call, stages, warps, one_pass, quantising):
    """``call`` with the permute layout's GEMMs (fp8 and bf16) on the Gluon kernels, at ``stages`` and ``warps``,
    and (fp8) the input quantised and scattered in one pass or not, GEMM 2's input quantised by GEMM 1 or not."""
    def run():
        saved = (permute_gluon.FP8_GEMM, permute_gluon.BF16_GEMM, permute_gluon.TRANSPOSED_STAGES,
                 transposed.NUM_WARPS, permute_module.ONE_PASS_FP8_INPUT, permute_gluon.TRANSPOSED_QUANTIZE_IN_GEMM1)
        (permute_gluon.FP8_GEMM, permute_gluon.BF16_GEMM, permute_gluon.TRANSPOSED_STAGES, transposed.NUM_WARPS,
         permute_module.ONE_PASS_FP8_INPUT, permute_gluon.TRANSPOSED_QUANTIZE_IN_GEMM1) = (
            "gluon", "gluon", stages, warps, one_pass, quantising)
        try:
            return call()
        finally:
            (permute_gluon.FP8_GEMM, permute_gluon.BF16_GEMM, permute_gluon.TRANSPOSED_STAGES, transposed.NUM_WARPS,
             permute_module.ONE_PASS_FP8_INPUT, permute_gluon.TRANSPOSED_QUANTIZE_IN_GEMM1) = saved
    return run


for key in models:
    for fmt_name in ("block", "none"):   # (fp8 block, then bf16)
        fmt = FORMATS[fmt_name]
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        for batch in batches:
            hidden, weights, ids, config, blocks = tool_batch(model, batch, dtype, fmt, device)
            scales = dict(w1_scale=w1s, w2_scale=w2s) if fmt.quantized else {}
            candidates = {
                "index_gather": lambda: fused_experts(hidden, w1, w2, weights, ids, config=config, blocks=blocks,
                                                      validate_ids=False, **scales),
                "permute triton a16": lambda: permute_experts(hidden, w1, w2, weights, ids, align=16,
                                                              validate_ids=False, **scales),
                "permute triton a128": lambda: permute_experts(hidden, w1, w2, weights, ids, align=128,
                                                               validate_ids=False, **scales)}
            for name, (align, stages, warps, one_pass, quantising) in GLUON.items():
                if (one_pass or quantising) and not fmt.quantized:
                    continue   # (bf16 has no quantiser, and no 128-row Gluon kernel)
                candidates[name] = on_gluon(lambda align=align: permute_experts(
                    hidden, w1, w2, weights, ids, align=align, validate_ids=False, **scales), stages, warps, one_pass,
                    quantising)
            if ROWS is not None:
                candidates = {name: call for name, call in candidates.items() if name == "index_gather" or name in ROWS}
            elif "permute triton a128" in candidates and batch < 1024:   # (by default, prefill's segments at prefill)
                del candidates["permute triton a128"]
            reference = candidates["index_gather"]()
            lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=3e-2, warmup_ms=5, rep_ms=25,
                                                      unchecked=("index_gather",), rounds=2, alternate=True)
            work = count_work(model, ids, w1.element_size())
            row = {"model": key, "format": fmt.name, "batch": batch, "experts_touched": work.experts_touched,
                   "bytes": work.bytes, "us": lowest, "rounds_us": rounds, "errors": errors,
                   "rel_err_vs_index_gather": rel}
            if bandwidth:
                row.update(decode_bounds(work, w1, w2, bandwidth))
                row["of_floor"] = {name: us / row["floor_us"] for name, us in lowest.items()}
                row["of_two_reads"] = {name: us / row["two_reads_us"] for name, us in lowest.items()}
            rows.append(row)
            record_tool("transposed-decode-ab", rows, {"models": models, "batches": batches, "gluon": GLUON,
                                                       "read_bandwidth_bytes_per_s": bandwidth, "rounds": 2,
                                                       "timing": "CUDA graph of one call, L2 flushed"})
            print(f"{key} {fmt.name} {batch} tokens ({work.experts_touched} experts, floor "
                  f"{row.get('floor_us', 0):.1f} us, two reads {row.get('two_reads_us', 0):.1f}): " + "  ".join(
                      f"{name} {us:.1f}" for name, us in lowest.items()) + (f"  errors {errors}" if errors else ""),
                  flush=True)
        del w1, w2, w1s, w2s
        if device == "cuda":
            torch.cuda.empty_cache()
