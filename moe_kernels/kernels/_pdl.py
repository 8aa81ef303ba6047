"""Programmatic dependent launch (Hopper): GEMM 2 starts before GEMM 1 ends.

Two kernels on one stream normally run strictly one after the other: the second is launched when
the first has finished and its writes are visible, and between the two the GPU idles for the
launch's latency, a few microseconds. At decode that gap is not small: Qwen3-30B-A3B's GEMM 2
at batch 1 reads 25 MB of weights in about 18 us. And GEMM 2 does not need GEMM 1 for most of
what it reads: its *weights* are constants, only its activations are GEMM 1's output.

Hopper's programmatic dependent launch (CUDA's ``PROGRAMMATIC_STREAM_SERIALIZATION`` launch
attribute; Triton's ``launch_pdl=True``) splits the dependency in two PTX instructions:

* ``griddepcontrol.launch_dependents`` (``tl.extra.cuda.gdc_launch_dependents``), in the first
  kernel: once every one of its programs has executed it (or exited), the next kernel may launch,
  and its programs take SM slots as they free up;
* ``griddepcontrol.wait`` (``gdc_wait``), in the second kernel: blocks until the first kernel has
  finished and its memory is visible. Before it, the second kernel may only touch what the first
  does not write.

So GEMM 1 signals as soon as each program starts (:data:`TRIGGER`), and each GEMM 2 program,
before it waits, may prefetch the first :data:`PREFETCH_K` columns of its own weight tile (its
``BLOCK_N`` rows of the expert its block serves) into L2 with ``prefetch.global.L2``, one
instruction per 128-byte line, then waits, then runs as before.

Measured on an H200 (CUDA-graph replays, L2 flushed, the experts call with and without; the
notes' session 10): prefetching the whole tile made the call 3-24% *slower* (DeepSeek-V3 bf16 at
64 tokens 4.27 -> 5.30 ms: the resident GEMM 2 programs ask for far more than the 50 MB of L2
holds, so lines are fetched twice); without a prefetch, or with the first 256 columns, or with
the signal moved to each program's end, the call is within 1.5% of the plain launch either way
(Qwen3-30B-A3B 1 and 8 tokens, DeepSeek-V3 1 token, bf16 and fp8). A CUDA graph already launches
GEMM 2 back to back with GEMM 1, so the gap PDL closes is small. The tuner keeps it off.

What a GEMM 2 program reads before the wait (the block map and the weights) was final before it
launched: GEMM 1 is launched normally, after the alignment finished, or, behind the chained router
(``run_experts``'s ``after_router``), as a dependent itself that reads nothing before its own wait
and lets GEMM 2 launch only after it. GEMM 2 therefore takes the dependent launch only inside the layer
(:func:`~moe_kernels.kernels.index_gather.run_experts`), right behind its own GEMM 1, never as a
stand-alone call. (In fp8 a quantiser runs between the two: GEMM 2 then launches as the quantiser
ends, and only the prefetch could overlap it.)

A speed setting (``MoEConfig.pdl``): on a GPU before Hopper, or under the interpreter (which has no
grids to overlap), it is off, with the same numbers.
"""

from __future__ import annotations

import functools

import torch

from .._runtime import HAS_TRITON, INTERPRET, kernel, tl

#: Bytes per L2 line: one prefetch instruction each.
LINE_BYTES = 128
#: Where GEMM 1 lets GEMM 2 launch: 1 as each program starts, 2 as it ends.
TRIGGER = 1
#: How many K columns of its weight tile GEMM 2 asks L2 for before it waits (-1: all, 0: none):
#: none by default, the whole tile measured slower (see above).
PREFETCH_K = 0


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on ``device`` can take a programmatic dependent launch (sm_90 or newer)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip is not None:   # (ROCm has no such launch)
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index) >= 9 and _has_gdc()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _has_gdc() -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:   # a Triton before 3.4
        return False
    return True


if HAS_TRITON:   # (the interpreter never takes the PDL branches: pdl_available is False there)
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (for the GEMM kernel)
    except ImportError:
        gdc_launch_dependents = gdc_wait = None

    @kernel
    def prefetch_rows_to_l2(row_ptrs, K, LINE: tl.constexpr, STEP: tl.constexpr):
        """Ask L2 for ``K`` elements of each row that starts at ``row_ptrs`` (every one a real row:
        the caller clamps), one ``prefetch.global.L2`` per ``LINE`` elements; nothing is loaded
        into registers."""
        lines = tl.arange(0, STEP) * LINE
        for k0 in range(0, K, LINE * STEP):
            cols = k0 + lines
            # Lines past the row's end ask for its first line again: no mask needed.
            ptrs = tl.where((cols < K)[None, :], row_ptrs[:, None] + cols[None, :], row_ptrs[:, None])
            tl.inline_asm_elementwise("{ prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
