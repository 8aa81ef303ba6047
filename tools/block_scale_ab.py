"""fp8 block-scale A/B (issues 17 and 18): one weight scale per tile and K step against one per column,
at decode (the whole experts call) and at prefill (the permute layout's GEMMs alone), with the read
floor and the GEMM rates measured in the same process.

A block-fp8 K step multiplies its product by the rows' scales and the columns' scales before adding it.
A tile of at most 128 columns lies in one 128-column scale block, so its columns share one scale; the
core once loaded it per column anyway, a register per column: at 128 x 128 tiles with 8 warps that
made 255 registers (ptxas -v, sm_90a), and spills once the scales were also loaded a step ahead.
Now such a tile loads one scale (``SCALES`` = 1); ``SCALES`` = 4 keeps the per-column loads, for this
A/B. Candidates:

  decode (fused_experts, the H200 table's tiles; quantiser, GEMM 1, GEMM 2, top-k sum):
    one scale        the default                per column    SCALES = 4
    bf16 table       the bf16 layer (unchecked): the fp8 speedup
  prefill (grouped_gemm_contiguous alone on 128-row segments, tiles of tools/prefill_gemm_ab.py):
    gemm1 / gemm2 <tiles> one scale | per column

Each candidate is replayed from a CUDA graph of one call, the L2 flushed before each replay, two rounds
interleaved, the lower round median kept.

    PYTHONPATH=. python tools/block_scale_ab.py [models] [decode batches] [prefill batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 8,64,256,512 4096,16384   (records results/<device>/block-scale-ab.json)
"""
import sys

import torch

from moe_kernels.bench.ceilings import ReadFloor, measure_fp8_gemm_rate
from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels.config import GemmTiles, MoEConfig
from moe_kernels.kernels.contiguous_gemm import grouped_gemm_contiguous
from moe_kernels.kernels.formats import FORMATS, WeightFormat
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import _permute_scales, permute
from moe_kernels.results import print_timings, record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
decode = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8, 64, 256, 512]
prefill = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [4096, 16384]
BLOCK = FORMATS["block"]
ALIGN = 128 if device == "cuda" else 32


def tiles(n, k, warps, stages, persistent=1):
    return GemmTiles(block_n=n, block_k=k, group_m=8, num_warps=warps, num_stages=stages, tma=True,
                     persistent=persistent)


GEMM1 = {"n64 k128 w8 s4": tiles(64, 128, 8, 4), "n64 k128 w8 s4 grid": tiles(64, 128, 8, 4, 0),
         "n128 k128 w8 s3": tiles(128, 128, 8, 3)}
# (A 256-column tile spans two scale blocks and loads a scale per column either way: the run at dcd49e9 timed
# one, under both names, as a check of the A/B's noise.)
GEMM2 = {"n128 k128 w8 s4": tiles(128, 128, 8, 4), "n128 k128 w8 s4 grid": tiles(128, 128, 8, 4, 0)}
if device == "cpu":
    GEMM1 = GEMM2 = {"n32 k32": tiles(32, 32, 4, 2)}

floor = ReadFloor(device)
fp8_rate = measure_fp8_gemm_rate() if device == "cuda" else None
rows = []
_scale_arguments = WeightFormat.scale_arguments


def per_column(call):
    """``call`` with every block-scaled GEMM it launches loading a scale per column (code 4)."""
    def patched(self, *args):
        out = _scale_arguments(self, *args)
        return out[:6] + ((4 if out[6] == 1 else out[6]),) + out[7:]

    def run():
        WeightFormat.scale_arguments = patched
        try:
            return call()
        finally:   # (a class attribute: the other candidates and the reference must not see it)
            WeightFormat.scale_arguments = _scale_arguments
    return run


def scale_variants(gemm, tiles, make, like):
    """``gemm``'s candidates: each of ``tiles`` with one weight scale per tile and step, and with a
    scale per column (``make(tiles, out)`` gives the call; each candidate its own output like ``like``)."""
    out = {}
    for n, t in tiles.items():
        out[f"{gemm} {n} one scale"] = make(t, torch.zeros_like(like))
        out[f"{gemm} {n} per column"] = per_column(make(t, torch.zeros_like(like)))
    return out


