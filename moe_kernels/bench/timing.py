"""Two ways to time a GPU call, and why both are reported.

* :func:`eager_us`: ``triton.testing.do_bench`` around the Python call (CUDA events, L2 flushed
  before each call, median). It includes whatever the host adds (argument checks, the launcher)
  when that is longer than the GPU's queue of work: what a caller that launches kernels one by
  one sees.
* :func:`graph_us`: the same call captured ``calls`` times into a CUDA graph and replayed; the time
  per call is what the GPU spends with launch overhead gone, which is how serving engines run a
  decode step (vLLM and SGLang capture it in CUDA graphs). Returns None for a call that cannot be
  captured (one that synchronises with the host, say).

Needs a CUDA GPU.
"""

from __future__ import annotations

import torch


def eager_us(fn, warmup_ms: int = 10, rep_ms: int = 50) -> float:
    from triton.testing import do_bench

    return 1e3 * float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_us(fn, calls: int = 20, replays: int = 20):
    """Microseconds per call of ``fn`` replayed from a CUDA graph, or None if it cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]
