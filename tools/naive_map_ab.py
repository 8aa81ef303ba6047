"""Issue 17: the naive block map against the aligned one where vLLM's rule takes the naive map.

At ``T * k * 4 <= E`` tokens (DeepSeek-V3: up to 8; Qwen3-30B-A3B: up to 4) the layer skips the alignment and
gives each assignment (or, with ``naive_group``, each expert's assignments) its own block. Session 45 saw DeepSeek-V3's
fp8 layer with the shared slot (E + 1 experts, top-9: aligned at 8 tokens) beat the routed layer alone (naive there)
by 20 us, more than the slot's cost allows. This times the routed layer (``MoELayer(x)``, the shared expert left out,
index-gather, the layer's own tiles) both ways at the same batch: vLLM's rule (block fp8 included: since this tool
first ran the layer keeps block fp8 on the naive map up to ``blocks.NAIVE_MAX_TOKENS_BLOCK_FP8`` tokens only), and
with ``blocks.NAIVE_RULE_FACTOR`` raised past every batch so that the plan aligns (and the router chain aligns in its
own launch, as it does above the rule). Beside them the experts call alone (``fused_experts`` on the layer's routing
and tiles, each block map built before the timed call: the GEMMs and the top-k sum without the alignment). Each
call replayed from a CUDA graph with the L2 flushed before each replay, four rounds, every other one in reverse
order, the lowest round median kept; every output checked against the naive layer's.

    PYTHONPATH=. python tools/naive_map_ab.py [models] [formats] [name]   # GPU: records <name>.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/naive_map_ab.py          # CPU: a small shape, the checks only
"""
import dataclasses
import sys

import torch

from moe_kernels import MoELayer, fused_experts
from moe_kernels.bench.ceilings import measure_read_bandwidth
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import blocks
from moe_kernels.layer_router import route
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["deepseek-v3", "qwen3-30b-a3b"]
formats = sys.argv[2].split(",") if len(sys.argv) > 2 else ["block", "none"]
record_name = sys.argv[3] if len(sys.argv) > 3 else "naive-map-ab"
shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
dtype = torch.bfloat16 if device == "cuda" else torch.float32   # (the interpreter's bf16 dot is wrong)
read_bandwidth = measure_read_bandwidth() if device == "cuda" else 1.0
ALIGNED = 1 << 40   # a factor no batch passes: the rule never takes the naive map


def under_rule(aligned, call):
    """``call()`` under vLLM's rule for every format (``aligned``: with its factor 4 raised past every batch; the
    plan is made, and cached, at the layer's first call)."""
    old = blocks.NAIVE_RULE_FACTOR, blocks.NAIVE_MAX_TOKENS_BLOCK_FP8
    blocks.NAIVE_RULE_FACTOR, blocks.NAIVE_MAX_TOKENS_BLOCK_FP8 = (ALIGNED if aligned else 4), ALIGNED
    try:
        return call()
    finally:
        blocks.NAIVE_RULE_FACTOR, blocks.NAIVE_MAX_TOKENS_BLOCK_FP8 = old


rows = []
for name in models:
    model = MODELS[name]
    for fmt in formats:
        base = MoELayer.random(model, dtype=dtype, device=device, seed=0, **shrink)
        base = base.quantized(fmt) if fmt != "none" else base
        weights = dataclasses.replace(base.weights, shared_w13=None, shared_w2=None, shared_w13_scale=None,
                                      shared_w2_scale=None)
        e, k = weights.num_experts, base.routing.top_k
        bytes_per_expert = sum(t[0].numel() * t.element_size() for t in (weights.w13, weights.w2)) + sum(
            t[0].numel() * t.element_size() for t in (weights.w13_scale, weights.w2_scale) if t is not None)
        largest = e // (k * 4)
        for batch in range(2, largest + 1) if device == "cuda" else [2, largest]:
            layers = {"naive": MoELayer(weights, base.routing), "aligned": MoELayer(weights, base.routing)}
            x = torch.randn(batch, weights.w2.shape[1], device=device, dtype=dtype,
                            generator=torch.Generator(device).manual_seed(batch))
            plans = {way: under_rule(way == "aligned", lambda way=way: layers[way].plan(batch, dtype=dtype))
                     for way in layers}
            assert plans["naive"].naive_blocks and plans["aligned"].naive_blocks is False, plans
            candidates = {way: lambda way=way: under_rule(way == "aligned", lambda: layers[way](x)) for way in layers}
            topk_weights, topk_ids, _ = route(plans["naive"], x, weights, base.routing)
            for way, plan in plans.items():   # (the map built outside the timed call)
                block_map = blocks.assign_blocks(topk_ids, plan.config.block_m, e, naive=plan.naive_blocks)
                candidates[f"experts {way}"] = lambda plan=plan, block_map=block_map: fused_experts(
                    x, weights.w13, weights.w2, topk_weights, topk_ids, config=plan.config, blocks=block_map,
                    w1_scale=weights.w13_scale, w2_scale=weights.w2_scale, validate_ids=False)
            reference = layers["naive"](x)
            lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=3e-2, warmup_ms=5, rep_ms=30,
                                                      rounds=4, alternate=True)
            touched = int(topk_ids.unique().numel())
            floor_us = 1e6 * touched * bytes_per_expert / read_bandwidth
            row = {"model": name, "format": fmt, "batch": batch, "us": lowest, "rounds_us": rounds, "errors": errors,
                   "rel_err_vs_naive": rel, "experts_touched": touched, "floor_us": floor_us,
                   "aligned_over_naive": lowest["aligned"] / lowest["naive"],
                   "experts_aligned_over_naive": lowest["experts aligned"] / lowest["experts naive"],
                   "plans": {way: {"naive_blocks": p.naive_blocks, "entry": p.choice.entry, "table": p.choice.table,
                                   "router": [p.gate_routing, p.gate_alignment, p.chained],
                                   "config": dataclasses.asdict(p.config)} for way, p in plans.items()}}
            rows.append(row)
            record_tool(record_name, rows, {"models": models, "formats": formats, "shared_expert": "left out",
                                            "rounds": 4, "order": "reversed every other round",
                                            "ceilings": {"read_bandwidth": read_bandwidth}, "dtype": str(dtype)})
            print(f"{name} {fmt:<5} {batch:>2}: " + "  ".join(f"{way} {us:8.1f}" for way, us in lowest.items()) + " us"
                  f"  ({row['aligned_over_naive']:.3f}; {touched} experts, floor {floor_us:.1f})"
                  + (f"  errors {errors}" if errors else ""), flush=True)
        del base, weights, layers
        if device == "cuda":
            torch.cuda.empty_cache()
