"""Issue 17: where decode's time goes, stage by stage, on index-gather and on the transposed Gluon path.

Session 29's H100 run (``transposed-decode-ab-*.json``) timed the experts call on the transposed Gluon kernel
(permute layout, 16-row segments) at 1.0-2.4 times index-gather's on Qwen3-30B-A3B, and within a few percent
of the Triton permute path: the permute path's own launches (alignment and copy, quantisers, the gather back)
may be what costs, not its GEMMs. This times every stage of both calls alone, on the same routed tokens, each
replayed from a CUDA graph of one call with the L2 flushed (inputs made once before), two rounds interleaved,
the lower median kept:

  index-gather (its tuned table, block map precomputed): ig quantize x (fp8), ig gemm 1 (gated, SiLU·mul in
      its epilogue), ig quantize y (fp8), ig gemm 2, ig sum (unless GEMM 2 sums), ig call (fused_experts)
  transposed (segments of 16 rows, permute_gluon.FP8_GEMM / BF16_GEMM = "gluon"): tr permute (alignment and
      copy; fp8: indices, then quantize_scatter), tr gemm 1, tr quantize y (fp8, to rows_used), tr gemm 2,
      tr unpermute (the gather back with the routing weights), tr call (permute_experts)

and, from the same process, the floor (the touched experts' weight bytes over the read bandwidth) and two plain
reads of those bytes, GEMM 1's weights then GEMM 2's (``bench.fp8.read_bounds``). If "tr gemm 1 + tr gemm 2"
beats "ig gemm 1 + ig gemm 2" by more than the permute path's extra stages cost, the transposed kernel's
product is worth putting on index-gather's gathered rows (a token tile loaded with pointer loads: it is 16 x 128
bytes a K step beside a 16 KB weight box); if not, the GEMMs themselves are where decode loses to two reads.

    PYTHONPATH=. python tools/decode_stages.py [models] [batches]   # GPU: records decode-stages.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/decode_stages.py   # CPU: a small shape, the plumbing
"""
import os
import sys

import torch

from moe_kernels.bench.fp8 import decode_bounds
from moe_kernels.bench import problems
from moe_kernels.bench.problems import tool_batch, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import permute as permute_module, permute_gluon
from moe_kernels.kernels.combine import unpermute
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import permute_experts
from moe_kernels.model.costs import count_work
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 256]
formats = os.environ.get("DECODE_STAGES_FORMATS", "block,none").split(",")   # (fp8 block, bf16)
ALIGN = 16
bandwidth = None
if device == "cuda":
    from moe_kernels.bench.ceilings import measure_read_bandwidth

    bandwidth = measure_read_bandwidth()
rows = []


def on_gluon(call):
    """``call`` with the permute layout's GEMMs on the Gluon kernels (the transposed one at 16-row segments)."""
    def run():
        saved = permute_gluon.FP8_GEMM, permute_gluon.BF16_GEMM
        permute_gluon.FP8_GEMM = permute_gluon.BF16_GEMM = "gluon"
        try:
            return call()
        finally:
            permute_gluon.FP8_GEMM, permute_gluon.BF16_GEMM = saved
    return run


def index_gather_stages(hidden, w1, w2, w1s, w2s, weights, ids, fmt, config, blocks):
    """The index-gather call's stages (``problems.index_gather_stages``, named "ig ..."), and the call itself."""
    scales = dict(w1_scale=w1s, w2_scale=w2s) if fmt.quantized else {}
    stages = {f"ig {name}": call for name, call in
              problems.index_gather_stages(hidden, w1, w2, w1s, w2s, weights, ids, fmt, config, blocks).items()}
    stages["ig call"] = lambda: fused_experts(hidden, w1, w2, weights, ids, config=config, blocks=blocks,
                                              validate_ids=False, **scales)
    return stages


