"""Prefill A/B (issue 18): the permute layout's two grouped GEMMs alone, tile by tile, against cuBLAS on
balanced groups, and the stages around them, bf16 and fp8 block, with the GEMM rates measured in the
same process.

Earlier prefill records timed the whole experts call (permute, GEMMs, unpermute), so they could not say
how far the GEMMs themselves are from the balanced ``torch.bmm`` that issue 18 measures them against.
Here each GEMM runs alone on real routing (random logits' top-k, segments aligned to 128 rows), on the
packed rows ``permute`` made once (its padding rows zeroed), into one output buffer a shape that the candidates
share, zeroed before each candidate's checked call (so a candidate that writes nothing fails the check; padding
rows stay zero, or a zero row's product, and the check compares like with like). Candidates:

  m128 / m64 gemm1 / gemm2 <tiles>   grouped_gemm_contiguous with those tiles (TMA on both operands) on
                          segments aligned to 128 or to 64 rows (M tiles of that height: a 64-row tile pads
                          a segment's last tile less), rows_used read on the device; "flat": the tile loop
                          and the K loop flattened into one pipeline (persistent=2; "grid": one program per
                          tile; "g1": GROUP_M 1); "no promotion": fp8
                          weights with one scale per row and per expert after the loop (the tensor format),
                          the block-scale K loop's upper bound; "gathered": GEMM 1 reading each row from
                          its token through the permutation (MoEConfig.gather_rows: no copy in, pointer
                          loads for the rows), on the first two tiles not flattened; "short": a segment's last
                          tile with at most half its rows real on a half-height tile, in a second launch
                          (MoEConfig.short_last_tile), on the same tiles of the 128-row segments
  m128 gemm1 / gemm2 gluon <tiles>   bf16 only, on an sm_90 GPU with Triton 3.6: the persistent Gluon kernel
                          (kernels/gluon_bf16.py) on the 128-row segments, n = weight rows a tile (gated: half gate,
                          half up), s = TMA stages, "tma": GEMM 2 storing whole tiles by TMA, "half": half tiles,
                          g = M tiles a weight tile visits in turn (default 8), x2 = two programs an SM
  ... balanced            bf16: the first Triton tile and the Gluon rows on balanced routing (each expert T k / E
                          rows: no padding, no ragged segment; not checked against the routed reference)
  bmm1 / bmm2             torch.bmm on ceil(T k / E) rows per expert, the same FLOPs (bf16 only)
  permute, permute indices only, quantize, unpermute, permute scales   the stages around the GEMMs
  experts permute (gathered, short) / index-gather   the whole experts call, permute with the best GEMM
                          tiles of this run (and GEMM 1 reading through the permutation; the short last tiles)
                          against fused_experts with its table (the align of the faster pair); "experts permute
                          gluon": bf16 on the Gluon kernel with permute_gluon.BF16_TILES (128-row segments)

Each candidate is replayed from a CUDA graph of one call, the L2 flushed before each replay, two rounds
interleaved, the lower round median kept. TFLOP/s count the routed rows' FLOPs (2 T k d 2F for GEMM 1,
2 T k F d for GEMM 2).

    PYTHONPATH=. python tools/prefill_gemm_ab.py [models] [batches] [formats] [record name]
    # e.g. qwen3-30b-a3b,deepseek-v3 4096,16384 none,block prefill-gemm-ab-gathered
    #   PREFILL_AB_TILES=3 PREFILL_AB_ALIGNS=128: each table's first three tiles, 128-row segments only
    #   PREFILL_AB_GEMMS_ONLY=1: the GEMMs on copied rows and bmm only
    #   (records results/<device>/<record name>.json; default prefill-gemm-ab)
"""
import dataclasses
import os
import sys

import torch

