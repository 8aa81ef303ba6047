"""Live measurements for a reader with a GPU: the same timers and ceilings the benchmarks use.

Notebooks import these (not the benchmark modules) so that a GPU-workstation reader sees timings
of their own device beside the recorded H200 numbers. Every function needs a CUDA GPU.
"""

from __future__ import annotations

from ..bench.ceilings import measure_fp8_gemm_rate, measure_gemm_rate, measure_hbm_bandwidth, measure_read_bandwidth
from ..bench.problems import make_batch, make_weights
from ..bench.timing import eager_us, graph_us, graphed

__all__ = ["eager_us", "graph_us", "graphed", "make_batch", "make_weights", "measure_fp8_gemm_rate", "measure_gemm_rate",
           "measure_hbm_bandwidth", "measure_read_bandwidth"]