def transposed_stages(hidden, w1, w2, w1s, w2s, weights, ids, fmt):
    """The transposed Gluon call's stages (16-row segments), each a closure over inputs made once here."""
    from moe_kernels.kernels.gluon_transposed import grouped_transposed
    from moe_kernels.kernels.quant import per_token_group_quant_fp8
    from moe_kernels.kernels.quant_scatter import quantize_scatter

    e = w1.shape[0]
    scales = dict(w1_scale=w1s, w2_scale=w2s) if fmt.quantized else {}
    if fmt.quantized:   # the one-pass input: the indices, then each token quantised once into its rows
        def permuted_input():
            permuted = permute_module.permute(hidden, ids, e, align=ALIGN, validate_ids=False, copy=False)
            return permuted, *quantize_scatter(hidden, permuted.src2dst, permuted.m_indices.shape[0])
    else:
        def permuted_input():
            permuted = permute_module.permute(hidden, ids, e, align=ALIGN, validate_ids=False)
            return permuted, permuted.rows, None
    permuted, rows_in, rows_scale = permuted_input()
    used = permuted.rows_used

    def gemm(x, w, x_scale, w_scale, gated):
        return grouped_transposed(x, w, permuted.m_indices, used, x_scale=x_scale, w_scale=w_scale, gated=gated,
                                  block_t=ALIGN, stages=permute_gluon.TRANSPOSED_STAGES, validate_ids=False)

    inter = gemm(rows_in, w1, rows_scale, w1s, True)
    a, a_scale = per_token_group_quant_fp8(inter, 128, rows_used=used) if fmt.quantized else (inter, None)
    y = gemm(a, w2, a_scale, w2s, False)
    stages = {"tr permute": lambda: permuted_input()[0],
              "tr gemm 1": lambda: gemm(rows_in, w1, rows_scale, w1s, True),
              "tr gemm 2": lambda: gemm(a, w2, a_scale, w2s, False),
              "tr unpermute": lambda: unpermute(y, permuted.src2dst, weights),
              "tr call": on_gluon(lambda: permute_experts(hidden, w1, w2, weights, ids, align=ALIGN,
                                                          validate_ids=False, **scales))}
    if fmt.quantized:
        stages["tr quantize y"] = lambda: per_token_group_quant_fp8(inter, 128, rows_used=used)
    return stages


for key in models:
    for fmt_name in formats:
        fmt = FORMATS[fmt_name]
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        for batch in batches:
            hidden, weights, ids, config, blocks = tool_batch(model, batch, dtype, fmt, device)
            stages = index_gather_stages(hidden, w1, w2, w1s, w2s, weights, ids, fmt, config, blocks)
            errors = {}
            try:   # (where the Gluon kernels do not run, the index-gather rows alone)
                stages.update(transposed_stages(hidden, w1, w2, w1s, w2s, weights, ids, fmt))
            except (ValueError, TypeError, RuntimeError) as error:
                errors["transposed"] = str(error).splitlines()[0][:200]
            reference = stages["ig call"]()
            lowest, rounds, failed, _ = time_lowest(stages, reference, tolerance=1.0, warmup_ms=5, rep_ms=25,
                                                    unchecked=tuple(stages), rounds=2, alternate=True)
            errors.update(failed)
            work = count_work(model, ids, w1.element_size())
            row = {"model": key, "format": fmt.name, "batch": batch, "experts_touched": work.experts_touched,
                   "bytes": work.bytes, "us": lowest, "rounds_us": rounds, "errors": errors,
                   "config": {"block_m": config.block_m, "sum_in_gemm": config.sum_in_gemm}}
            both = {path: sum(lowest.get(f"{path} gemm {i}", float("nan")) for i in (1, 2)) for path in ("ig", "tr")}
            row["gemms_us"] = both
            if bandwidth:
                row.update(decode_bounds(work, w1, w2, bandwidth))
                row["gemms_of_two_reads"] = {path: us / row["two_reads_us"] for path, us in both.items()}
            rows.append(row)
            record_tool("decode-stages", rows, {"models": models, "batches": batches, "align": ALIGN,
                                                "read_bandwidth_bytes_per_s": bandwidth, "rounds": 2,
                                                "timing": "each stage alone, CUDA graph of one call, L2 flushed"})
            print(f"{key} {fmt.name} {batch} tokens ({work.experts_touched} experts; floor "
                  f"{row.get('floor_us', 0):.1f} us, two reads {row.get('two_reads_us', 0):.1f}; GEMMs: ig "
                  f"{both['ig']:.1f}, tr {both['tr']:.1f}): " + "  ".join(f"{name} {us:.1f}" for name, us in
                                                                           sorted(lowest.items()))
                  + (f"  errors {errors}" if errors else ""), flush=True)
        del w1, w2, w1s, w2s
        if device == "cuda":
            torch.cuda.empty_cache()