from moe_kernels.bench.ceilings import measure_fp8_gemm_rate, measure_gemm_rate
from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels.combine import unpermute
from moe_kernels.kernels.config import GemmTiles, MoEConfig
from moe_kernels.kernels.contiguous_gemm import grouped_gemm_contiguous
from moe_kernels.kernels.formats import FORMATS, FP8_TENSOR
from moe_kernels.kernels.gluon_block_fp8 import available as gluon_available
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.kernels.permute import _permute_scales, permute, permute_experts
from moe_kernels.results import print_timings, record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
RECORD = sys.argv[4] if len(sys.argv) > 4 else "prefill-gemm-ab"
ALIGN = 128
# bf16 on the persistent Gluon kernel (an sm_90 GPU, Triton 3.6): name -> bf16_grouped's settings
# (session 33's first run, prefill-gemm-ab-gluon-bf16.json, also had GEMM 1 on n256 s4, n128 s4 and n256 s3 half,
# GEMM 2 on n256 s4 and n128 s4 tma: slower than the n256 s3 rows at 16,384 tokens; at 4,096 n256 s4 and half were
# faster on Qwen3, with GEMM 1 then on two accumulators)
GLUON1 = {"n256 s3": dict(block_n=256, stages=3), "n256 s3 tma": dict(block_n=256, stages=3, tma_store=True),
          "n256 s4 tma": dict(block_n=256, stages=4, tma_store=True),
          "n256 s3 tma half": dict(block_n=256, stages=3, tma_store=True, half_tiles=True),
          **{f"n256 s3 tma g{g}": dict(block_n=256, stages=3, tma_store=True, group_m=g) for g in (1, 4, 16)},
          "n128 s2 tma x2": dict(block_n=128, stages=2, tma_store=True, per_sm=2)}
GLUON2 = {"n256 s3 tma": dict(block_n=256, stages=3, tma_store=True),
          "n256 s3 tma half": dict(block_n=256, stages=3, tma_store=True, half_tiles=True),
          **{f"n256 s3 tma g{g}": dict(block_n=256, stages=3, tma_store=True, group_m=g) for g in (1, 4, 16)},
          "n128 s2 tma x2": dict(block_n=128, stages=2, tma_store=True, per_sm=2)}
GLUON = device == "cuda" and gluon_available(device) is None


def gluon_bf16(*args, per_sm=1, **settings):
    """bf16_grouped with ``per_sm`` programs an SM ("x2": two programs share an SM where their shared memory fits,
    so that one's epilogue runs under the other's MMAs; read at the launch, so at the graph's capture)."""
    from moe_kernels.kernels import _gluon_block_fp8_persistent as persistent
    from moe_kernels.kernels.gluon_bf16 import bf16_grouped

    before = persistent.PROGRAMS
    persistent.PROGRAMS = per_sm * torch.cuda.get_device_properties(0).multi_processor_count if per_sm > 1 else before
    try:
        return bf16_grouped(*args, **settings)
    finally:
        persistent.PROGRAMS = before


def tiles(n, k, warps, stages, group_m=8, persistent=1):
    return GemmTiles(block_n=n, block_k=k, group_m=group_m, num_warps=warps, num_stages=stages, tma=True,
                     persistent=persistent)


