"""Issue 18: the bf16 GEMM 1 reading its rows from the tokens (``bf16_grouped(row_assignments=)``, cp.async copies)
against the permute layout's one-pass scatter followed by GEMM 1 on the packed rows (TMA), each alone.

Why: in the layer (``layer-layout-ab-bf16-gathered-s35.json``) the gathered GEMM 1 won 1.5-7% at 2,048-4,096
tokens and lost 4-13% at 16,384, where the profile had GEMM 1 itself 16-20% slower: this times the pieces apart
(the scatter, GEMM 1 on packed rows, the two together, GEMM 1 gathered) with the tiles the layer takes
(``permute_gluon.gate_up_stages``), replayed from CUDA graphs with the L2 flushed, two rounds, the lower median.
Each GEMM 1 also with its W tile in quarters (``_gluon_bf16_persistent.INTERLEAVE_GATED``, four TMA copies a
step, as before session 35) against halves (two). The gathered product's real rows are checked against the packed
one's first (padding rows differ: the scatter leaves them unwritten, the gather reads zeros). ``GATHER_AB_NCU=1``:
no timing, GEMM 1 packed then gathered once each after a warm-up call of each (for
``ncu --kernel-name regex:_bf16 --launch-skip 2 --launch-count 2``).

    PYTHONPATH=. python tools/gather_gemm1_ab.py [models] [batches]   # GPU (sm_90, Triton 3.6): records gather-gemm1-ab
"""
import os
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
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2048, 4096, 16384]
NCU = os.environ.get("GATHER_AB_NCU") == "1"
rows = []
for key in models:
    model = MODELS[key]
    e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    w1, _ = make_weights(model, torch.bfloat16, seed=0)   # (made in bf16: DeepSeek-V3's in fp32 took 30 GB)
    for batch in batches:
        hidden, _, _, ids = make_batch(model, batch, torch.bfloat16, seed=batch)
        permuted = permute(hidden, ids, e, align=128, validate_ids=False, copy=False)
        num_rows, top_k = permuted.m_indices.shape[0], ids.shape[1]
        stages, tma_store = permute_gluon.gate_up_stages(permute_gluon.BF16_TILES["gate_up"][1], ids.numel(), e)
        tiles = dict(gated=True, block_n=permute_gluon.BF16_TILES["gate_up"][0], stages=stages, tma_store=tma_store,
                     validate_ids=False)
        packed = scatter_rows(hidden, permuted.src2dst, num_rows)
        out = torch.empty(num_rows, f, device="cuda", dtype=torch.bfloat16)

        def gemm_packed():
            return bf16_grouped(packed, w1, permuted.m_indices, permuted.rows_used, out=out, **tiles)

        def gemm_gathered():
            return bf16_grouped(hidden, w1, permuted.m_indices, permuted.rows_used, out=out,
                                row_assignments=permuted.row_assignments, top_k=top_k, **tiles)

        def quarters(call):
            """``call`` with the gated W tile loaded in quarters (``INTERLEAVE_GATED``: four TMA copies a step)."""
            def with_quarters():
                kernel.INTERLEAVE_GATED = True
                try:
                    return call()
                finally:
                    kernel.INTERLEAVE_GATED = False
            return with_quarters

        def scatter_then_packed():
            rows_now = scatter_rows(hidden, permuted.src2dst, num_rows)
            return bf16_grouped(rows_now, w1, permuted.m_indices, permuted.rows_used, out=out, **tiles)

        if NCU:
            for call in (gemm_packed, gemm_gathered, gemm_packed, gemm_gathered):
                call()
            torch.cuda.synchronize()
            continue
        real = permuted.m_indices >= 0
        want = gemm_packed()[real].clone()
        for name, call in (("gathered", gemm_gathered), ("packed, quarters", quarters(gemm_packed)),
                           ("gathered, quarters", quarters(gemm_gathered))):
            assert torch.equal(call()[real], want), f"GEMM 1 {name}: its real rows differ from the packed rows'"
        candidates = {"scatter": lambda: scatter_rows(hidden, permuted.src2dst, num_rows),
                      "gemm1 packed": gemm_packed, "scatter + gemm1 packed": scatter_then_packed,
                      "gemm1 gathered": gemm_gathered, "gemm1 packed quarters": quarters(gemm_packed),
                      "gemm1 gathered quarters": quarters(gemm_gathered)}
        lowest, rounds, errors, _ = time_lowest(candidates, out, tolerance=0.0, warmup_ms=5, rep_ms=30,
                                                unchecked=tuple(candidates), rounds=2, alternate=True)
        flops = ids.numel() * 2 * d * 2 * f
        row = {"model": key, "batch": batch, "stages": stages, "tma_store": tma_store, "us": lowest,
               "rounds_us": rounds, "errors": errors, "rows_per_expert": ids.numel() / e,
               "tflops": {name: flops / (us * 1e-6) / 1e12 for name, us in lowest.items() if "gemm1" in name}}
        rows.append(row)
        record_tool("gather-gemm1-ab", rows, {"method": "CUDA graph of one call, L2 flushed, two rounds, lower median",
                                              "flops": "T k 2 d 2F (GEMM 1, gated)"})
        print(f"{key} {batch} ({row['rows_per_expert']:.0f} rows an expert, {stages} stages): " + "  ".join(
            f"{name} {us:.1f} us" + (f" ({row['tflops'][name]:.0f})" if name in row["tflops"] else "")
            for name, us in lowest.items()) + (f"  errors {errors}" if errors else ""), flush=True)
    del w1
    torch.cuda.empty_cache()
