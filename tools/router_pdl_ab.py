"""Issue 19, item 4: GEMM 1 as a programmatic dependent of the chained router, against the plain launch.

The layer's router at decode is three launches chained by PDL (:mod:`moe_kernels.kernels.chained_routing`); GEMM 1
after it was launched plainly, so it waited for the router's last launch to end before it was even launched. With
``layer_router.ROUTER_LAUNCHES_GEMM1`` the router's last launch lets GEMM 1 launch early and GEMM 1 waits for the
router's memory itself (``launch-floor.json``, the H200: one more kernel back to back costs 0.96-1.17 us plain,
0.57-0.69 with PDL). This times the bf16 layer (``MoELayer(x)``, the shared expert left out, index-gather, the
layer's own tiles) both ways, as two layers over the same weights (each records its own calls for its replays):
replayed from a CUDA graph with the L2 flushed before each replay, and warm (a graph of 20 calls back to back), four
rounds, every other one in reverse order, the lowest round median kept; the two outputs must be the same bits. A row
says whether GEMM 1 took the dependent launch there (``gemm1_waits``): where the layer runs GEMM 1 otherwise (the
H100's one-launch kernel at one token, a streamed pair) both ways are the same launches, and such a row says nothing
about the switch.

    PYTHONPATH=. python tools/router_pdl_ab.py [models] [batches] [name]   # GPU: records <name>.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/router_pdl_ab.py          # CPU: a small shape, the checks only
"""
import dataclasses
import sys

import torch

import moe_kernels.layer_router as layer_router
from moe_kernels import MoELayer
from moe_kernels._runtime import record_launches
from moe_kernels.bench.timing import graph_us, time_lowest
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"   # (the CPU: a small shape under the interpreter)
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 512]
record_name = sys.argv[3] if len(sys.argv) > 3 else "router-pdl-ab"
shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
dtype = torch.bfloat16 if device == "cuda" else torch.float32   # (the interpreter's bf16 dot is wrong)


def with_setting(on: bool, call):
    """``call()`` with GEMM 1 launched behind the router (``on``) or plainly."""
    old = layer_router.ROUTER_LAUNCHES_GEMM1
    layer_router.ROUTER_LAUNCHES_GEMM1 = on
    try:
        return call()
    finally:
        layer_router.ROUTER_LAUNCHES_GEMM1 = old


rows = []
for name in models:
    base = MoELayer.random(MODELS[name], dtype=dtype, device=device, seed=0, **shrink)
    weights = dataclasses.replace(base.weights, shared_w13=None, shared_w2=None)
    layers = {way: MoELayer(weights, base.routing) for way in ("plain", "behind the router")}
    for batch in batches:
        x = torch.randn(batch, weights.w2.shape[1], device=device, dtype=dtype,
                        generator=torch.Generator(device).manual_seed(batch))
        plan = layers["plain"].plan(batch, dtype=dtype)
        candidates = {way: lambda way=way: with_setting(way == "behind the router", lambda: layers[way](x))
                      for way in layers}
        with record_launches() as launches:
            candidates["behind the router"]()
        roles = [s["pdl"] for n, s in launches if n == "index_gather.gemm" and not s["dense"]]
        triggers = [s["triggers"] for n, s in launches if n in ("chained_routing.route", "chained_routing.align")]
        reference = candidates["plain"]()
        same = bool(torch.equal(candidates["behind the router"](), reference))
        lowest, rounds, errors, rel = time_lowest(candidates, reference, tolerance=0.0, warmup_ms=5, rep_ms=30,
                                                  rounds=4, alternate=True)
        warm = {way: [] for way in candidates}
        for r in range(4 if device == "cuda" else 1):
            for way in (list(candidates) if r % 2 == 0 else list(candidates)[::-1]):
                warm[way].append(graph_us(candidates[way]) if device == "cuda" else 1.0)
        row = {"model": name, "batch": batch, "us": lowest, "rounds_us": rounds, "warm_us": {w: min(v) for w, v in
               warm.items()}, "warm_rounds_us": warm, "errors": errors, "same_bits": same, "gemm_pdl_roles": roles,
               "router_triggers": triggers, "gemm1_waits": bool(roles) and roles[0].startswith("wait"),
               "router": [plan.gate_routing, plan.gate_alignment, plan.chained],
               "naive_blocks": plan.naive_blocks, "entry": plan.choice.entry, "table": plan.choice.table}
        rows.append(row)
        record_tool(record_name, rows, {"models": models, "batches": batches, "shared_expert": "left out",
                                        "rounds": 4, "order": "reversed every other round", "dtype": str(dtype)})
        change = lowest["behind the router"] - lowest["plain"]
        print(f"{name} {batch:>3}: flushed plain {lowest['plain']:8.2f} behind {lowest['behind the router']:8.2f}"
              f" ({change:+.2f}); warm plain {row['warm_us']['plain']:8.2f} behind "
              f"{row['warm_us']['behind the router']:8.2f} us; same bits {same}; roles {roles} triggers {triggers}"
              + (f"  errors {errors}" if errors else ""), flush=True)
    del base, weights, layers
    if device == "cuda":
        torch.cuda.empty_cache()
print("router pdl checks done" if all(r["same_bits"] for r in rows) else "router pdl: outputs differ")
