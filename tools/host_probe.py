"""Where one replayed call's host time goes, on a GPU: for each (model, format, batch), whether
``fused_experts`` and ``MoELayer(x)`` run through a CUDA graph (moe_kernels._replay_graphs), their
host time per call (moe_kernels.bench.layer_cost.host_us), and a cProfile of 200 calls.

    PYTHONPATH=. python tools/host_probe.py qwen3-30b-a3b:block:1 deepseek-v3:block:8
"""
import cProfile
import io
import pstats
import sys

import torch

from moe_kernels.bench.layer_cost import entry_points, host_us
from moe_kernels.kernels.index_gather import _PLANS
from moe_kernels.layer import MoELayer
from moe_kernels.model.shapes import MODELS


def graphs_of(plans):
    state = []
    for plan in plans.plans.values():
        g = plan.graphs
        state.append((plan.num_launches, plan.graph_bytes, None if g is None else g.refusal,
                      None if g is None else sum(len(s.graphs) for s in g.by_stream.values())))
    return state


for spec in sys.argv[1:] or ["qwen3-30b-a3b:block:1", "deepseek-v3:block:8"]:
    name, fmt, batch = spec.split(":")
    layer = MoELayer.random(name, dtype=torch.bfloat16, device="cuda", seed=0)
    layer = layer if fmt == "none" else layer.quantized(fmt)
    x = torch.randn(int(batch), MODELS[name].hidden_size, device="cuda", dtype=torch.bfloat16)
    calls = entry_points(layer, x)
    for what in ("fused_experts", "MoELayer"):
        fn = calls[what]
        for _ in range(6):
            fn()
        torch.cuda.synchronize()
        median, least = host_us(fn, calls=20, rounds=9)
        plans = _PLANS if what == "fused_experts" else layer._replays
        print(f"{spec} {what}: host {median:.1f} us (least {least:.1f}); plans (launches, bytes, refusal, graphs): "
              f"{graphs_of(plans)}", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:2500], flush=True)
    _PLANS.clear()
