"""Where the routed layer's GPU time goes, kernel by kernel: torch's profiler over a few calls of ``MoELayer(x)``
with ``layout="auto"`` (the layout and tiles the package picks on this GPU), shared expert left out.

Why: the A/B tools time a whole call or each stage replayed alone; the layer's non-GEMM share at prefill (the
input's scatter, the top-k sum, the router) was inferred as the layer's time less the GEMMs' time from another
run, which the power cap's 2-4% between runs swamps. Here every kernel of one call is timed in the same calls.
Kernel durations come from CUPTI, with the L2 warm (each call's inputs are the last call's); the gaps between
kernels are the profiler's, not the layer's, so the record keeps the kernels' sum; ``wall_us`` is the time of
``WALL_CALLS`` calls back to back without the profiler, as a caller makes them (the plan replayed, or from its CUDA
graph where it has one), after ``WARMUP_CALLS`` (session 35's first records warmed up with three, so a graph's
capture fell among the timed calls: their ``wall_us`` is not the steady state).
GEMM kernels are the ones whose name says so (``GEMM_NAMES``); the rest is the layer around them.

    PYTHONPATH=. python tools/layer_profile.py [models] [batches] [formats]   # GPU: records layer-profile.json
    (LAYER_PROFILE_SWITCHES="BF16_GATHER_GEMM1_UP_TO_ROWS=None": permute_gluon's switches set for the run)
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/layer_profile.py             # CPU: a small shape, no kernels timed
"""
import ast
import dataclasses
import os
import sys

import torch

from moe_kernels import MoELayer
from moe_kernels.kernels import permute_gluon
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

# the package's kernels that multiply by the expert weights, by name prefix (the router's cuBLAS gate and its grouped
# top-k are not among them)
GEMM_NAMES = ("_bf16_grouped", "_block_fp8_grouped", "_contiguous_gemm", "_index_gather_gemm", "_transposed_kernel",
              "_streamed_pair", "_one_launch", "_masked_gemm")
CALLS = 5
# calls before the timed ones: a repeated call is replayed from its second call and captured as a CUDA graph at its
# fourth (_replay_graphs.REPLAYS_BEFORE_GRAPH), which must not land among the timed calls
WARMUP_CALLS = 6
WALL_CALLS = 10

device = "cuda" if torch.cuda.is_available() else "cpu"
models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "block"]
# LAYER_PROFILE_SWITCHES="BF16_TMA_STORE_GEMM1=True,...": permute_gluon's switches set for the run (a Python literal)
for setting in filter(None, os.environ.get("LAYER_PROFILE_SWITCHES", "").split(",")):
    name, value = setting.split("=")
    if not hasattr(permute_gluon, name):
        sys.exit(f"LAYER_PROFILE_SWITCHES: permute_gluon has no switch {name}")
    setattr(permute_gluon, name, ast.literal_eval(value))
if device == "cpu":
    batches, formats = [3], ["none"]


def kernels_of(prof):
    """Each GPU kernel's name, launches a call and microseconds a call (CUPTI's durations), longest first."""
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or 0
        if us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"name": event.key[:120], "launches": event.count / CALLS, "us": us / CALLS})
    return sorted(rows, key=lambda r: -r["us"])


rows = []
for key in models:
    model = dataclasses.replace(MODELS[key], num_shared_experts=0)
    shrink = {} if device == "cuda" else {"hidden_size": 128, "intermediate_size": 128}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = MoELayer.random(model, dtype=dtype, device=device, seed=0, layout="auto", **shrink)
    d = shrink.get("hidden_size", model.hidden_size)
    f = shrink.get("intermediate_size", model.moe_intermediate_size)
    for fmt in formats:
        layer = base if fmt == "none" else base.quantized(fmt)
        layer.layout = "auto"
        for batch in batches:
            x = torch.randn(batch, d, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(batch))
            plan = layer.plan(batch)
            for _ in range(WARMUP_CALLS):
                layer(x)
            if device == "cpu":
                print(f"{key} {fmt} {batch}: ran ({plan.layout})")
                continue
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(WALL_CALLS):   # the calls back to back, as a caller makes them (no profiler)
                layer(x)
            end.record()
            torch.cuda.synchronize()
            wall_us = start.elapsed_time(end) * 1e3 / WALL_CALLS
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    layer(x)
                torch.cuda.synchronize()
            kernels = kernels_of(prof)
            gemm_us = sum(k["us"] for k in kernels if k["name"].startswith(GEMM_NAMES))
            total_us = sum(k["us"] for k in kernels)
            flops = batch * model.top_k * 6 * d * f
            row = {"model": key, "format": fmt, "batch": batch, "layout": plan.layout, "gemm": plan.gemm,
                   "align": plan.align, "wall_us": wall_us, "kernels": kernels, "kernels_us": total_us,
                   "gemm_us": gemm_us,
                   "other_us": total_us - gemm_us, "routed_flops": flops,
                   "tflops_kernels": flops / (total_us * 1e-6) / 1e12 if total_us else None,
                   "tflops_gemms": flops / (gemm_us * 1e-6) / 1e12 if gemm_us else None}
            rows.append(row)
            record_tool("layer-profile", rows, {"calls": CALLS, "layout": "auto", "shared_expert": "left out",
                                                "gemm_names": GEMM_NAMES, "l2": "warm", "dtype": str(dtype),
                                                "wall_calls": WALL_CALLS,
                                                "switches": os.environ.get("LAYER_PROFILE_SWITCHES", "")})
            print(f"{key} {fmt} {batch} ({plan.layout} {plan.gemm or ''}): wall {wall_us:.1f} us, "
                  f"kernels {total_us:.1f} us "
                  f"({row['tflops_kernels']:.0f} TFLOP/s), GEMMs {gemm_us:.1f} ({row['tflops_gemms']:.0f}), "
                  f"other {total_us - gemm_us:.1f}", flush=True)
            for k in kernels[:9]:
                print(f"   {k['us']:9.1f} us x{k['launches']:.0f}  {k['name'][:90]}", flush=True)
        del layer
    del base
    if device == "cuda":
        torch.cuda.empty_cache()
