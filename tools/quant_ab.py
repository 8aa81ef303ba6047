"""Issue 18: the activation quantiser's program tile, and the permute layout's fp8 input in one pass.

Two A/Bs, each a CUDA graph of one call (``timing.graph_us``), bytes over the read bandwidth measured in the
same process beside them:

1. ``quant.QUANT_TILE`` (rows, column groups a program) on the quantiser's inputs at prefill and decode:
   DeepSeek-V3's and Qwen3-30B-A3B's GEMM 2 input at 16,384 tokens (``M_pad x F``), their hidden states
   ``[T, d]``, and 64 decode tokens. The package's (4, 1) read 1 KiB of bf16 a program.
2. The block-fp8 permute layout's input: ``quant_scatter.quantize_scatter`` (one pass: each token quantised
   once, written to its k rows) against the three steps it replaces (the quantiser, the scatter of the fp8
   rows, the scales' gather), both after the same alignment (``permute(copy=False)``, timed alone too).

    PYTHONPATH=. python tools/quant_ab.py   # GPU: records results/<device>/quant-ab.json
"""
import torch

from moe_kernels.bench.ceilings import measure_read_bandwidth
from moe_kernels.bench.timing import graph_us
from moe_kernels.kernels import permute as permute_module
from moe_kernels.kernels import quant
from moe_kernels.kernels.quant_scatter import quantize_scatter
from moe_kernels.results import record_tool

TILES = [(4, 1), (8, 1), (4, 2), (8, 2), (4, 4), (8, 4), (16, 4), (2, 8), (4, 8), (1, 16)]
SHAPES = {"deepseek-v3 gemm 2 input, 16384 tokens": (163584, 2048),
          "qwen3-30b-a3b gemm 2 input, 16384 tokens": (147328, 768),
          "deepseek-v3 hidden, 16384 tokens": (16384, 7168),
          "qwen3-30b-a3b hidden, 16384 tokens": (16384, 2048),
          "deepseek-v3 hidden, 64 tokens": (64, 7168),
          "deepseek-v3 gemm 2 input, 64 tokens": (512, 2048)}
PERMUTES = {"deepseek-v3": (7168, 256, 8), "qwen3-30b-a3b": (2048, 128, 8)}

bandwidth = measure_read_bandwidth()
rows = []


def save():   # after every row: a run cut short keeps what it measured
    record_tool("quant-ab", rows, {"read_bandwidth_bytes_per_s": bandwidth, "timing": "CUDA graph of one call, L2 warm",
                                   "tiles": TILES})


saved = quant.QUANT_TILE
try:
    for name, (m, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        floor = m * k * 3.0 / bandwidth * 1e6   # bf16 in, fp8 out (the scales: 1/64 more)
        us = {}
        for tile in TILES:
            quant.QUANT_TILE = tile
            us[str(tile)] = graph_us(lambda: quant.per_token_group_quant_fp8(x, 128))
        rows.append({"ab": "quant tile", "shape": name, "m": m, "k": k, "us": us, "bytes_floor_us": floor})
        save()
        timed = {t: v for t, v in us.items() if v is not None}   # (None: the capture failed)
        best = min(timed, key=timed.get) if timed else None
        print(f"{name:<44} floor {floor:8.1f} us   " + "  ".join(f"{t} {v:.1f}" for t, v in timed.items())
              + f"   best {best}", flush=True)
        del x
finally:
    quant.QUANT_TILE = saved

for model, (d, experts, k) in PERMUTES.items():
    for tokens in (64, 4096, 16384):
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda").argsort(1)[:, :k].contiguous()
        p = permute_module.permute(x, ids, experts, copy=False, validate_ids=False)
        xq, xs = quant.per_token_group_quant_fp8(x, 128)

        def three_steps():
            q, s = quant.per_token_group_quant_fp8(x, 128)
            packed = permute_module.permute(q, ids, experts, validate_ids=False)
            return packed, packed.rows, permute_module._permute_scales(s, packed, k)

        def one_pass():
            packed = permute_module.permute(x, ids, experts, copy=False, validate_ids=False)
            return (packed, *quantize_scatter(x, packed.src2dst, packed.m_indices.shape[0]))
        us = {"alignment alone (copy=False)": graph_us(lambda: permute_module.permute(x, ids, experts, copy=False,
                                                                                    validate_ids=False)),
              "three steps": graph_us(three_steps), "one pass": graph_us(one_pass),
              "quantize_scatter alone": graph_us(lambda: quantize_scatter(x, p.src2dst, p.m_indices.shape[0]))}
        # (each path's own slots: an alignment may order a segment's rows differently from call to call)
        packed_q, rows_q, scales_q = one_pass()
        packed_3, rows_3, scales_3 = three_steps()
        dst_q, dst_3 = packed_q.src2dst.flatten().long(), packed_3.src2dst.flatten().long()
        same = bool(torch.equal(rows_q[dst_q].view(torch.uint8), rows_3[dst_3].view(torch.uint8))
                    and torch.equal(scales_q[dst_q], scales_3[dst_3]))
        floor = (tokens * d * 2 + tokens * k * d) / bandwidth * 1e6
        rows.append({"ab": "permute input", "model": model, "tokens": tokens, "us": us, "same_bits": same,
                     "bytes_floor_us": floor})
        save()
        print(f"{model:<14} {tokens:>6}: " + "  ".join(f"{n} {v:.1f}" for n, v in us.items() if v is not None)
              + f"   floor {floor:.1f}   same bits {same}", flush=True)
        del x, p, xq, xs
