"""Issue 18: the alignment's two multi-launch rules in the routed layer at prefill (``align.CHUNK_OFFSETS``).

``tools/tune_align.py large`` times the alignment alone (``align-ab-s41.json``: the scanned rule 1.4-2.9x faster than
the summed one at 2,048-16,384 tokens). This times what that is worth to a caller: ``MoELayer(x)`` with
``layout="auto"`` (gate, routing, the alignment or the permutation's indices, quantisers, both GEMMs, the top-k
sum), the shared expert left out, each rule replayed from a CUDA graph of one call with the L2 flushed before each
replay, four rounds interleaved, every other one reversed, the lowest round median kept (``timing.time_lowest``);
the scanned rule's output checked against the summed one's; and the scanned rule with the permute layout's indices
written by the alignment's placing launch (``permute.INDICES_IN_SCANNED_ALIGNMENT``: no row kernel; the CPU's shape
runs index-gather, so there this third candidate is the second again).

    PYTHONPATH=. python tools/align_layer_ab.py [models] [batches] [formats] [name]   # GPU: records <name>.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/align_layer_ab.py                    # CPU: a small shape, checks only
"""
import dataclasses
import sys

import torch

from moe_kernels import MoELayer
from moe_kernels._runtime import record_launches
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import align, permute
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2048, 4096, 16384]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
name = sys.argv[4] if len(sys.argv) > 4 else "align-layer-ab"
if device == "cpu":   # (the interpreter: a shape small enough, past a lowered one-launch reach)
    batches, align.SINGLE_LAUNCH_MAX_NUMEL = [600], 64
rows = []


CANDIDATES = {"summed": ("summed", False), "scanned": ("scanned", False),
              "scanned, indices in the alignment": ("scanned", True)}


def with_rule(layer, x, rule, indices):
    """``layer(x)`` with ``align.CHUNK_OFFSETS`` = ``rule`` and ``permute.INDICES_IN_SCANNED_ALIGNMENT`` = ``indices``
    for the call (restored after it)."""
    def call():
        saved = align.CHUNK_OFFSETS, permute.INDICES_IN_SCANNED_ALIGNMENT
        align.CHUNK_OFFSETS, permute.INDICES_IN_SCANNED_ALIGNMENT = rule, indices
        try:
            return layer(x)
        finally:
            align.CHUNK_OFFSETS, permute.INDICES_IN_SCANNED_ALIGNMENT = saved
    return call


for key in models:
    model = dataclasses.replace(MODELS[key], num_shared_experts=0)   # the routed layer alone
    shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32   # (the interpreter's bf16 dot is wrong)
    base = MoELayer.random(model, dtype=dtype, device=device, seed=0, layout="auto", **shrink)
    d = shrink.get("hidden_size", model.hidden_size)
    f = shrink.get("intermediate_size", model.moe_intermediate_size)
    for fmt in formats:
        layer = base if fmt == "none" else base.quantized("block")
        layer.layout = "auto"
        for batch in batches:
            x = torch.randn(batch, d, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(batch))
            plan = layer.plan(batch)
            candidates = {label: with_rule(layer, x, *switches) for label, switches in CANDIDATES.items()}
            paths = {}
            for label, call in candidates.items():
                with record_launches() as seen:
                    call()
                paths[label] = [s for n, s in seen if n == "align.moe_align_block_size"]
            reference = candidates["summed"]()
            lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=1e-6, warmup_ms=5, rep_ms=30,
                                                      unchecked=("summed",), rounds=4, alternate=True)
            flops = batch * model.top_k * 6 * d * f
            rows.append({"model": key, "format": fmt, "batch": batch, "layout": plan.layout, "gemm": plan.gemm,
                         "us": lowest, "rounds_us": rounds, "errors": errors, "rel_err_vs_summed": rel,
                         "alignments": paths, "routed_flops": flops,
                         "tflops": {r: flops / (us * 1e-6) / 1e12 for r, us in lowest.items()}})
            print(f"{key:<14} {fmt:<5} {batch:>6} {plan.layout}/{plan.gemm}: " + "  ".join(
                f"{r} {us:9.1f} us" for r, us in lowest.items())
                + f"  summed/scanned {lowest.get('summed', 0) / max(lowest.get('scanned', 1), 1e-9):.3f}"
                + "  alignments "
                + str([[(a["chunk_offsets"], a["permute_indices"]) for a in p] for p in paths.values()])
                + (f"  errors {errors}" if errors else ""),
                flush=True)
            record_tool(name, rows, {"models": models, "batches": batches, "formats": formats, "rounds": 4,
                                     "shared_expert": "left out", "dtype": str(dtype), "layout": "auto"})
        del layer
    del base
    if device == "cuda":
        torch.cuda.empty_cache()
print(f"recorded {name}")
