"""Where one eager decode step's time goes (``bench model --profile-batches``): torch's profiler
over a few steps, its kernels and operations ranked by GPU time and by host time, and the host
time spent inside the experts implementation (a profiler range wrapped around each of its calls
through transformers' experts registry).

    profile = profile_step(step, "moe_kernels", "cuda")
    profile["by_gpu_time"][0]   # {"name": ..., "calls_per_step": ..., "us_per_step": ...}
"""

from __future__ import annotations

import torch

from .model_timing import synchronize


def profile_step(step, impl: str, device, *, steps: int = 3, top: int = 15) -> dict:
    """Where one eager step's time goes, from torch's profiler over ``steps`` steps: the kernels
    and operations with the most GPU time and the most host time per step, and the host time spent
    inside the experts implementation (a profiler range around each of its calls)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = ALL_EXPERTS_FUNCTIONS[impl] if impl in ALL_EXPERTS_FUNCTIONS.keys() else None

    def ranged(*args, **kwargs):
        with record_function("experts implementation"):
            return experts(*args, **kwargs)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    if experts is not None:
        ALL_EXPERTS_FUNCTIONS.register(impl, ranged)
    try:
        step()
        synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            synchronize(device)
    finally:
        if experts is not None:
            ALL_EXPERTS_FUNCTIONS.register(impl, experts)
    events = prof.key_averages()

    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    def table(time_of):
        ranked = sorted(events, key=time_of, reverse=True)[:top]
        return [{"name": e.key[:140], "calls_per_step": e.count / steps, "us_per_step": time_of(e) / steps}
                for e in ranked]

    ranges = [e for e in events if e.key == "experts implementation"]
    return {"steps": steps, "by_gpu_time": table(device_us), "by_host_time": table(lambda e: e.self_cpu_time_total),
            "gpu_us_per_step": sum(device_us(e) for e in events) / steps,
            "experts_host_us_per_step": ranges[0].cpu_time_total / steps if ranges else None,
            "experts_calls_per_step": ranges[0].count / steps if ranges else None}
