"""What the compiler makes of every entry of the tuned index-gather tables, for sm_90 under the H200's
Triton (3.6), on this machine, with no GPU: a check that costs no device time.

The tables name tiles; what runs is what Triton and ptxas make of them. Two such surprises have been
found by reading the compiled code rather than timing it: a 16-row tile compiles to ``mma.sync``, not
Hopper's wgmma (hence ``swap_ab``), and ``persistent=2`` compiled to exactly ``persistent=1``'s code
until Session 25 (the loops were never flattened). For each routed-experts table (both models, bf16
and fp8 block) and each entry, GEMM 1 (gate and up, SiLU·mul) and GEMM 2 (times the routed weight,
or the top-k sum in its epilogue where the entry says so) are compiled as the layer launches them at
that token count (the naive block map where vLLM's rule takes it); for each shared expert's table (E=1) as
``dense_expert`` launches them (the dense block map: every token, no ids, no weight); and one line says:

  mma        wgmma (Hopper's warpgroup MMA) or mma.sync, and the tensor-core instructions in the SASS:
             HGMMA (16-bit wgmma), QGMMA (fp8 wgmma) or HMMA (f16 mma.sync). For an fp8 tile on mma.sync
             Triton 3.6 upcasts the operands to f16 (``cvt.rn.f16x2.e4m3x2``, F2FP in the SASS, on the
             CUDA cores) and multiplies on HMMA (flagged, with the kernel's F2FP count, epilogue included)
  dot wait   the pendings of each ``warp_group_dot_wait`` in the TTGIR: 0 after every product means the
             MMAs of consecutive K steps never overlap (the block-fp8 promotion waits for each product)
  pipeline   the software pipeline's ring of shared-memory tiles (stages x: the tiles a K step loads)
             and what fills it: TMA bulk copies, cp.async (pointer loads the pipeline issues ahead), or
             plain loads (none pipelined; the ring is then 1)
  loops      1 if the persistent grid's tile and K loops are one flattened loop, else the nesting
  regs       ptxas's registers per thread, and its spill stores (bytes)

Entries whose streams (``stream_lag``), quantising epilogue (``quant_in_gemm``) or programmatic dependent
launch (``pdl``) change the launch are compiled without them (the two GEMMs as two plain launches), and say so.

    PYTHONPATH=/tmp/t36 python tools/table_audit.py [tokens,...] [name prefix]   # Triton 3.6: pip install --target
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

torch.cuda.is_available = lambda: True   # compiled (not interpreted) kernels; nothing is launched

import triton  # noqa: E402

from moe_kernels.kernels import index_gather as ig  # noqa: E402
from moe_kernels.kernels.blocks import use_naive_block_assignment  # noqa: E402
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90, loop_nesting  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TABLES = ROOT / "moe_kernels" / "kernels" / "configs"
ALIGNED = ("stride_am", "stride_we", "stride_wn", "stride_om", "N", "K", "stride_as", "stride_wse", "stride_wsn")


def tables():
    """(name, E, F, d, fp8, path, top_k) of each index-gather table in the package: a model's routed experts (its
    top-k), with its shared expert as slot E (E + 1 experts, top-(k+1), ``tune --fused-shared``), or a shared
    expert alone (E=1, top_k 1: the dense block map); the name says the GPU where it is not the H200."""
    from moe_kernels.model.shapes import MODELS

    for path in sorted(TABLES.glob("*layout=index_gather.json")):
        fields = dict(part.split("=") for part in path.stem.split(","))
        e, f, d = int(fields["E"]), int(fields["N"]), int(fields["K"])
        shape = [(m.top_k, 0) for m in MODELS.values() if (m.num_experts, m.moe_intermediate_size, m.hidden_size)
                 == (e, f, d)] + [(m.top_k + 1, 1) for m in MODELS.values() if m.num_shared_experts == 1
                                  and (m.num_experts + 1, m.moe_intermediate_size, m.hidden_size) == (e, f, d)]
        top_k = 1 if e == 1 else shape[0][0] if shape else 8
        gpu = fields["device"].replace("NVIDIA_", "").split("_")[0]
        yield (f"E={e} {'fp8' if 'float8' in fields['dtype'] else 'bf16'}" + ("" if gpu == "H200" else f" ({gpu})"),
               e, f, d, "float8" in fields["dtype"], path, top_k)


def build(tiles: dict, *, block_m: int, gated: bool, fp8: bool, naive: bool, top_k: int, summed: int,
          routed_weight: bool, dense: bool = False, k: int | None = None):
    """The index-gather GEMM compiled for sm_90 with one table entry's tiles, as launched."""
    dtype = "fp8e4nv" if fp8 else "bf16"
    tma, block_n, block_k = tiles["tma"], tiles["block_n"], tiles["block_k"]
    pointers = dict(a_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*fp32" if summed else "*bf16",
                    topk_weights_ptr="*fp32", sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
                    num_tokens_post_padded_ptr="*i32", a_scale_ptr="*fp32", w_scale_ptr="*fp32",
                    w_desc=f"tensordesc<{dtype}[{block_n}, {block_k}]>" if tma else "*" + dtype)
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=tiles["group_m"], TOP_K=top_k,
                 NAIVE_BLOCKS=naive, DENSE=dense, GATED=gated, MUL_ROUTED_WEIGHT=routed_weight,
                 EVEN_K=k is None or k % (block_k * tiles.get("k_chunks", 1)) == 0,   # (k: the GEMM's K, if known)
                 INPUT_PRECISION="tf32", SCALES=1 if fp8 else 0, SUM_TOP_K=summed, SPLIT_K=tiles["split_k"],
                 TMA_W=tma, PERSISTENT=tiles["persistent"], SCALE_BN=128, SCALE_BK=128, ID_CHECK="",
                 SWAP_AB=tiles["swap_ab"], PDL_TRIGGER=False, PDL_WAIT=False, PREFETCH_LINE=64, QUANT_GROUP=0,
                 ROUND_TO="", K_CHUNKS=tiles.get("k_chunks", 1))   # (a table holds k_chunks where it is not 1)
    return compile_for_sm90(ig._index_gather_gemm_kernel, const, pointers, aligned=ALIGNED,
                            num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def report(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    waits = sorted({int(n) for n in re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", ttgir)})
    # the pipeline's ring of shared-memory tiles: [stages, rows, K] buffers (the [stages, 1] ones are barriers)
    buffers = [int(n) for n, rows in re.findall(r"ttg\.local_alloc\s*: \(\) -> !ttg\.memdesc<(\d+)x(\d+)x\d+x", ttgir)
               if int(rows) > 1]
    by = ("TMA" if "cp.async.bulk.tensor" in ptx else "cp.async" if "cp.async" in ptx else "loads")
    built = assemble_for_sm90(ptx)
    # The SASS says what the tensor cores run: for an fp8 mma.sync tile Triton 3.6 upcasts to f16 (F2FP on the CUDA
    # cores) and issues HMMAs; wgmma is HGMMA (16-bit) or QGMMA (fp8).
    opcodes = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9]+)", built["sass"], re.M)
    tensor_ops = sorted({op for op in opcodes if op in ("HMMA", "HGMMA", "QGMMA")})
    conversions = sum(op == "F2FP" for op in opcodes)
    return {"mma": "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "-",
            "dot_wait": waits, "stages": max(buffers, default=1), "by": by,
            "loops": loop_nesting(ttgir), "regs": built["registers"], "spills": built["spill_stores"],
            "sass": tensor_ops, "f2fp": conversions}


def main(argv):
    only = {int(t) for t in argv[0].split(",")} if argv else None
    prefix = argv[1] if len(argv) > 1 else ""
    print(f"triton {triton.__version__}, sm_90a; {'GEMM':5s} = mma SASS | dot wait | pipeline | loops | regs/spills")
    rows = []
    for name, num_experts, f, d, fp8, path, top_k in tables():
        if not name.startswith(prefix):
            continue
        configs = json.loads(path.read_text())["configs"]
        dense = num_experts == 1   # (a shared expert alone: every token, no ids, no weight, no top-k sum)
        for tokens, config in sorted(configs.items(), key=lambda kv: int(kv[0])):
            if only and int(tokens) not in only:
                continue
            naive = not dense and use_naive_block_assignment(int(tokens), top_k, num_experts)
            summed = top_k if config.get("sum_in_gemm") and not dense else 0
            skipped = [s for s in ("stream_lag", "quant_in_gemm", "pdl") if config.get(s)]
            line = {}
            for gemm in ("gate_up", "down"):
                tiles = config[gemm]
                if gemm == "gate_up":
                    # GEMM 1 reads each token's row for its k slots; split over K it runs ungated, adding
                    # its K slices into fp32 sums (its SiLU·mul a launch of its own)
                    split = tiles["split_k"] > 1
                    kernel = build(tiles, block_m=config["block_m"], gated=not split, fp8=fp8, naive=naive,
                                   top_k=top_k, summed=1 if split else 0, routed_weight=False, dense=dense, k=d)
                else:
                    # GEMM 2's rows are the slots themselves (top_k 1), times their routing weights; split
                    # over K only with the top-k sum in its epilogue
                    if not summed and tiles["split_k"] > 1:
                        tiles = {**tiles, "split_k": 1}
                    kernel = build(tiles, block_m=config["block_m"], gated=False, fp8=fp8, naive=naive, top_k=1,
                                   summed=summed, routed_weight=not dense, dense=dense, k=f)
                line[gemm] = report(kernel)
            rows.append({"table": name, "tokens": int(tokens), **line})
            cells = [f"{g[:4]:4s} {r['mma']:8s} {'+'.join(r['sass']):5s} {','.join(map(str, r['dot_wait'])) or '-':3s} "
                     f"{r['stages']}x{r['by']:8s} {r['loops']} {r['regs']:3d}/{r['spills']}"
                     for g, r in line.items()]
            flags = [f"{g[:4]} spills" for g, r in line.items() if r["spills"]]
            flags += [f"{g[:4]} fp8 as f16 ({r['f2fp']} F2FP)" for g, r in line.items() if fp8 and "HMMA" in r["sass"]]
            print(f"{name:16s} {int(tokens):5d} {'naive' if naive else 'bm' + str(config['block_m']):5s} "
                  + " | ".join(cells) + (f"  ({', '.join(skipped)} not compiled)" if skipped else "")
                  + (f"  <- {', '.join(flags)}" if flags else ""), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
