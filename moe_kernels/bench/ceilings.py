"""Measure the ceilings every floor is built from: HBM bandwidth and the dense GEMM rates.

Datasheet figures are leads; what a kernel can reach is what the same GPU reaches on a plain
device-to-device copy and a large matrix product, measured in the same run. Times are medians
from ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs). Needs a CUDA GPU.

Example (on a GPU)::

    bw = measure_hbm_bandwidth()          # bytes/s, counting bytes read plus bytes written
    rate = measure_gemm_rate()            # FLOP/s of an 8192^3 bf16 matmul on random data
"""

from __future__ import annotations

import sys

import torch

from .read_kernel import weight_reader
from .timing import graphed, median_ms
from .cli import add_record_arguments, write_record


def _require_cuda(func: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{func}: needs a CUDA GPU (none is visible to torch)")


def _median_ms(fn) -> float:
    return median_ms(fn, warmup_ms=25, rep_ms=200)


def measure_read_bandwidth(nbytes: int = 4 * 1024**3, block: int = 8192) -> float:
    """Bytes per second of a streaming read of ``nbytes`` (far beyond the L2): the ceiling for
    weight streaming, which only reads. Higher than the copy figure, whose writes cost more."""
    _require_cuda("measure_read_bandwidth")
    n = nbytes // 4 // block * block
    ms = _median_ms(weight_reader(torch.rand(n, device="cuda"), block=block))
    return 4 * n / (ms * 1e-3)


def measure_read_time_by_size(sizes=tuple(2**i * 1024**2 for i in range(3, 13)), block: int = 8192) -> list[dict]:
    """Seconds to stream-read ``sizes`` bytes in one kernel replayed from a CUDA graph (L2 flushed),
    as a layer's GEMM reads its weights: a small read pays the launch, the ramp and the tail that
    the 4 GiB ceiling hides. One ``{"bytes", "seconds"}`` per size."""
    _require_cuda("measure_read_time_by_size")
    out = []
    for nbytes in sizes:
        n = max(nbytes // 4 // block, 1) * block
        reader = weight_reader(torch.rand(n, device="cuda"), block=block)   # kept alive: the graph reads its tensor
        out.append({"bytes": 4 * n, "seconds": _median_ms(graphed(reader)) * 1e-3})
        del reader
    return out


def measure_hbm_bandwidth(nbytes: int = 2 * 1024**3) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write counted)."""
    _require_cuda("measure_hbm_bandwidth")
    src = torch.randint(0, 127, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def measure_gemm_rate(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP per second of an ``n x n x n`` matmul on random data (never zeros: they run faster)."""
    _require_cuda("measure_gemm_rate")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = _median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


def measure_fp8_gemm_rate(n: int = 8192) -> float:
    """FLOP per second of an ``n^3`` fp8 (e4m3) matmul with per-tensor scales, bf16 output."""
    _require_cuda("measure_fp8_gemm_rate")
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).T  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = _median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms * 1e-3)


def measure_all() -> dict:
    """Every ceiling (the fp8 rate where torch supports it), in SI units. ``read_bandwidth`` is
    the one weight-streaming floors use; ``hbm_bandwidth`` (the copy) is kept for reference."""
    data = {"read_bandwidth": measure_read_bandwidth(), "hbm_bandwidth": measure_hbm_bandwidth(),
            "gemm_rate_bf16": measure_gemm_rate()}
    try:
        data["gemm_rate_fp8"] = measure_fp8_gemm_rate()
    except (RuntimeError, AttributeError) as err:  # older torch or a GPU without fp8
        data["gemm_rate_fp8"] = None
        data["fp8_error"] = str(err)
    return data


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench ceilings",
                                     description="Measure HBM read and copy bandwidth and dense GEMM rates.")
    add_record_arguments(parser, "ceilings")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench ceilings: needs a CUDA GPU", file=sys.stderr)
        return 2
    data = measure_all()
    data["read_by_size"] = measure_read_time_by_size()
    for point in data["read_by_size"]:
        print(f"read {point['bytes'] / 2**20:7.0f} MiB in {point['seconds'] * 1e6:8.1f} us: "
              f"{point['bytes'] / point['seconds'] / 1e12:.2f} TB/s")
    print(f"read {data['read_bandwidth'] / 1e12:.2f} TB/s, copy {data['hbm_bandwidth'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {data['gemm_rate_bf16'] / 1e12:.0f} TFLOP/s"
          + (f", fp8 GEMM {data['gemm_rate_fp8'] / 1e12:.0f} TFLOP/s" if data["gemm_rate_fp8"] else ""))
    if args.record:
        write_record(args.name or "ceilings", data, args.results_dir)
    return 0


class ReadFloor:
    """The A/B scripts' floor (``tools/*_ab.py``): the read bandwidth and a plain read's time by size,
    measured once in the process (:func:`measure_read_bandwidth`, :func:`measure_read_time_by_size`);
    without a GPU, placeholders (1 TB/s, no curve)."""

    def __init__(self, device):
        if torch.device(device).type == "cuda":
            self.bandwidth, self.by_size = measure_read_bandwidth(), measure_read_time_by_size()
            print(f"read bandwidth {self.bandwidth / 1e12:.2f} TB/s", flush=True)
        else:
            self.bandwidth, self.by_size = 1e12, None

    def of_experts(self, ids: torch.Tensor, w1, w1_scale, w2, w2_scale) -> dict:
        """A row's floor fields: the experts ``ids`` touch, their weight bytes (scales included), the
        bytes over the read bandwidth, and a plain read of those bytes (None without a GPU), in us."""
        from ..model.costs import read_seconds

        touched = int(torch.unique(ids).numel())
        nbytes = touched * (w1[0].numel() + w2[0].numel()) * w1.element_size()
        if w1_scale is not None:
            nbytes += touched * (w1_scale[0].numel() + w2_scale[0].numel()) * 4
        return {"experts_touched": touched, "bytes": nbytes, "floor_us": nbytes / self.bandwidth * 1e6,
                "read_same_bytes_us": read_seconds(self.by_size, nbytes) * 1e6 if self.by_size else None}
