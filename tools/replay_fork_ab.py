"""Issue 19: DeepSeek-V3's shared expert in the package's own replays, in line against forked in their CUDA graph.

A model that calls ``MoELayer`` (through the transformers integration, say) gets the package's replays
(:mod:`moe_kernels._replay`): from a signature's fourth call one CUDA graph launch per call. Until session 46 that
graph ran the shared expert in line, after the router, on one stream; now the recorded call runs it first, marked,
and the graph issues it on a side stream forked at the layer's start (:mod:`moe_kernels._replay_fork`). This times
``layer(x)`` as a model calls it, warmed until its graph exists, three ways on the same random weights: the routed
layer alone (the shared expert left out), the shared expert apart recorded with ``layer_shared.SHARED_BESIDE`` None
(in line) and with "experts" (forked). Each call timed with the L2 flushed before it (``do_bench``'s loop), four
rounds, every other one in reverse order, the lowest round median kept; every output is checked against the
in-line one. The difference from the routed layer alone is what the shared expert costs.

    PYTHONPATH=. python tools/replay_fork_ab.py [batches] [formats] [name]   # GPU: records <name>.json
"""
import dataclasses
import sys

import torch

from moe_kernels import MoELayer, layer_shared
from moe_kernels.bench.ceilings import measure_read_bandwidth
from moe_kernels.bench.timing import median_ms, rel_err, round_order
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

batches = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 64, 256]
formats = sys.argv[2].split(",") if len(sys.argv) > 2 else ["block", "none"]
record_name = sys.argv[3] if len(sys.argv) > 3 else "replay-fork-ab"
model = MODELS["deepseek-v3"]
read_bandwidth = measure_read_bandwidth()
rows = []


def recorded_with(beside, layer, x):
    """Warm ``layer`` on ``x``'s signature under ``SHARED_BESIDE = beside`` (its plan is recorded at the second
    call, captured into a graph at the fourth), and return the call."""
    old, layer_shared.SHARED_BESIDE = layer_shared.SHARED_BESIDE, beside
    try:
        for _ in range(6):
            layer(x)
    finally:
        layer_shared.SHARED_BESIDE = old
    replay = layer._replays.get(layer._replays.key((x,), ()))
    graphs = 0 if replay is None else sum(len(s.graphs) for s in replay.graphs.by_stream.values())
    return (lambda: layer(x)), {"replayed": replay is not None, "graphs": graphs,
                                "forks": bool(replay is not None and replay.forks),
                                "refusal": layer._replays.last_refusal}


for fmt in formats:
    separate = MoELayer.random(model, dtype=torch.bfloat16, device="cuda", seed=0)
    separate = separate.quantized(fmt) if fmt != "none" else separate
    weights, routing = separate.weights, separate.routing
    routed = dataclasses.replace(weights, shared_w13=None, shared_w2=None, shared_w13_scale=None,
                                 shared_w2_scale=None)
    shared_bytes = sum(t.numel() * t.element_size() for t in (weights.shared_w13, weights.shared_w2))
    for batch in batches:
        x = torch.randn(batch, model.hidden_size, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(batch))
        calls, notes = {}, {}
        for name, layer, beside in (("routed only", MoELayer(routed, routing), None),
                                    ("in line", MoELayer(weights, routing), None),
                                    ("forked", MoELayer(weights, routing), "experts")):
            calls[name], notes[name] = recorded_with(beside, layer, x)
        reference = calls["in line"]()
        rel = {name: rel_err(calls[name](), reference) for name in ("in line", "forked")}
        times = {name: [] for name in calls}
        for r in range(4):
            for name in round_order(list(calls), r, True):
                times[name].append(median_ms(calls[name], 5, 40) * 1e3)
        lowest = {name: min(t) for name, t in times.items()}
        floor_us = 1e6 * shared_bytes / read_bandwidth
        cost = {name: lowest[name] - lowest["routed only"] for name in ("in line", "forked")}
        rows.append({"format": fmt, "batch": batch, "us": lowest, "rounds_us": times, "rel_err_vs_in_line": rel,
                     "shared_cost_us": cost, "shared_floor_us": floor_us, "replays": notes})
        record_tool(record_name, rows, {"model": "deepseek-v3", "batches": batches, "formats": formats,
                                        "timing": "layer(x) as a model calls it, L2 flushed (do_bench's loop)",
                                        "rounds": 4, "order": "reversed every other round",
                                        "ceilings": {"read_bandwidth": read_bandwidth}})
        print(f"{fmt:<5} {batch:>4}: " + "  ".join(f"{n} {us:8.1f}" for n, us in lowest.items())
              + " us | shared " + "  ".join(f"{n} {c:6.1f} ({c / floor_us:.2f}x)" for n, c in cost.items())
              + f" | floor {floor_us:.1f} | {notes['forked']} rel {rel['forked']:.1e}", flush=True)
    del separate, weights, routed
    torch.cuda.empty_cache()
