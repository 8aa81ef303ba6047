"""The router at prefill: the two steps (cuBLAS gate, then the routing kernel) against the tile router.

What ``MoELayer(x)`` runs above the chained router's reach is the gate as ``torch.mm`` (bf16 operands,
float32 logits) and the routing kernel on those logits; :mod:`moe_kernels.kernels.tile_routing` does both in
one launch of whole-E tiles. For each model and token count this times, replayed from CUDA graphs, warm (back to
back) and with the L2 flushed before each replay, two interleaved rounds, the lower kept:

* "two steps": the gate and the routing kernel, as the layer calls them; "gate alone", "routing alone";
* "tiles": the tile router on its default tile; "tiles sorted" with the top-k by one partial sort, "tiles keyed"
  by rounds of one reduction over packed keys (and "routing alone keyed": the routing kernel so); "tiles N" on
  N-token blocks (each of ``TILE_CHOICES`` that fits);
* "two steps keyed": the two steps with the keyed top-k; "tile gate alone": the tile router's GEMM without its
  routing (:func:`~moe_kernels.kernels.tile_routing.tile_gate`); "tile gate, routing keyed": that GEMM, then the
  routing kernel with the keyed top-k;
* "read of x": one launch reading as many bytes as ``x`` and the gate (the floor in bytes),

beside the floors: bytes over the read bandwidth and the gate's FLOPs over the dense bf16 rate, both measured
in the same process. Every tile router variant's ids are first checked against the routing kernel on its own
logits (exactly) and against the two steps' (all but near-ties), and the keyed routing kernel's against the
rounds' (exactly; weights to float32's last bits); the other variants are timed unchecked. "two steps", "routing
alone", "tiles" and its blocks run the k rounds of argmax, the routing kernels' default until session 43 (now the
keyed rounds), so that the records compare across sessions.

    PYTHONPATH=. python tools/tile_router_ab.py [models] [batches] [name]   # GPU: results/<device>/<name>.json
"""
import sys

import torch

from moe_kernels._runtime import next_power_of_2
from moe_kernels.bench.ceilings import measure_gemm_rate, measure_read_bandwidth
from moe_kernels.bench.read_kernel import weight_reader
from moe_kernels.bench.timing import graph_us, graphed, median_ms
from moe_kernels.bench.routing import topk_body
from moe_kernels.kernels.routing import router_logits
from moe_kernels.kernels.tile_routing import TILE_CHOICES, gate_and_route_tiles, tile_gate, tile_router_tiles
from moe_kernels.layer import MoELayer
from moe_kernels.results import record_tool

models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 2048, 4096, 8192, 16384]
name = sys.argv[3] if len(sys.argv) > 3 else "tile-router-ab"
if not torch.cuda.is_available():
    raise SystemExit("tile_router_ab: needs a CUDA GPU")
bandwidth = measure_read_bandwidth()
gemm_rate = measure_gemm_rate()
config = {"models": models, "batches": batches, "read_bandwidth_bytes_per_s": bandwidth, "bf16_gemm_flops": gemm_rate,
          "timing": "CUDA graph of one call; warm: replays back to back; flushed: do_bench's L2 flush before each "
                    "replay; two interleaved rounds, the lower kept"}