def save():
    return record_tool("block-scale-ab", rows, {"models": models, "decode": decode, "prefill": prefill,
                                                "read_bandwidth": floor.bandwidth, "fp8_gemm_rate": fp8_rate,
                                                "align": ALIGN})


def timed(candidates, reference, unchecked=()):
    return time_lowest(candidates, reference, tolerance=0.02, warmup_ms=2, rep_ms=30, unchecked=unchecked)


for key in models:
    model, dtype, w1, w1s, w2, w2s = tool_weights(key, BLOCK, device)
    _, _, b1, _, b2, _ = tool_weights(key, FORMATS["none"], device)
    e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    for batch in decode:
        x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)

        def fp8():
            return fused_experts(x, w1, w2, weights, ids, validate_ids=False, w1_scale=w1s, w2_scale=w2s)

        candidates = {"one scale": fp8, "per column": per_column(fp8),
                      "bf16 table": lambda: fused_experts(x, b1, b2, weights, ids, validate_ids=False)}
        us, rounds, errors, rel = timed(candidates, fp8().float(), unchecked=("bf16 table",))
        row = {"model": key, "stage": "decode", "batch": batch, **floor.of_experts(ids, w1, w1s, w2, w2s), "us": us,
               "rounds_us": rounds, "rel_err": rel, "errors": errors}
        rows.append(row)
        save()
        print(f"{key} decode {batch}: fp8 floor {row['floor_us']:.1f} us, "
              + ", ".join(f"{n} {t:.1f} ({t / row['floor_us']:.2f}x)" for n, t in us.items()), errors or "",
              flush=True)
    del b1, b2
    for batch in prefill:
        x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
        xq, x_scale = BLOCK.quantize_activations(x)
        permuted = permute(xq, ids, e, align=ALIGN, validate_ids=False)
        rows_scale = _permute_scales(x_scale, permuted, k)
        num_rows = permuted.rows.shape[0]
        common = dict(align=ALIGN, out_dtype=dtype, rows_used=permuted.rows_used)
        h = torch.zeros(num_rows, f, device=device, dtype=dtype)

        def gemm1(t, out):
            return lambda: grouped_gemm_contiguous(permuted.rows, w1, permuted.m_indices, silu_mul=True, out=out,
                                                   config=MoEConfig(ALIGN, t, t), which="gate_up", x_scale=rows_scale,
                                                   w_scale=w1s, **common)

        g1 = scale_variants("gemm1", GEMM1, gemm1, h)
        gemm1(next(iter(GEMM1.values())), h)()
        us1, rounds1, err1, rel1 = timed(g1, h.float())
        a, a_scale = BLOCK.quantize_activations(h)
        y = torch.zeros(num_rows, d, device=device, dtype=dtype)

        def gemm2(t, out):
            return lambda: grouped_gemm_contiguous(a, w2, permuted.m_indices, out=out, config=MoEConfig(ALIGN, t, t),
                                                   which="down", x_scale=a_scale, w_scale=w2s, **common)

        g2 = scale_variants("gemm2", GEMM2, gemm2, y)
        gemm2(next(iter(GEMM2.values())), y)()
        us2, rounds2, err2, rel2 = timed(g2, y.float())
        flops1, flops2 = 2 * batch * k * d * 2 * f, 2 * batch * k * f * d
        tflops = {**{n: flops1 / t / 1e6 for n, t in us1.items()}, **{n: flops2 / t / 1e6 for n, t in us2.items()}}
        row = {"model": key, "stage": "prefill", "batch": batch, "rows_used": int(permuted.rows_used.item()),
               "us": {**us1, **us2}, "tflops": tflops, "rounds_us": {**rounds1, **rounds2},
               "errors": {**err1, **err2}, "rel_err": {**rel1, **rel2}}
        rows.append(row)
        save()
        print_timings(f"{key} prefill {batch}:", row["us"], tflops, row["errors"])
        del x, xq, permuted, h, a, y, g1, g2
        if device == "cuda":
            torch.cuda.empty_cache()
    del w1, w2

print(f"recorded {save()}")
