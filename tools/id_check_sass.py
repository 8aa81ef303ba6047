"""GEMM 1 with and without the naive map's id check, compiled for an H100/H200 (sm_90) on this
machine, no GPU needed (issue 16): what the checked build (``ID_CHECK`` set, ``debug=True``)
changes in the code the GPU runs. The tile is Qwen3-30B-A3B's fp8 one-token entry on the H200
(16 x 128 x 128, 4 warps, 4 stages, TMA weights, swap_ab, PDL trigger, the fp8 quantiser in the
epilogue). Prints, per build: ptxas's registers, stack and spills, the SASS's count of the
instructions that matter here (the call to ``__assertfail``, L2 prefetches, TMA loads, wgmma), and
where the first global load, the first TMA load and the call sit.

    pip install --no-deps --target /tmp/t36 triton==3.6.0   # the H200's Triton (.ci/run installs it too)
    PYTHONPATH=/tmp/t36:. python tools/id_check_sass.py [qwen3-1 | deepseek-v3-8]   # that Triton's ptxas

Under Triton 3.6.0, the Qwen3 tile: no stack, no spills either way; the same 8 TMA loads and 16
wgmma; the checked build adds one CALL (to ``__assertfail``, behind an untaken branch). With the
assert at the top of the tile (before session 16): 104 registers unchecked, 102 checked; the call
at 0x05e0, between the expert id's load and the first TMA load, which moved from 0x0c40 to 0x0d50.
With the assert after the tile's store: 104 and 104, the first TMA load at 0x0c40 in both, the
call at the end (0x53e0). DeepSeek-V3's tile, the assert after the store: 66 and 64 registers,
10 TMA loads and 8 wgmma in both, the first TMA load at 0x0d10 and 0x0cd0. Neither explains why
the checked fp8 GEMM 1 measured slower (2.9 us in Qwen3's kernel at one token).
"""
import os
import re
import sys

import torch

torch.cuda.is_available = lambda: True   # build compiled (not interpreted) kernels; nothing is launched
os.environ.pop("TRITON_INTERPRET", None)

from moe_kernels._runtime import device_assert_options  # noqa: E402
from moe_kernels.kernels import index_gather as ig  # noqa: E402
from moe_kernels.sm90_compile import assemble_for_sm90, compile_for_sm90  # noqa: E402
fn = ig._index_gather_gemm_kernel
#: GEMM 1's fp8 tiles from the H200 tables: Qwen3-30B-A3B at one token (the default), DeepSeek-V3 at
#: 8 tokens (BLOCK_N 64, 5 stages, no quantising epilogue, no PDL trigger).
TILES = {"qwen3-1": dict(BLOCK_N=128, PDL_TRIGGER=1, QUANT_GROUP=128, ROUND_TO="bf16", num_stages=4, out="*fp8e4nv"),
         "deepseek-v3-8": dict(BLOCK_N=64, PDL_TRIGGER=0, QUANT_GROUP=0, ROUND_TO="", num_stages=5, out="*bf16")}
tile = dict(TILES[sys.argv[1] if len(sys.argv) > 1 else "qwen3-1"])
stages, out_type = tile.pop("num_stages"), tile.pop("out")
pointers = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", out_ptr=out_type, topk_weights_ptr="*fp32",
                sorted_token_ids_ptr="*i64", expert_ids_ptr="*i64", num_tokens_post_padded_ptr="*i64",
                a_scale_ptr="*fp32", w_scale_ptr="*fp32",
                w_desc=f"tensordesc<fp8e4nv[{tile['BLOCK_N']},128]>", out_scale_ptr="*fp32")
for check in ("", "fused_experts: argument 'topk_ids' must hold expert ids in [0, 128)"):
    const = dict(BLOCK_M=16, BLOCK_K=128, GROUP_M=1, TOP_K=8, NAIVE_BLOCKS=True, DENSE=False, GATED=True,
                 MUL_ROUTED_WEIGHT=False, EVEN_K=True, INPUT_PRECISION="tf32", SCALES=1, SUM_TOP_K=0, SPLIT_K=1,
                 TMA_W=True, PERSISTENT=0, SCALE_BN=128, SCALE_BK=128, ID_CHECK=check, SWAP_AB=True,
                 PDL_WAIT=False, PREFETCH_LINE=64, PREFETCH_K=-1, **tile)
    ptx = compile_for_sm90(fn, const, pointers, num_warps=4, num_stages=stages, **device_assert_options(check)).asm["ptx"]
    built = assemble_for_sm90(ptx)
    info, sass = built["log"], built["sass"]
    usage = " ".join(re.findall(r"Used \d+ registers|\d+ bytes stack frame|\d+ bytes spill stores", info))
    counts = {name: len(re.findall(pattern, sass)) for name, pattern in
              (("CALL", r"\bCALL\."), ("L2 prefetch", r"CCTL\.E\.PF2"), ("TMA load", r"UTMALDG"),
               ("wgmma", r"HGMMA|QGMMA"))}
    # Where things sit: the SASS address of the first global load, the first TMA load and the
    # call, to compare the two builds' code ahead of the tile's loads.
    first = {}
    for name, pattern in (("LDG", r"\bLDG\."), ("TMA load", r"UTMALDG"), ("CALL", r"\bCALL\."),
                          ("last wgmma", r"HGMMA|QGMMA")):
        hits = re.findall(r"/\*([0-9a-f]{4,})\*/\s+[^;]*?(?:" + pattern + r")", sass)
        if hits:
            first[name] = int(hits[-1 if name.startswith("last") else 0], 16)
    print(f"{'checked' if check else 'unchecked':>9}: {usage}; SASS " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + "; at " + ", ".join(f"{k} {v:#06x}" for k, v in first.items()))
