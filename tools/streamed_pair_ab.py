"""Decode A/B (issue 17): both expert GEMMs as one stream of tiles (moe_kernels/kernels/streamed_pair.py)
against the tuned two-GEMM path, bf16 and fp8 block, with the read floor measured in the same process.

For each (model, format, batch): the two GEMMs as the sweep times them (``fused_experts`` with its tuned
table and the block map made beforehand: the fp8 quantiser, GEMM 1, GEMM 2 and the top-k sum), and the
streamed pair on the same tiles (fp8: GEMM 1's N tile at least 128, one quantisation group, since its
epilogue quantises GEMM 2's input) at a few lags, with and without GEMM 2's L2 prefetch before its wait,
the same quantiser and top-k sum around it. Each candidate is replayed from a CUDA graph of one call with
the L2 flushed before each replay, two rounds interleaved, the lower of the two round medians kept.

    PYTHONPATH=. python tools/streamed_pair_ab.py [models] [batches] [formats]
    # e.g. qwen3-30b-a3b 1,8,64,256,512 none,block   (records results/<device>/streamed-pair-ab.json)
"""
import dataclasses
import sys

import torch

from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.ceilings import ReadFloor
from moe_kernels.bench.timing import time_candidates
from moe_kernels.kernels import streamed_pair as sp
from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.combine import sum_slots
from moe_kernels.kernels.config import get_config
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import fused_experts
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 256, 512]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
ALL = 1 << 30   # a lag of every block: all of GEMM 1's tiles first
# (lag, prefetch, warps: None for GEMM 1's)
# (lag, prefetch, warps: None for GEMM 1's, tickets: 0 = by program id)
VARIANTS = ([(32, 0, None, 1), (32, 0, 4, 1), (32, 0, 8, 1), (32, 0, None, 0)] if device == "cuda"
            else [(1, 0, None, 1), (ALL, 1, 4, 0)])

floor = ReadFloor(device)

rows = []


def save():
    """The record so far (rewritten after every row: a run cut short keeps what it measured)."""
    return record_tool("streamed-pair-ab", rows, {
        "models": models, "batches": batches, "formats": formats, "read_bandwidth": floor.bandwidth,
        "variants": [{"lag": lag, "prefetch": pf, "warps": w, "tickets": t} for lag, pf, w, t in VARIANTS]})


def streamed(x, w1, w2, weights, blocks, top_k, fmt, scales, gate_up, down, lag, prefetch, warps, tickets):
    """The streamed pair with the two-GEMM path's quantiser before it and top-k sum after it."""
    saved, (sp.PREFETCH, sp.TICKETS) = (sp.PREFETCH, sp.TICKETS), (prefetch, tickets)
    try:
        return _streamed(x, w1, w2, weights, blocks, top_k, fmt, scales, gate_up, down, lag, warps)
    finally:   # (module settings: the two-launch candidates and the reference must not see them)
        sp.PREFETCH, sp.TICKETS = saved


def _streamed(x, w1, w2, weights, blocks, top_k, fmt, scales, gate_up, down, lag, warps):
    xq, x_scale = fmt.quantize_activations(x)
    numel, f = x.shape[0] * top_k, w1.shape[1] // 2
    quant = h = None
    if fmt.quantized:
        h = torch.empty((numel, f), device=x.device, dtype=torch.float8_e4m3fn)
        quant = (torch.empty((numel, f // fmt.block[1]), device=x.device, dtype=torch.float32), fmt.block[1], "bf16")
    per_slot = sp.streamed_pair(xq, w1, w2, weights, blocks, top_k, gate_up=gate_up, down=down, lag=lag, h=h,
                                x_scale=x_scale, fmt=fmt, quant=quant, num_warps=warps,
                                out=torch.empty((x.shape[0], top_k, w2.shape[1]), device=x.device, dtype=x.dtype),
                                **scales)
    return sum_slots(per_slot)


for fname in formats:
    fmt = FORMATS[fname]
    for key in models:
        model, dtype, w1, w1s, w2, w2s = tool_weights(key, fmt, device)
        e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
        scales = dict(w1_scale=w1s, w2_scale=w2s)
        for batch in batches:
            x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
            # The two launches: the table's tiles without its stream (the fp8 table takes the stream at some batches).
            config = dataclasses.replace(get_config(batch, e, f, d, w1.dtype, x.device), stream_lag=None)
            blocks = assign_blocks(ids, config.block_m, e, validate_ids=False)
            gate_up = config.gate_up
            if fmt.quantized and gate_up.block_n % fmt.block[1]:   # the epilogue quantises whole groups
                gate_up = dataclasses.replace(gate_up, block_n=fmt.block[1])
            candidates = {
                "two GEMMs": lambda: fused_experts(x, w1, w2, weights, ids, config=config, blocks=blocks,
                                                   validate_ids=False, **scales),
            }
            if fmt.quantized:   # the two launches with GEMM 1's quantising epilogue too, and GEMM 2 as its dependent
                for pdl in (False, True):
                    fused = dataclasses.replace(config, gate_up=gate_up, quant_in_gemm=True, pdl=pdl)
                    candidates[f"two GEMMs quant in GEMM 1{' + PDL' if pdl else ''}"] = (
                        lambda fused=fused: fused_experts(x, w1, w2, weights, ids, config=fused, blocks=blocks,
                                                          validate_ids=False, **scales))
            for lag, pf, warps, tickets in VARIANTS:
                name = (f"stream lag {'all' if lag == ALL else lag}{' prefetch' if pf else ''}"
                        f"{f' w{warps}' if warps else ''}{'' if tickets else ' by pid'}")
                candidates[name] = (lambda lag=lag, pf=pf, warps=warps, tickets=tickets: streamed(
                    x, w1, w2, weights, blocks, k, fmt, scales, gate_up, config.down, lag, pf, warps, tickets))
            reference = candidates["two GEMMs"]().float()
            times, errors, rel = time_candidates(candidates, reference, tolerance=0.02, warmup_ms=2, rep_ms=20)
            us = {n: min(t) for n, t in times.items()}
            best = min((n for n in us if n.startswith("stream")), key=us.get, default=None)
            row = {"model": key, "format": fname, "batch": batch, **floor.of_experts(ids, w1, w1s, w2, w2s),
                   "us": us, "rounds_us": times, "rel_err_vs_two_gemms": rel, "errors": errors,
                   "best_stream": best, "two_gemm_config": config.to_dict(),
                   "stream_gate_up": dataclasses.asdict(gate_up)}
            rows.append(row)
            save()
            print(f"{key} {fname} {batch}: floor {row['floor_us']:.1f} us, read {row['read_same_bytes_us'] or 0:.1f}, "
                  f"two GEMMs {us.get('two GEMMs', 0):.1f}, "
                  + ", ".join(f"{n} {t:.1f}" for n, t in us.items() if n != "two GEMMs")
                  + f" (rel err {max(rel.values(), default=0):.1e})", errors or "", flush=True)
            del x, weights, ids, reference, blocks
            if device == "cuda":
                torch.cuda.empty_cache()
        del w1, w2


print(f"recorded {save()}")
