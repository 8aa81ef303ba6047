"""The read kernel: a launch that only reads, the yardstick for kernels that stream weights.

Each program reads one tile of ``block`` numbers and stores their sum (one float a program, so that
the loads are not dropped and the traffic is reads only, as a GEMM streaming its weights). The
ceilings read 4 GiB with it (:func:`~moe_kernels.bench.ceilings.measure_read_bandwidth`), the sweeps
read a row's own bytes with it, and the timers' clean L2 flush reads a 256 MB buffer with it
(:func:`~moe_kernels.bench.timing.clean_flush`). :func:`weight_reader`'s docstring works an example.
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor, fail
from .._runtime import HAS_TRITON, kernel, tl

__all__ = ["weight_reader"]

if HAS_TRITON:

    @kernel
    def _read_kernel(x_ptr, partial_ptr, BLOCK: tl.constexpr):
        # One tile per program, read once and reduced: the traffic is reads only, like a GEMM
        # streaming its weights (the one-float write per program is 1/BLOCK of the bytes).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs), axis=0))


def weight_reader(*tensors: torch.Tensor, block: int = 8192):
    """A function that reads each of ``tensors`` once with the read kernel, one launch per tensor,
    as a layer's GEMMs stream their weights one launch after another: time it beside them (by the
    same method, e.g. from the same kind of CUDA graph) for what a kernel that does nothing but read
    those bytes takes. Each tensor must be contiguous, of ``4 * block`` bytes or a multiple; its
    bytes are read as float32 whatever its dtype (only the traffic matters: each program stores the
    sum of its ``block`` numbers).

        >>> w1, w2 = torch.ones(4, 16), torch.full((2, 16), 2.0)   # 256 and 128 bytes
        >>> [p.tolist() for p in weight_reader(w1, w2, block=16)()]   # 4 programs, then 2
        [[16.0, 16.0, 16.0, 16.0], [32.0, 32.0]]
    """
    func = "weight_reader"
    check_int(func, "block", block, lo=1)
    if block & (block - 1):
        fail(func, "block", "must be a power of two (the kernel's tl.arange)", block)
    if not tensors:
        fail(func, "tensors", "must hold at least one tensor", "none")
    views, partials = [], []
    for i, t in enumerate(tensors):
        check_tensor(func, f"tensors[{i}]", t, contiguous=True)
        if t.data_ptr() % 4:   # read as float32: a view that starts inside a word cannot be
            fail(func, f"tensors[{i}]", "must start on a 4-byte boundary", f"address {t.data_ptr():#x}")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes % (4 * block):
            fail(func, f"tensors[{i}]", f"must be a positive multiple of 4 * block = {4 * block} bytes",
                 f"{nbytes} bytes")
        views.append(t.reshape(-1).view(torch.uint8).view(torch.float32))
        partials.append(torch.empty(views[-1].numel() // block, device=t.device))

    def read():
        for x, partial in zip(views, partials):
            _read_kernel[(partial.numel(),)](x, partial, BLOCK=block, num_warps=8)
        return partials

    return read