# name -> tiles; GEMM 1's block_n counts output columns (it loads 2 x block_n weight rows: gate and up)
# (Each table's third tile is its first on the flattened persistent loop, so that PREFILL_AB_TILES=3 times it beside
# the two tiles the gathered rows and the short last tiles run on: until Session 25 persistent=2 compiled exactly
# like persistent=1.)
GEMM1 = {
    "none": {"n128 k64 w8 s3": tiles(128, 64, 8, 3), "n128 k64 w8 s3 g1": tiles(128, 64, 8, 3, 1),
             "n128 k64 w8 s3 flat": tiles(128, 64, 8, 3, persistent=2), "n128 k64 w8 s4": tiles(128, 64, 8, 4),
             "n64 k64 w4 s4": tiles(64, 64, 4, 4), "n64 k64 w8 s4": tiles(64, 64, 8, 4),
             "n128 k64 w8 s3 grid": tiles(128, 64, 8, 3, persistent=0)},
    "block": {"n64 k128 w8 s4": tiles(64, 128, 8, 4), "n64 k128 w8 s3": tiles(64, 128, 8, 3),
              "n64 k128 w8 s4 flat": tiles(64, 128, 8, 4, persistent=2), "n128 k128 w8 s3": tiles(128, 128, 8, 3),
              "n64 k128 w4 s4": tiles(64, 128, 4, 4), "n64 k128 w8 s4 g1": tiles(64, 128, 8, 4, 1),
              "n64 k128 w8 s4 grid": tiles(64, 128, 8, 4, persistent=0)},
}
GEMM2 = {
    "none": {"n256 k64 w8 s3": tiles(256, 64, 8, 3), "n256 k64 w8 s3 g1": tiles(256, 64, 8, 3, 1),
             "n256 k64 w8 s3 flat": tiles(256, 64, 8, 3, persistent=2), "n128 k64 w8 s4": tiles(128, 64, 8, 4),
             "n128 k64 w4 s4": tiles(128, 64, 4, 4), "n256 k64 w8 s3 grid": tiles(256, 64, 8, 3, persistent=0)},
    "block": {"n128 k128 w8 s4": tiles(128, 128, 8, 4), "n128 k128 w8 s3": tiles(128, 128, 8, 3),
              "n128 k128 w8 s4 flat": tiles(128, 128, 8, 4, persistent=2), "n256 k128 w8 s3": tiles(256, 128, 8, 3),
              "n128 k128 w4 s4": tiles(128, 128, 4, 4), "n128 k128 w8 s4 g1": tiles(128, 128, 8, 4, 1),
              "n128 k128 w8 s4 grid": tiles(128, 128, 8, 4, persistent=0)},
}
# 64-row M tiles on segments aligned to 64 rows: less padding (a segment's last tile), smaller MMAs
GEMM1_M64 = {
    "none": {"n128 k64 w4 s4": tiles(128, 64, 4, 4), "n128 k64 w4 s3": tiles(128, 64, 4, 3),
             "n128 k64 w8 s4": tiles(128, 64, 8, 4), "n64 k64 w4 s4": tiles(64, 64, 4, 4)},
    "block": {"n128 k128 w4 s4": tiles(128, 128, 4, 4), "n64 k128 w4 s4": tiles(64, 128, 4, 4),
              "n128 k128 w8 s3": tiles(128, 128, 8, 3)},
}
GEMM2_M64 = {
    "none": {"n256 k64 w4 s4": tiles(256, 64, 4, 4), "n256 k64 w8 s3": tiles(256, 64, 8, 3),
             "n128 k64 w4 s4": tiles(128, 64, 4, 4)},
    "block": {"n256 k128 w4 s4": tiles(256, 128, 4, 4), "n128 k128 w4 s4": tiles(128, 128, 4, 4),
              "n256 k128 w8 s3": tiles(256, 128, 8, 3)},
}
if device == "cpu":   # (the interpreter: two small tiles each, to check the script)
    GEMM1 = GEMM1_M64 = {f: {"n32 k32": tiles(32, 32, 4, 2), "n32 k32 grid": tiles(32, 32, 4, 2, persistent=0)}
                         for f in GEMM1}
    GEMM2 = GEMM2_M64 = {f: {"n32 k32": tiles(32, 32, 4, 2), "n32 k32 flat": tiles(32, 32, 4, 2, persistent=2)}
                         for f in GEMM2}
LAYOUTS = {f: {ALIGN: (GEMM1[f], GEMM2[f]), 64: (GEMM1_M64[f], GEMM2_M64[f])} for f in GEMM1}


def unflattened(tiles: dict) -> list:
    """The first two of ``tiles`` not on the flattened loop: the gathered rows and the short last tiles are timed
    on these (short last tiles never flatten: their launches skip tiles by a test around the K loop)."""
    return [(n, t) for n, t in tiles.items() if t.persistent != 2][:2]


