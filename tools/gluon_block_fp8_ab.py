"""Block-fp8 promotion overlap A/B (Gluon, Hopper): the permute layout's grouped GEMM with each K step's
promotion overlapped with the next step's MMA, against the same kernel promoting in order and the
package's Triton path, with the dense fp8 rate measured in the same process.

A block-fp8 K step (DeepSeek-V3's format: one float32 scale per row per 128 columns of K for the
activations, one per 128 x 128 block for the weights) multiplies its 128-deep product by the rows' and
the block's scales before adding it to the accumulator (the "promotion"). Triton 3.6 waits for every
such product (``wgmma.wait_group 0``) before promoting it, so the tensor cores idle while the CUDA cores
promote: 18-23% of the prefill GEMMs' rate on an H200. Triton's pipeliner keeps a dot asynchronous only
when its result feeds another dot's accumulator, so no reordering in Triton avoids it. Gluon
(``triton.experimental.gluon``, Triton 3.6's API) exposes the wgmma waits: here step s+1's MMA is issued
before step s is promoted and the wait leaves one MMA outstanding (``wait_group 1``), so the promotion
runs under the next MMA (what DeepGEMM does in CUDA). Candidates, on each GEMM alone:

  gluon overlap      the Gluon kernel, promotion of step s after issuing step s+1 (wait_group 1)
  gluon in order     the same kernel, wait_group 0 after each MMA, then its promotion (the A/B's control)
  gluon persistent   the overlapped kernel on a persistent grid (one program per SM walks its tiles, the TMA
                     loads running ahead across tiles, so that a tile's first steps land while the tile before
                     it stores): the 128-column tile takes 240 registers a thread, one program an SM, and with
                     one program per tile its first loads and its epilogue overlap nothing. GEMM 2's K loops are
                     short (Qwen3-30B-A3B's 6 steps ran at 612 TFLOP/s where GEMM 1's 16 ran at 885). (Session 27
                     timed a 64-column variant, two programs an SM: 3-31% slower than the 128-column tile.)
  gluon persistent s3  the same with three stages
  gluon persistent half  the persistent grid with half tiles: a segment's last tile with at most 64 real rows
                     multiplies 64 rows (half the MMAs; uniform routing leaves about half the segments so)
  gluon persistent tma store  the persistent grid storing each whole tile by one asynchronous TMA copy, under the
                     next tile's MMAs (the layer uses it for GEMM 2; here both shapes run as plain GEMMs; its
                     padding rows are written too, so its check is on the real rows)
  gluon overlap half  one program per tile with half tiles (session 29's H100 run: the persistent grid lost
                     23% and 12% to one program per tile, and half tiles gained it 5% and 3%)
  triton             grouped_gemm_contiguous, n128 k128 w8 s4, TMA, persistent (the package's path)
  triton flat        the same with its tile and K loops flattened into one pipeline (persistent=2)

on DeepSeek-V3's (GEMM 1: N 4096 (gate and up, no SiLU here), K 7168; GEMM 2: N 7168, K 2048; 256 experts)
and Qwen3-30B-A3B's shapes (GEMM 1: N 1536, K 2048; GEMM 2: N 2048, K 768; 128 experts), T tokens with
top-8 routing: T * 8 rows, each given a uniformly random expert, segments rounded up to 128 rows, and one
128-row tile of padding at the end (a tile of padding writes nothing). Each output is checked against
``block_fp8_grouped_reference`` (the dequantised operands' float32 product, rounded to bf16; relative
Frobenius error <= 1e-2 over the written rows; the rest stay zero in both), then replayed from a CUDA graph of one call, the L2 flushed before each
replay, two rounds in alternating order, the lower round median kept. TFLOP/s count the routed rows
(2 T k N K); the dense fp8 ``torch._scaled_mm`` rate is the ceiling.

    PYTHONPATH=. python tools/gluon_block_fp8_ab.py [models] [batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 4096,16384   (records results/<device>/gluon-block-fp8-ab.json)
    PYTHONPATH=/tmp/t36 python tools/gluon_block_fp8_ab.py --compile-only
    # no GPU needed: both variants compiled for sm_90a (8 warps, 4 stages, BLOCK_N 128 and 64); prints the
    # wgmma count, the wait_group values in order, and ptxas's registers and spills

Needs Triton 3.6 (its Gluon API; later versions changed it).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import sys

import torch
import triton

if "--compile-only" in sys.argv[1:]:   # build compiled (not interpreted) kernels here; nothing is launched
    torch.cuda.is_available = lambda: True
from moe_kernels.kernels._gluon_block_fp8_kernel import GROUP_M, TILE_K, TILE_M, compile_for_sm90   # noqa: E402
from moe_kernels.kernels.gluon_block_fp8 import block_fp8_grouped, block_fp8_grouped_reference   # noqa: E402


def ptx_report(ptx):
    """(number of wgmma.mma_async, the wait_group values in the order they appear in the PTX)."""
    return (len(re.findall(r"wgmma\.mma_async", ptx)),
            [int(v) for v in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)])


def ptxas_report(ptx):
    """ptxas -v for sm_90a: (registers, spill store bytes, spill load bytes, its warnings about wgmma)."""
    from moe_kernels.sm90_compile import assemble_for_sm90

    built = assemble_for_sm90(ptx)
    warnings = [line.strip() for line in built["log"].splitlines() if "wgmma" in line.lower()]
    return built["registers"], built["spill_stores"], built["spill_loads"], warnings


def compile_only():
    print(f"triton {triton.__version__}, sm_90a builds, {TILE_M} x block_n x {TILE_K} tiles", flush=True)
    for gated in (False, True):   # (gated: GEMM 1 with SiLU·mul in its epilogue, the permute layout's fp8 path)
        for block_n in (128, 64):
            for overlap in (True, False):
                compiled_one(gated, block_n, overlap)
        compiled_one(gated, 128, True, half=True)   # (one program a tile, with half tiles)
        for half in (False, True):   # (half tiles: a segment's last tile of <= 64 real rows on 64 rows)
            compiled_one(gated, 128, True, persistent=True, half=half)
    for half in (False, True):   # (GEMM 2 storing whole tiles by TMA)
        compiled_one(False, 128, True, persistent=True, half=half, tma_store=True)
    for half in (False, True):   # (GEMM 1 writing GEMM 2's fp8 input)
        compiled_one(True, 128, True, persistent=True, quantising=True, half=half)
    from moe_kernels.kernels._gluon_transposed import compile_for_sm90 as compile_transposed, warps_for

    # the transposed product (decode), fp8 and bf16; fp8 GEMM 1 also quantising GEMM 2's input
    for scaled, gated, quantising in ((True, False, False), (True, True, False), (True, True, True),
                                      (False, False, False), (False, True, False)):
        for block_t, warps in ((16, warps_for(16)), (32, warps_for(32)), (64, warps_for(64)), (16, 8)):
            kernel = compile_transposed(block_t, 6, warps, gated, scaled, quantising)
            ptx = kernel.asm["ptx"]
            count, waits = ptx_report(ptx)
            shapes = sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k", ptx)})
            regs, spill_stores, spill_loads, warnings = ptxas_report(ptx)
            print(f"{'' if scaled else 'bf16 '}{'gated ' if gated else ''}{'quantising ' if quantising else ''}"
                  f"transposed block_t={block_t} warps={warps} stages=6: wgmma {count} "
                  f"(n {','.join(map(str, shapes))}), waits {','.join(map(str, waits))}, registers {regs}, "
                  f"spills {spill_stores}/{spill_loads} bytes (stores/loads), shared {kernel.metadata.shared} bytes, "
                  f"ptxas wgmma warnings {len(warnings)}", flush=True)


def compiled_one(gated, block_n, overlap, persistent=False, quantising=False, half=False, tma_store=False):
    """One sm_90a build's line: wgmma count and shapes (m64 nN), wait_group values in order, registers, spills,
    shared memory."""
    if persistent:
        from moe_kernels.kernels._gluon_block_fp8_persistent import compile_for_sm90 as compile_persistent

        kernel = compile_persistent(block_n, 4, 8, gated, quantising, half, tma_store=tma_store)
    else:
        kernel = compile_for_sm90(block_n, 4, 8, overlap, gated, half)
    ptx = kernel.asm["ptx"]
    count, waits = ptx_report(ptx)
    shapes = sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32", ptx)}, reverse=True)
    regs, spill_stores, spill_loads, warnings = ptxas_report(ptx)
    name = (("gated " if gated else "") + ("persistent " if persistent else "") + ("quantising " if quantising else "")
            + ("half " if half else "") + ("tma store " if tma_store else "") + ("overlap" if overlap else "in-order"))
    print(f"{name} block_n={block_n} warps=8 stages=4: wgmma {count} (n {','.join(map(str, shapes))}), "
          f"waits {','.join(map(str, waits))}, "
          f"registers {regs}, spills {spill_stores}/{spill_loads} bytes (stores/loads), "
          f"shared {kernel.metadata.shared} bytes, ptxas wgmma warnings {len(warnings)}", flush=True)
    for line in warnings:
        print("   ", line, flush=True)


# ---- the A/B on a GPU ----------------------------------------------------------------------------------------

MODEL_SHAPES = {   # (E, top-k, [(GEMM, N, K), ...])
    "deepseek-v3": (256, 8, [("gemm1", 4096, 7168), ("gemm2", 7168, 2048)]),
    "qwen3-30b-a3b": (128, 8, [("gemm1", 1536, 2048), ("gemm2", 2048, 768)]),
}


def segments(tokens, top_k, experts, seed):
    """``m_indices`` of ``tokens * top_k`` rows, each given a uniformly random expert (seeded), in segments
    rounded up to 128 rows (-1 on the padding), with one more 128-row tile of padding at the end."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(experts, (tokens * top_k, ), generator=g), minlength=experts)
    padded = (counts + 127) // 128 * 128
    starts = torch.cumsum(padded, 0) - padded
    m_indices = torch.full((int(padded.sum()) + 128, ), -1, dtype=torch.int32)
    for e in range(experts):
        m_indices[starts[e]:starts[e] + counts[e]] = e
    return m_indices