rows = []
for key in models:
    layer = MoELayer.random(key, dtype=torch.bfloat16, device="cuda", seed=0)
    routing, w = layer.routing, layer.weights
    rule = dict(num_expert_group=routing.num_expert_group, topk_group=routing.topk_group,
                routed_scaling_factor=routing.routed_scaling_factor, e_score_correction_bias=w.bias)
    for num_tokens in batches:
        torch.manual_seed(num_tokens)
        x = torch.randn(num_tokens, w.gate.shape[1], device="cuda", dtype=torch.bfloat16)
        logits = router_logits(x, w.gate)
        args = (x, w.gate, routing.top_k, routing.renormalize, routing.scoring_func)

        def tiles(sorted_topk=False, **kw):   # (the rounds unless asked: see the docstring)
            return lambda: gate_and_route_tiles(*args, **rule, sorted_topk=sorted_topk, **kw)

        def rounds_routing(x, logits):   # the routing kernel with each top-k body
            with topk_body(False):
                return routing.route(x, logits, w.bias, checked=True)

        def keyed_routing(x, logits):
            with topk_body("keyed"):
                return routing.route(x, logits, w.bias, checked=True)

        fns = {"two steps": lambda: rounds_routing(x, router_logits(x, w.gate)),
               "gate alone": lambda: router_logits(x, w.gate),
               "routing alone": lambda: rounds_routing(x, logits),
               "tiles": tiles(), "tiles sorted": tiles(sorted_topk=True), "tiles keyed": tiles(sorted_topk="keyed"),
               "routing alone keyed": lambda: keyed_routing(x, logits),
               "two steps keyed": lambda: keyed_routing(x, router_logits(x, w.gate)),
               "tile gate alone": lambda: tile_gate(x, w.gate),
               "tile gate, routing keyed": lambda: keyed_routing(x, tile_gate(x, w.gate))}
        num_experts = w.gate.shape[0]
        for block_t in TILE_CHOICES:
            if block_t * next_power_of_2(max(16, num_experts)) <= 128 * 256 and block_t != tile_router_tiles(
                    num_tokens, num_experts, w.gate.shape[1])["block_t"]:
                fns[f"tiles {block_t}"] = tiles(block_t=block_t)
        operand_bytes = x.numel() * 2 + w.gate.numel() * 2
        fns["read of x"] = weight_reader(torch.empty(-(-operand_bytes // 4096) * 1024, device="cuda"), block=1024)
        two_steps = fns["two steps"]()
        keyed, plain = fns["routing alone keyed"](), fns["routing alone"]()
        # (ids exactly; weights to float32's last bits: the renormalising sum runs over another layout)
        if not (torch.equal(keyed[1], plain[1]) and torch.allclose(keyed[0], plain[0], rtol=1e-6, atol=1e-9)):
            raise AssertionError(f"routing alone keyed {key} {num_tokens}: other ids or weights than the rounds")
        checks = {}
        for variant in [v for v in fns if v.startswith("tiles")]:
            weights, ids, own_logits = fns[variant]()
            want_weights, want_ids = routing.route(x, own_logits, w.bias, checked=True)
            flipped = int((ids != two_steps[1]).any(dim=1).sum())
            checks[variant] = {"ids_equal_routing_on_own_logits": bool(torch.equal(ids, want_ids)),
                               "weights_close": bool(torch.allclose(weights, want_weights, rtol=1e-5, atol=1e-7)),
                               "tokens_with_other_ids_than_two_steps": flipped,
                               "max_logit_difference": float((own_logits - logits).abs().max())}
            if not (checks[variant]["ids_equal_routing_on_own_logits"] and checks[variant]["weights_close"]
                    and flipped <= max(1, num_tokens // 50)):
                raise AssertionError(f"{variant} {key} {num_tokens}: {checks[variant]}")
        warm = {v: [] for v in fns}
        cold = {v: [] for v in fns}
        for _ in range(2):
            for variant, fn in fns.items():
                warm[variant].append(graph_us(fn))
                cold[variant].append(1e3 * median_ms(graphed(fn), 5, 30))
        flops = 2 * num_tokens * w.gate.shape[1] * num_experts
        row = {"model": key, "tokens": num_tokens, "experts": num_experts, "hidden": w.gate.shape[1],
               "default_tiles": tile_router_tiles(num_tokens, num_experts, w.gate.shape[1]),
               "bytes_floor_us": 1e6 * operand_bytes / bandwidth, "flops_floor_us": 1e6 * flops / gemm_rate,
               "warm_us": {v: min(t) for v, t in warm.items()}, "flushed_us": {v: min(t) for v, t in cold.items()},
               "checks": checks}
        rows.append(row)
        print(f"{key} {num_tokens}: floors bytes {row['bytes_floor_us']:.1f} flops {row['flops_floor_us']:.1f} us",
              flush=True)
        for variant in fns:
            print(f"   {variant:16s} warm {row['warm_us'][variant]:8.1f}  flushed {row['flushed_us'][variant]:8.1f}",
                  flush=True)
        record_tool(name, rows, config)
