"""fp8 decode A/B (issue 17): what the block scales' promotion costs in the K loop, and what loading
each step's scales one step ahead gives back, with the read floor measured in the same process.

Compiled for sm_90, the block-fp8 K loop staged its activation and weight tiles through the pipeline,
but each step loaded its scales (one per row of the tile, one per weight block) in the step itself,
right before the product that needs them: their latency stood in every step. The core now loads the
next step's scales while the current product runs (``SCALES`` = 1); ``SCALES`` = 4 is the same loop
with the old loads, kept for this A/B. Candidates, each ``fused_experts`` with the H200 table's
tiles (the quantiser, GEMM 1, GEMM 2, the top-k sum):

  scales ahead       the table as it runs (the default)
  scales in step     the scales loaded in the step that uses them (before this change)
  no promotion       the block scales replaced by one scale per row after the loop (``SCALES`` = 3):
                     not the right numbers (unchecked); what the K loop costs with no per-step scale
  down BLOCK_K x     GEMM 2 with the other K step (64 <-> 128), scales ahead
  bf16 table         the same layer in bf16 with its own table (unchecked): the fp8 speedup

Each candidate is replayed from a CUDA graph of one call, the L2 flushed before each replay, two rounds
interleaved, the lower round median kept.

    PYTHONPATH=. python tools/scale_ahead_ab.py [models] [batches]
    # e.g. qwen3-30b-a3b,deepseek-v3 8,64,256,512   (records results/<device>/scale-ahead-ab.json)
"""
import dataclasses
import json
import os
import sys

import torch

from moe_kernels.bench.ceilings import ReadFloor
from moe_kernels.bench.problems import make_batch, tool_weights
from moe_kernels.bench.timing import time_candidates
from moe_kernels.kernels.config import get_config
from moe_kernels.kernels.formats import FORMATS, WeightFormat
from moe_kernels.kernels.index_gather import fused_experts

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8, 64, 256, 512]
floor = ReadFloor(device)
rows = []
_scale_arguments = WeightFormat.scale_arguments


def with_scale_code(code: int, call):
    """``call`` with the block-scale code (1) replaced by ``code`` in every GEMM it launches."""
    def patched(self, *args):
        out = _scale_arguments(self, *args)
        return out[:6] + ((code if out[6] == 1 else out[6]),) + out[7:]

    def run():
        WeightFormat.scale_arguments = patched
        try:
            return call()
        finally:   # (a class attribute: the other candidates and the reference must not see it)
            WeightFormat.scale_arguments = _scale_arguments
    return run


def save():
    from moe_kernels.results import record

    path = record("scale-ahead-ab", {"rows": rows, "config": {
        "models": models, "batches": batches, "read_bandwidth": floor.bandwidth}})
    if os.environ.get("OUT"):
        json.dump(rows, open(os.path.join(os.environ["OUT"], "scale_ahead_ab.json"), "w"), indent=1)
    return path


for key in models:
    model, dtype, w1, w1s, w2, w2s = tool_weights(key, FORMATS["block"], device)
    _, _, b1, _, b2, _ = tool_weights(key, FORMATS["none"], device)
    e, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    for batch in batches:
        x, _, weights, ids = make_batch(model, batch, dtype, 1 + batch, device)
        config = get_config(batch, e, f, d, w1.dtype, x.device)
        other_k = dataclasses.replace(config, down=dataclasses.replace(
            config.down, block_k=64 if config.down.block_k == 128 else 128))

        def fp8(c=config):
            return fused_experts(x, w1, w2, weights, ids, config=c, validate_ids=False, w1_scale=w1s, w2_scale=w2s)

        candidates = {
            "scales ahead": fp8,
            "scales in step": with_scale_code(4, fp8),
            "no promotion": with_scale_code(3, fp8),
            f"down BLOCK_K {other_k.down.block_k}": lambda: fp8(other_k),
            "bf16 table": lambda: fused_experts(x, b1, b2, weights, ids, validate_ids=False),
        }
        reference = fp8().float()
        times, errors, rel = time_candidates(candidates, reference, tolerance=0.02, warmup_ms=2, rep_ms=20,
                                             unchecked=("no promotion", "bf16 table"))
        us = {n: min(t) for n, t in times.items()}
        row = {"model": key, "batch": batch, **floor.of_experts(ids, w1, w1s, w2, w2s), "us": us,
               "rounds_us": times, "rel_err": rel, "errors": errors, "config": config.to_dict()}
        rows.append(row)
        save()
        print(f"{key} {batch}: fp8 floor {row['floor_us']:.1f} us, "
              + ", ".join(f"{n} {t:.1f} ({t / row['floor_us']:.2f}x)" for n, t in us.items()), errors or "",
              flush=True)
        del x, weights, ids, reference
        if device == "cuda":
            torch.cuda.empty_cache()
    del w1, w2, b1, b2

print(f"recorded {save()}")
