"""Which tensor-core instructions GEMM 1 compiles to at a 16-row M tile, plain and transposed
(``GemmTiles.swap_ab``), in bf16 and fp8 block: the SASS of the compiled kernel, read on a GPU.

Usage (on a CUDA GPU, from the repository root): ``PYTHONPATH=. python tools/sass_check.py``.
Prints one line per variant: the format, plain or swap, then HGMMA / HMMA / QGMMA where the SASS
holds them (Hopper's bf16 wgmma, mma.sync, Hopper's fp8 wgmma), and the SASS length.
"""

import re

import torch

from moe_kernels.kernels.blocks import assign_blocks
from moe_kernels.kernels.config import GemmTiles
from moe_kernels.kernels.formats import FORMATS
from moe_kernels.kernels.index_gather import _index_gather_gemm_kernel, expert_gate_up


def last_compiled(kernel):
    """The kernel the JIT compiled last (Triton keeps one cache per device)."""
    compiled = None
    for cache in kernel.device_caches.values():
        for compiled in (cache[0] if isinstance(cache, tuple) else cache).values():
            pass
    return compiled


for name in ("none", "block"):
    for swap in (False, True):
        fmt = FORMATS[name]
        x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
        w, w_scale = fmt.quantize_weight(torch.randn(16, 1536, 2048, device="cuda", dtype=torch.bfloat16) * 0.02)
        x, x_scale = fmt.quantize_activations(x)
        blocks = assign_blocks(torch.randint(0, 16, (8, 4), device="cuda", dtype=torch.int32), 16, 16)
        _index_gather_gemm_kernel.device_caches.clear()
        expert_gate_up(x, w, blocks, 4, tiles=GemmTiles(64, 128, 1, 4, 3, swap_ab=swap), a_scale=x_scale,
                       w_scale=w_scale, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        sass = last_compiled(_index_gather_gemm_kernel).asm["sass"]
        found = [op for op, pattern in (("HGMMA", r"HGMMA"), ("HMMA", r"\bHMMA"), ("QGMMA", r"QGMMA"))
                 if re.search(pattern, sass)]
        print(name, "swap" if swap else "plain", " ".join(found) or "-", len(sass))