def weights(n, k, experts, seed):
    """Random block-fp8 weights w [E, N, K] and their scales [E, N/128, K/128], by the package's quantiser."""
    from moe_kernels.kernels.formats import FORMATS

    torch.manual_seed(seed)
    w = torch.empty(experts, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    w_scale = torch.empty(experts, n // 128, k // 128, device="cuda", dtype=torch.float32)
    for e in range(0, experts, 8):   # a few experts at a time: bf16 / float32 temporaries of all would not fit
        part = torch.randn(min(8, experts - e), n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        w[e:e + 8], w_scale[e:e + 8] = FORMATS["block"].quantize_weight(part)
    return w, w_scale.contiguous()


def activations(num_rows, k, seed):
    """Random block-fp8 activations x [M_pad, K] and their row-major scales [M_pad, K/128] (padding rows
    too: the kernel computes its tiles' padding rows and must not write them)."""
    from moe_kernels.kernels.formats import FORMATS

    torch.manual_seed(seed)
    x, x_scale = FORMATS["block"].quantize_activations(torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16))
    return x, x_scale.contiguous()


GLUON_VARIANTS = {"gluon overlap": dict(overlap=True), "gluon in order": dict(overlap=False),
                  "gluon persistent": dict(overlap=True, persistent=True),
                  "gluon persistent s3": dict(overlap=True, persistent=True, stages=3),
                  "gluon persistent half": dict(overlap=True, persistent=True, half_tiles=True),
                  "gluon overlap half": dict(overlap=True, half_tiles=True),
                  "gluon persistent tma store": dict(overlap=True, persistent=True, tma_store=True),
                  "gluon persistent half tma store": dict(overlap=True, persistent=True, half_tiles=True,
                                                          tma_store=True)}


def main(argv):
    from moe_kernels.bench.ceilings import measure_fp8_gemm_rate
    from moe_kernels.bench.timing import rel_err, time_lowest
    from moe_kernels.kernels.config import GemmTiles, MoEConfig
    from moe_kernels.kernels.contiguous_gemm import grouped_gemm_contiguous
    from moe_kernels.results import print_timings, record_tool

    models = argv[0].split(",") if argv else ["qwen3-30b-a3b", "deepseek-v3"]
    batches = [int(b) for b in argv[1].split(",")] if len(argv) > 1 else [4096, 16384]
    tiles = GemmTiles(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4, tma=True, persistent=1)
    configs = {"triton": MoEConfig(128, tiles, tiles),   # and the tile and K loops flattened (persistent=2)
               "triton flat": MoEConfig(128, dataclasses.replace(tiles, persistent=2),
                                        dataclasses.replace(tiles, persistent=2))}
    fp8_rate = measure_fp8_gemm_rate()
    print(f"triton {triton.__version__}; dense fp8 _scaled_mm: {fp8_rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []

    def save():
        return record_tool("gluon-block-fp8-ab", rows, {
            "models": models, "batches": batches, "fp8_gemm_rate": fp8_rate, "triton": triton.__version__,
            "gluon": {"block_m": TILE_M, "block_n": 128, "block_k": TILE_K, "stages": 4, "num_warps": 8,
                      "group_m": GROUP_M, "grid": "one program per tile", "variants": GLUON_VARIANTS},
            "triton_tiles": {"block_n": 128, "block_k": 128, "group_m": 8, "num_warps": 8, "num_stages": 4,
                             "tma": True, "persistent": "1 ('triton') and 2 ('triton flat')"}})

    for key in models:
        experts, top_k, gemms = MODEL_SHAPES[key]
        for gemm, n, k in gemms:
            w, w_scale = weights(n, k, experts, seed=n + k)
            for batch in batches:
                m_indices = segments(batch, top_k, experts, seed=batch)
                m_indices = m_indices.cuda()
                num_rows = m_indices.shape[0]
                rows_used = torch.tensor([num_rows - 128], device="cuda", dtype=torch.int32)   # (last tile: padding)
                x, x_scale = activations(num_rows, k, seed=batch + k)
                ref = block_fp8_grouped_reference(x, x_scale, w, w_scale, m_indices)
                outs = {name: torch.zeros(num_rows, n, device="cuda", dtype=torch.bfloat16)
                        for name in (*GLUON_VARIANTS, *configs)}

                def gluon_call(name, overlap, stages=4, block_n=128, persistent=False, half_tiles=False,
                               tma_store=False):
                    return lambda: block_fp8_grouped(x, x_scale, w, w_scale, m_indices, overlap=overlap,
                                                     stages=stages, block_n=block_n, out=outs[name],
                                                     rows_used=rows_used if persistent else None,
                                                     half_tiles=half_tiles, tma_store=tma_store)

                def triton_call(name):
                    return lambda: grouped_gemm_contiguous(x, w, m_indices, align=128, x_scale=x_scale, w_scale=w_scale,
                                                           config=configs[name], which="gate_up", out=outs[name],
                                                           out_dtype=torch.bfloat16, rows_used=rows_used)

                candidates = {**{name: gluon_call(name, **args) for name, args in GLUON_VARIANTS.items()},
                              **{name: triton_call(name) for name in configs}}
                # A TMA store writes its tiles' padding rows too: those candidates are checked here, on the real
                # rows, and left unchecked by the timer (which compares whole outputs).
                tma_names = tuple(name for name, args in GLUON_VARIANTS.items() if args.get("tma_store"))
                real = m_indices >= 0
                tma_rel, tma_failed = {}, {}
                for name in tma_names:   # (one failing must not lose the others, as in the timer)
                    try:
                        tma_rel[name] = rel_err(candidates[name]()[real], ref[real])
                    except Exception as error:   # noqa: BLE001
                        tma_failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                candidates = {name: call for name, call in candidates.items() if name not in tma_failed}
                us, rounds, errors, rel = time_lowest(candidates, ref, tolerance=1e-2, warmup_ms=2, rep_ms=10,
                                                      rounds=2, alternate=True, unchecked=tma_names)
                rel.update(tma_rel)
                errors.update({name: f"rel err {e:.3g} (real rows)" for name, e in tma_rel.items() if e > 1e-2})
                errors.update(tma_failed)
                flops = 2 * batch * top_k * n * k
                tflops = {name: flops / t / 1e6 for name, t in us.items()}
                rows.append({"model": key, "gemm": gemm, "batch": batch, "n": n, "k": k, "experts": experts,
                             "rows": num_rows, "routed_rows": batch * top_k, "us": us, "tflops": tflops,
                             "of_fp8_rate": {name: f * 1e12 / fp8_rate for name, f in tflops.items()},
                             "rounds_us": rounds, "rel_err": rel, "errors": errors})
                save()
                print_timings(f"{key} {gemm} {batch} tokens (N {n}, K {k}; dense fp8 {fp8_rate / 1e12:.0f} TFLOP/s):",
                              us, tflops, errors)
                x = x_scale = ref = outs = candidates = None   # (this batch's buffers freed before the next's)
                torch.cuda.empty_cache()
            w = w_scale = None
    print(f"recorded {save()}")


if __name__ == "__main__":
    if "--compile-only" in sys.argv[1:]:
        compile_only()
    else:
        main(sys.argv[1:])