# A shorter run: PREFILL_AB_TILES=n keeps each table's first n tiles, PREFILL_AB_ALIGNS=128 the 128-row segments only.
if os.environ.get("PREFILL_AB_TILES"):
    keep = int(os.environ["PREFILL_AB_TILES"])
    LAYOUTS = {f: {a: tuple(dict(list(c.items())[:keep]) for c in pair) for a, pair in by.items()}
               for f, by in LAYOUTS.items()}
# PREFILL_AB_GEMMS_ONLY=1: the GEMMs on copied rows and bmm only (no gathered rows, no short last tiles, no stages,
# no whole experts calls)
GEMMS_ONLY = os.environ.get("PREFILL_AB_GEMMS_ONLY") == "1"
if os.environ.get("PREFILL_AB_ALIGNS"):
    aligns = [int(a) for a in os.environ["PREFILL_AB_ALIGNS"].split(",")]
    if not set(aligns) <= {ALIGN, 64}:
        sys.exit(f"PREFILL_AB_ALIGNS must list 128 and/or 64, got {os.environ['PREFILL_AB_ALIGNS']!r}")
    LAYOUTS = {f: {a: pair for a, pair in by.items() if a in aligns} for f, by in LAYOUTS.items()}

rates = ({"bf16": measure_gemm_rate(), "fp8": measure_fp8_gemm_rate()} if device == "cuda"
         else {"bf16": None, "fp8": None})
print("GEMM rates (TFLOP/s):", {n: round(r / 1e12) for n, r in rates.items() if r}, flush=True)
rows = []


def save():
    return record_tool(RECORD, rows, {
        "models": models, "batches": batches, "formats": formats, "aligns": sorted(LAYOUTS[formats[0]]),
        "gemm_rates": rates,
        "tiles": {f: {a: [{n: dataclasses.asdict(t) for n, t in c.items()} for c in pair] for a, pair in by.items()}
                  for f, by in LAYOUTS.items()}})


def zeroed_first(out, call):
    """``call`` with ``out`` zeroed before its first run, the checked one (not before its graph's warm-up, capture or
    replays): the candidates share ``out``, and one that wrote nothing would otherwise pass on another's rows."""
    first = [True]

    def run():
        if first[0]:
            first[0] = False
            out.zero_()
        return call()
    return run


def timed(candidates, reference, unchecked=()):
    return time_lowest(candidates, reference, tolerance=0.02, warmup_ms=5, rep_ms=40, unchecked=unchecked)


def balanced(e, rows, k_dim, n_dim, dtype):
    a = torch.randn(e, rows, k_dim, device=device, dtype=dtype)
    b = torch.randn(e, k_dim, n_dim, device=device, dtype=dtype).mul_(k_dim**-0.5)   # (in place: 15 GB at DS-V3)
    return lambda: torch.bmm(a, b)



