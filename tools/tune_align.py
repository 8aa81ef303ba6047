"""Try alignment launch settings on a GPU: CUDA-graph time per call for each variant and batch.

Usage (on the GPU machine): PYTHONPATH=. python3 tools/tune_align.py           # the one-launch reach, E=256
                            PYTHONPATH=. python3 tools/tune_align.py large [name]   # the multi-launch paths at prefill
Variants change the module constants of moe_kernels.kernels.align; every output is checked against the
reference before it is timed. ``large`` (records align-ab, or the name given after it): the two-launch path's chunks
(``MAX_CHUNKS``), tile, warps, count-table rows a step (``_ROW_TILE``) and padding rows a step (``_MAX_PAD_TILE``), and
the scanned path's (``CHUNK_OFFSETS`` "scanned": chunks, tile, warps, the scan's rows a step and columns a program,
padding rows a step) at 2,048, 4,096 and 16,384 tokens of top-8 over 128 and
256 experts
(Qwen3-30B-A3B's and DeepSeek-V3's routing) on 128-row blocks (the permute layout's segments), where the profile
of the layer (``layer-profile-s35.json``) had the alignment at 83-102 us, two rounds, the lower kept; beside them
the package's own settings (which since session 35 take 64-assignment tiles on 8 warps past ``LARGE_FROM_NUMEL``).
"""

import itertools
import sys

import torch

from moe_kernels.kernels import align
from moe_kernels.bench.timing import graph_us
from moe_kernels.results import record_tool

K = 8
gen = torch.Generator(device="cuda").manual_seed(0)


def timed(variants, E, B, block):
    """Each variant's CUDA-graph time (us) aligning B tokens' top-K ids over E experts, checked first."""
    ids = torch.rand(B, E, device="cuda", generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    ref = align.moe_align_block_size_reference(ids, block, E)
    defaults = {name: getattr(align, name) for v in variants.values() for name in v}
    results = {}
    for label, v in variants.items():
        for name, value in v.items():
            setattr(align, name, value)
        try:
            out = align.moe_align_block_size(ids, block, E, validate_ids=False)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
            us = graph_us(lambda: align.moe_align_block_size(ids, block, E, validate_ids=False))
            if us is None:
                raise RuntimeError("no CUDA graph")
            results[label] = us
        except Exception as err:  # noqa: BLE001
            print("failed", label, type(err).__name__, str(err)[:120])
        finally:
            for name, value in defaults.items():
                setattr(align, name, value)
    return results


if sys.argv[1:2] == ["large"]:
    name = sys.argv[2] if len(sys.argv) > 2 else "align-ab"
    # (each variant's tiles at every size: LARGE_FROM_NUMEL out of the way; "package default": the module as it is)
    # The summed path: up to c chunks of t-assignment tiles on w warps, r count-table rows a step, and p padding rows
    # a step (the padding's [tile, p] store held most of the registers in the sm_90 build: 196 a thread at p = 64,
    # 80 at p = 8, on 64-assignment tiles of 8 warps; 106 and 32 on 32-assignment tiles).
    settings = ((128, 64, 8, 16, 64), (128, 64, 8, 16, 8), (256, 64, 4, 16, 64), (256, 32, 4, 16, 8),
                (128, 128, 4, 16, 64))
    variants = {"package default": {}} | {
        f"chunks {c} tile {t} warps {w} rows {r} pad {p}":
        dict(MAX_CHUNKS=c, _MULTI_TILE=t, _MULTI_WARPS=w, _ROW_TILE=r, _MAX_PAD_TILE=p, LARGE_FROM_NUMEL=2**40,
             CHUNK_OFFSETS="summed")
        for c, t, w, r, p in settings}
    # The scanned path (count, scan, place: three launches): up to c chunks of t-assignment tiles on w warps, the
    # scan r table rows a step over b expert columns a program, p padding rows a step.
    scanned = ((1024, 64, 8, 64, 16, 64), (1024, 64, 8, 64, 16, 8), (1024, 32, 8, 64, 16, 8),
               (1024, 32, 4, 64, 16, 8), (2048, 32, 4, 64, 16, 8), (2048, 16, 4, 64, 16, 8),
               (4096, 16, 4, 128, 16, 8), (1024, 16, 4, 64, 16, 8), (512, 32, 4, 64, 16, 8),
               (2048, 32, 8, 128, 32, 16))
    variants |= {f"scanned chunks {c} tile {t} warps {w} scan rows {r} bins {b} pad {p}":
                 dict(CHUNK_OFFSETS="scanned", SCAN_MAX_CHUNKS=c, _SCANNED_TILE=t, _SCANNED_WARPS=w, _SCAN_ROWS=r,
                      _SCAN_BINS=b, _SCANNED_MAX_PAD_TILE=p)
                 for c, t, w, r, b, p in scanned}
    rows = []
    for E, B in itertools.product((128, 256), (2048, 4096, 16384)):
        first, second = timed(variants, E, B, 128), timed(variants, E, B, 128)
        us = {label: min((t for t in (first.get(label), second.get(label)) if t is not None), default=None)
              for label in variants}   # (None: failed in both rounds)
        rows.append({"experts": E, "tokens": B, "top_k": K, "block": 128, "us": us})
        record_tool(name, rows, {"method": "CUDA-graph time of one call (L2 warm), two rounds, the lower kept",
                                 "variants": variants})
        best = sorted(((v, t) for v, t in us.items() if t is not None), key=lambda r: r[1])[:4]
        print(f"E={E} B={B}: package default {us['package default']} us; best " +
              "; ".join(f"{t:.1f} {v}" for v, t in best), flush=True)
    sys.exit(0)

E = 256
variants = [dict(SINGLE_LAUNCH_MAX_NUMEL=s, _SINGLE_TILE=t, _SINGLE_WARPS=w, _MULTI_TILE=t, _MULTI_WARPS=w)
            for s, t, w in itertools.product((0, 2048, 8192), (64, 128, 256), (4, 8))]
for B in (64, 256, 512, 1024, 2048):
    results = timed({str(v): v for v in variants}, E, B, 64 if B <= 512 else 128)
    best = sorted(results.items(), key=lambda r: r[1])[:4]
    print(f"B={B}: best " + "; ".join(f"{t:.1f} us {v}" for v, t in best), flush=True)
