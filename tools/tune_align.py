"""Try alignment launch settings on a GPU: CUDA-graph time per call for each variant and batch.

Usage (on the GPU machine): PYTHONPATH=. python3 tools/tune_align.py
Variants change the module constants of moe_kernels.kernels.align; every output is checked against the
reference before it is timed.
"""

import itertools

import torch

from moe_kernels.kernels import align
from moe_kernels.bench.timing import graph_us

E, K = 256, 8
batches = (64, 256, 512, 1024, 2048)
variants = [dict(SINGLE_LAUNCH_MAX_NUMEL=s, _SINGLE_TILE=t, _SINGLE_WARPS=w, _MULTI_TILE=t, _MULTI_WARPS=w)
            for s, t, w in itertools.product((0, 2048, 8192), (64, 128, 256), (4, 8))]
defaults = {name: getattr(align, name) for name in variants[0]}
gen = torch.Generator(device="cuda").manual_seed(0)
for B in batches:
    ids = torch.rand(B, E, device="cuda", generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    block = 64 if B <= 512 else 128
    ref = align.moe_align_block_size_reference(ids, block, E)
    results = []
    for v in variants:
        for name, value in v.items():
            setattr(align, name, value)
        try:
            out = align.moe_align_block_size(ids, block, E, validate_ids=False)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
            results.append((graph_us(lambda: align.moe_align_block_size(ids, block, E, validate_ids=False)), v))
        except Exception as err:  # noqa: BLE001
            print("failed", v, type(err).__name__, str(err)[:120])
    for name, value in defaults.items():
        setattr(align, name, value)
    results.sort(key=lambda r: r[0])
    print(f"B={B}: best " + "; ".join(f"{t:.1f} us {v}" for t, v in results[:4]), flush=True)