def gemm_pair(align, tiles1, tiles2, x, xq, x_scale, ids, w1, w1s, w2, w2s, fmt, model, batch, dtype):
    """Both GEMMs on segments aligned to ``align`` rows (the M tile), each tile candidate alone."""
    e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    fp8 = fmt.quantized
    permuted = permute(xq, ids, e, align=align, validate_ids=False)
    # Padding rows zeroed (permute leaves them unwritten): a TMA-store epilogue writes their products, which are then
    # zero like the rows the reference leaves unwritten in the shared output buffers.
    permuted.rows.view(torch.uint8)[permuted.m_indices < 0] = 0
    rows_scale = _permute_scales(x_scale, permuted, k) if fp8 else None
    m_idx, used = permuted.m_indices, permuted.rows_used
    num_rows = permuted.rows.shape[0]
    tag = f"m{align} "

    def no_promotion(w):   # fp8 weights in the tensor format: one scale per row and per expert, after the loop
        return dict(x_scale=torch.ones(num_rows, device=device),
                    w_scale=torch.ones(FP8_TENSOR.scale_shape(*w.shape), device=device))

    # One output buffer a shape, shared by the candidates (each is compared right after its call; padding rows
    # are zero or a padding row's product, the same for all): at DeepSeek-V3 16,384 tokens a buffer each ran the
    # H100 out of memory.
    out1, out2 = (torch.zeros(num_rows, n, device=device, dtype=dtype) for n in (f, d))

    def gemm1(t, nopromo=False, short=False):
        out = out1
        scales = no_promotion(w1) if nopromo else dict(x_scale=rows_scale, w_scale=w1s)
        config = MoEConfig(align, t, t, short_last_tile=short)
        return lambda: grouped_gemm_contiguous(permuted.rows, w1, m_idx, align=align, silu_mul=True,
                                               config=config, which="gate_up", out=out,
                                               out_dtype=dtype, rows_used=used, **scales)

    def gathered(t):   # GEMM 1 reading each row from its token (MoEConfig.gather_rows): no copy in
        out = out1
        return lambda: grouped_gemm_contiguous(xq, w1, m_idx, align=align, silu_mul=True, config=MoEConfig(align, t, t),
                                               which="gate_up", out=out, out_dtype=dtype, rows_used=used,
                                               x_scale=x_scale, w_scale=w1s, gather_from=permuted)

    g1 = {f"{tag}gemm1 {n}": gemm1(t) for n, t in tiles1.items()}
    # Balanced routing (bf16, 128-row segments): every expert exactly T k / E rows, so no padding and no ragged
    # segment; the kernels on these rows against bmm say how much of the gap to bmm is the kernel's own.
    even = None
    if not fp8 and align == ALIGN and batch * k % e == 0 and (batch * k // e) % align == 0:
        token_ids = torch.arange(batch, device=device)[:, None] * k + torch.arange(k, device=device)[None, :]
        even = permute(xq, (token_ids % e).to(ids.dtype), e, align=align, validate_ids=False)
        even_h = torch.randn(even.rows.shape[0], f, device=device, dtype=dtype)
        even1, even2 = (torch.zeros(even.rows.shape[0], n, device=device, dtype=dtype) for n in (f, d))
        first1 = next(iter(tiles1.values()))
        g1[f"{tag}gemm1 {next(iter(tiles1))} balanced"] = (
            lambda o=even1: grouped_gemm_contiguous(
                even.rows, w1, even.m_indices, align=align, silu_mul=True, config=MoEConfig(align, first1, first1),
                which="gate_up", out=o, out_dtype=dtype, rows_used=even.rows_used))
    for n, t in ([] if GEMMS_ONLY else unflattened(tiles1)):
        g1[f"{tag}gemm1 {n} gathered"] = gathered(t)
        if align == ALIGN:
            g1[f"{tag}gemm1 {n} short"] = gemm1(t, short=True)
    if fp8:
        g1[f"{tag}gemm1 no promotion"] = gemm1(next(iter(tiles1.values())), nopromo=True)
    elif align == ALIGN:
        g1["bmm1"] = balanced(e, -(-batch * k // e), d, 2 * f, dtype)
        if GLUON:
            for n, settings in GLUON1.items():
                if f % (settings["block_n"] // 2):   # (a tile's output columns must divide F)
                    continue
                g1[f"{tag}gemm1 gluon {n}"] = (lambda s=settings, o=out1:
                                               gluon_bf16(permuted.rows, w1, m_idx, used, gated=True, out=o,
                                                          validate_ids=False, **s))
                if even is not None and "half" not in n:
                    g1[f"{tag}gemm1 gluon {n} balanced"] = (
                        lambda s=settings, o=even1:
                        gluon_bf16(even.rows, w1, even.m_indices, even.rows_used, gated=True, out=o,
                                   validate_ids=False, **s))
    h = next(iter(g1.values()))().clone()   # (its own copy: the candidates share the output buffer)
    g1 = {n: c if n == "bmm1" else zeroed_first(even1 if n.endswith("balanced") else out1, c) for n, c in g1.items()}
    us1, rounds1, err1, rel1 = timed(g1, h.float(), unchecked=(f"{tag}gemm1 no promotion", "bmm1",
                                                               *(n for n in g1 if n.endswith("balanced"))))
    del g1   # (bmm1's operands: 17 GB at DeepSeek-V3 16,384 tokens)
    if device == "cuda":
        torch.cuda.empty_cache()
    a, a_scale = fmt.quantize_activations(h)

    def gemm2(t, nopromo=False, short=False):
        out = out2
        scales = no_promotion(w2) if nopromo else dict(x_scale=a_scale, w_scale=w2s)
        config = MoEConfig(align, t, t, short_last_tile=short)
        return lambda: grouped_gemm_contiguous(a, w2, m_idx, align=align, config=config,
                                               which="down", out=out, out_dtype=dtype, rows_used=used, **scales)

    g2 = {f"{tag}gemm2 {n}": gemm2(t) for n, t in tiles2.items()}
    if even is not None:
        first2 = next(iter(tiles2.values()))
        g2[f"{tag}gemm2 {next(iter(tiles2))} balanced"] = (
            lambda o=even2: grouped_gemm_contiguous(
                even_h, w2, even.m_indices, align=align, config=MoEConfig(align, first2, first2), which="down",
                out=o, out_dtype=dtype, rows_used=even.rows_used))
    if align == ALIGN and not GEMMS_ONLY:
        for n, t in unflattened(tiles2):
            g2[f"{tag}gemm2 {n} short"] = gemm2(t, short=True)
    if fp8:
        g2[f"{tag}gemm2 no promotion"] = gemm2(next(iter(tiles2.values())), nopromo=True)
    elif align == ALIGN:
        g2["bmm2"] = balanced(e, -(-batch * k // e), f, d, dtype)
        if GLUON:
            for n, settings in GLUON2.items():
                if d % settings["block_n"]:
                    continue
                g2[f"{tag}gemm2 gluon {n}"] = (lambda s=settings, o=out2:
                                               gluon_bf16(a, w2, m_idx, used, out=o, validate_ids=False, **s))
                if even is not None and "half" not in n:
                    g2[f"{tag}gemm2 gluon {n} balanced"] = (
                        lambda s=settings, o=even2:
                        gluon_bf16(even_h, w2, even.m_indices, even.rows_used, out=o, validate_ids=False, **s))
    y = next(iter(g2.values()))().clone()
    g2 = {n: c if n == "bmm2" else zeroed_first(even2 if n.endswith("balanced") else out2, c) for n, c in g2.items()}
    us2, rounds2, err2, rel2 = timed(g2, y.float(), unchecked=(f"{tag}gemm2 no promotion", "bmm2",
                                                               *(n for n in g2 if n.endswith("balanced"))))
    del g2
    tiled1 = {n: us1[n] for n in us1 if n[len(tag) + 6:] in tiles1 and n.startswith(tag)}   # (copied rows)
    tiled2 = {n: us2[n] for n in us2 if n[len(tag) + 6:] in tiles2 and n.startswith(tag)}
    if not tiled1 or not tiled2:   # (say why, rather than fail on an empty min below)
        raise RuntimeError(f"{model.name} {batch}: no Triton GEMM tile ran: {err1} {err2}")
    best1, best2 = min(tiled1, key=tiled1.get), min(tiled2, key=tiled2.get)
    return {"timings": (us1, rounds1, err1, rel1, us2, rounds2, err2, rel2), "best_names": (best1, best2),
            "best": MoEConfig(align, tiles1[best1[len(tag) + 6:]], tiles2[best2[len(tag) + 6:]]),
            "best_us": us1[best1] + us2[best2], "permuted": permuted, "h": h, "y": y,
            "rows_used": int(used.item()),
            # the rows the short last tiles multiply: each segment's rows rounded up to half a tile
            # (of this align's tile: "experts permute short" runs the best align's)
            "rows_short": int(((permuted.segment_counts + align // 2 - 1) // (align // 2) * (align // 2)).sum())}


for fname in formats:
    fmt = FORMATS[fname]
    fp8 = fmt.quantized
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
        for batch in batches:
            x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
            xq, x_scale = fmt.quantize_activations(x)
            found = {}
            for align, (tiles1, tiles2) in LAYOUTS[fname].items():
                found[align] = gemm_pair(align, tiles1, tiles2, x, xq, x_scale, ids, w1, w1s, w2, w2s, fmt, model,
                                         batch, dtype)
            us1, rounds1, err1, rel1, us2, rounds2, err2, rel2 = ({}, {}, {}, {}, {}, {}, {}, {})
            for got in found.values():
                for mine, theirs in zip((us1, rounds1, err1, rel1, us2, rounds2, err2, rel2), got["timings"]):
                    mine.update(theirs)
            # The whole experts call on the permute layout with the fastest pair of this run.
            best_align = min(found, key=lambda a: found[a]["best_us"])
            best, permuted, h, y = (found[best_align][n] for n in ("best", "permuted", "h", "y"))
            best1, best2 = found[best_align]["best_names"]
            scales = dict(w1_scale=w1s, w2_scale=w2s)
            stages = {} if GEMMS_ONLY else {
                "permute": lambda: permute(xq, ids, e, align=best_align, validate_ids=False, out=permuted.rows),
                "unpermute": lambda: unpermute(y, permuted.src2dst, weights),
                "permute indices only": lambda: permute(xq, ids, e, align=best_align, validate_ids=False, copy=False),
                "experts permute": lambda: permute_experts(x, w1, w2, weights, ids, config=best, align=best_align,
                                                           validate_ids=False, **scales),
                "experts permute short": lambda: permute_experts(
                    x, w1, w2, weights, ids, config=dataclasses.replace(best, short_last_tile=True), align=best_align,
                    validate_ids=False, **scales),
                "experts permute gathered": lambda: permute_experts(
                    x, w1, w2, weights, ids, config=dataclasses.replace(best, gather_rows=True), align=best_align,
                    validate_ids=False, **scales),
                "experts index-gather": lambda: fused_experts(x, w1, w2, weights, ids, validate_ids=False, **scales),
            }
            if GLUON and not fp8 and not GEMMS_ONLY:
                stages["experts permute gluon"] = lambda: permute_experts(x, w1, w2, weights, ids, align=ALIGN,
                                                                          validate_ids=False, gemm="gluon")
            if fp8 and not GEMMS_ONLY:
                stages["quantize x"] = lambda: fmt.quantize_activations(x)[0]
                stages["quantize h"] = lambda: fmt.quantize_activations(h)[0]
                stages["permute scales"] = lambda: _permute_scales(x_scale, permuted, k)
            if stages:
                whole = stages["experts index-gather"]().float()
                us3, rounds3, err3, rel3 = timed(stages, whole,
                                                 unchecked=tuple(n for n in stages if "experts" not in n))
            else:
                us3, rounds3, err3, rel3 = {}, {}, {}, {}
            flops1, flops2 = 2 * batch * k * d * 2 * f, 2 * batch * k * f * d
            tflops = {**{n: flops1 / t / 1e6 for n, t in us1.items()}, **{n: flops2 / t / 1e6 for n, t in us2.items()},
                      **{n: (flops1 + flops2) / us3[n] / 1e6 for n in us3 if "experts" in n}}
            row = {"model": key, "format": fname, "batch": batch, "align": best_align,
                   "rows_used": {a: got["rows_used"] for a, got in found.items()},
                   "rows_short": {a: got["rows_short"] for a, got in found.items()},
                   "rows_real": batch * k, "us": {**us1, **us2, **us3}, "tflops": tflops,
                   "rounds_us": {**rounds1, **rounds2, **rounds3}, "errors": {**err1, **err2, **err3},
                   "rel_err": {**rel1, **rel2, **rel3}, "best": [best1, best2]}
            rows.append(row)
            save()
            print_timings(f"{key} {fname} {batch}: rows {row['rows_used']} of {row['rows_real']}", row["us"], tflops,
                          row["errors"])
            del x, xq, weights, ids, permuted, h, y, stages, found
            if device == "cuda":
                torch.cuda.empty_cache()
        del w1, w2

print(f"recorded {save()}")
