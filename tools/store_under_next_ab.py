"""Issue 18: the bf16 GEMMs' TMA-store epilogue under the next tile's first wgmma (``_gluon_bf16_persistent.
STORE_UNDER_NEXT``) against in order, each GEMM alone at prefill sizes.

Why: on balanced routing the bf16 Gluon GEMM 2 of Qwen3-30B-A3B ran at 0.86 of ``torch.bmm`` (session 34,
``prefill-gemm-ab-bf16-balanced.json``): its K loop is twelve steps, and each tile's epilogue (the bf16 tile into
shared memory, the TMA copy out) kept the tensor cores idle. Issued after the next tile's first MMA, the epilogue
runs under it (the tile's bf16 values, 64 registers a thread at 128 x 256, held across). GEMM 1 and GEMM 2 with
the tiles the layer takes (``permute_gluon``: GEMM 1's 4 stages and TMA store from 256 rows an expert; GEMM 2 storing
by TMA), replayed from CUDA graphs with the L2 flushed, four rounds interleaved, the lowest median; the real rows
of the two outputs compared bit for bit first (padding rows hold whatever the packed buffer's did).

    PYTHONPATH=. python tools/store_under_next_ab.py [models] [batches]   # GPU: records store-under-next-ab
"""
import sys

import torch

from moe_kernels.bench.problems import make_batch, make_weights
from moe_kernels.bench.timing import time_lowest
from moe_kernels.kernels import _gluon_bf16_persistent as kernel, permute_gluon
from moe_kernels.kernels.gluon_bf16 import bf16_grouped
from moe_kernels.kernels.permute import permute
from moe_kernels.kernels.quant_scatter import scatter_rows
from moe_kernels.model.shapes import MODELS
from moe_kernels.results import record_tool

models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 16384]


def late(call, on):
    """``call`` with ``STORE_UNDER_NEXT`` set to ``on`` for it."""
    def with_switch():
        kernel.STORE_UNDER_NEXT = on
        try:
            return call()
        finally:
            kernel.STORE_UNDER_NEXT = False
    return with_switch


rows = []
for key in models:
    model = MODELS[key]
    e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    w1, w2 = make_weights(model, torch.bfloat16, seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    for batch in batches:
        hidden, _, _, ids = make_batch(model, batch, torch.bfloat16, seed=batch)
        permuted = permute(hidden, ids, e, align=128, validate_ids=False, copy=False)
        packed = scatter_rows(hidden, permuted.src2dst, permuted.m_indices.shape[0])
        (n1, stages1), (n2, stages2) = permute_gluon.BF16_TILES["gate_up"], permute_gluon.BF16_TILES["down"]
        stages1, tma1 = permute_gluon.gate_up_stages(stages1, ids.numel(), e, n1)
        activated = torch.randn(permuted.m_indices.shape[0], f, device="cuda", generator=g).to(torch.bfloat16)

        def gemm1():
            return bf16_grouped(packed, w1, permuted.m_indices, permuted.rows_used, gated=True, block_n=n1,
                                stages=stages1, tma_store=tma1, validate_ids=False)

        def gemm2():
            return bf16_grouped(activated, w2, permuted.m_indices, permuted.rows_used, block_n=n2, stages=stages2,
                                tma_store=permute_gluon.BF16_TMA_STORE, validate_ids=False)

        real = permuted.m_indices >= 0
        flops = {"gemm1": ids.numel() * 2 * d * 2 * f, "gemm2": ids.numel() * 2 * f * d}
        for name, call, applies in (("gemm1", gemm1, tma1), ("gemm2", gemm2, permute_gluon.BF16_TMA_STORE)):
            if not applies:
                continue
            candidates = {name: late(call, False), name + " store under next": late(call, True)}
            first, second = candidates[name](), candidates[name + " store under next"]()
            assert torch.equal(first[real], second[real]), f"{key} {batch} {name}: the two epilogues' outputs differ"
            lowest, rounds, errors, _ = time_lowest(candidates, first, tolerance=0.0, warmup_ms=5, rep_ms=30,
                                                    rounds=4, alternate=True, unchecked=tuple(candidates))
            row = {"model": key, "batch": batch, "gemm": name, "us": lowest, "rounds_us": rounds, "errors": errors,
                   "rows_per_expert": ids.numel() / e,
                   "tflops": {c: flops[name] / (us * 1e-6) / 1e12 for c, us in lowest.items()}}
            rows.append(row)
            record_tool("store-under-next-ab", rows, {"method": "CUDA graph of one call, L2 flushed, four rounds "
                                                      "interleaved, lowest median", "flops": "routed rows' (T k)"})
            print(f"{key} {batch} {name}: " + "  ".join(f"{c} {us:.1f} us ({row['tflops'][c]:.0f})"
                                                        for c, us in lowest.items())
                  + (f"  errors {errors}" if errors else ""), flush=True)
    del w1, w2
    torch.cuda.empty_cache()
