"""How fast the SMs read from the L2 (issue 18): the bandwidth that feeds a GEMM's tiles, against what each tile shape
asks of it.

A tile of ``BM`` rows by ``BN`` weight rows reads ``(BM + BN) x 2`` bytes from the L2 per ``2 x BM x BN`` FLOPs of a
K element (bf16): 0.0117 bytes a FLOP at 128 x 256 (the persistent kernels' tile), 0.0156 at 128 x 128 and 0.0195 at
64 x 256 (one warpgroup a tile, as a ping-pong kernel would run). At the dense bf16 rate each needs that many times
the rate in bytes a second. Here one launch of four programs an SM reads an L2-resident buffer ``repeats`` times
(``.cg`` loads, past the L1; each pass's blocks shifted by one program, so that a block comes to another SM each
time), replayed from a CUDA graph without flushing the L2, so almost every byte comes from the L2; a buffer four
times the L2 gives the HBM rate beside it.

    PYTHONPATH=. python tools/l2_read.py [record name, default l2-read]   # records results/<device>/<name>.json
"""
import sys

import torch

from moe_kernels._runtime import cdiv, kernel, tl
from moe_kernels.bench.timing import graph_us
from moe_kernels.results import record_tool

RECORD = sys.argv[1] if len(sys.argv) > 1 else "l2-read"
BLOCK = 4096   # float32 a program reads at a time (16 KiB)


@kernel
def _repeated_read_kernel(src_ptr, partial_ptr, blocks, repeats, BLOCK: tl.constexpr):
    """Program ``p`` reads blocks ``p, p + P, ...`` of ``src`` ``repeats`` times over and stores their sum (so that
    the loads are not dropped)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(repeats):
        # each pass shifted by one program, so that a block comes to another SM each time; ".cg": past the L1
        for b in range((pid + r) % nprog, blocks, nprog):
            acc += tl.load(src_ptr + b * BLOCK + offsets, cache_modifier=".cg")   # (under 2**31 elements)
    tl.store(partial_ptr + pid * BLOCK + offsets, acc)


def read_rate(nbytes: int, repeats: int, device) -> dict:
    """Bytes a second of ``repeats`` passes over a buffer of ``nbytes``, warm (graph of 20 launches)."""
    programs = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1)
    blocks = cdiv(cdiv(nbytes, 4 * BLOCK), programs) * programs   # (a whole number of blocks a program)
    src = torch.ones(blocks * BLOCK, device=device)
    partial = torch.empty(programs * BLOCK, device=device)

    def call():
        _repeated_read_kernel[(programs,)](src, partial, blocks, repeats, BLOCK=BLOCK, num_warps=8)
        return partial

    call()
    expected = float(repeats * blocks * BLOCK)
    if float(partial.sum()) != expected:   # (each element read `repeats` times, each a 1.0)
        raise AssertionError(f"read {float(partial.sum())} of {expected}")
    if device != "cuda":
        return {"bytes": blocks * BLOCK * 4, "repeats": repeats, "us": None, "tb_per_s": None}
    us = graph_us(call)
    return {"bytes": blocks * BLOCK * 4, "repeats": repeats, "us": us,
            "tb_per_s": repeats * blocks * BLOCK * 4 / (us * 1e-6) / 1e12}


device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sizes = [(l2 // 8, 64), (l2 // 4, 32), (l2 // 2, 16), (4 * l2, 1)]
else:   # (the interpreter: the kernel and its check on a tiny buffer)
    sizes = [(4 * 4 * BLOCK, 2)]
rows = []
for nbytes, repeats in sizes:
    rows.append(read_rate(nbytes, repeats, device))
    print(rows[-1])
if device != "cuda":
    print("read sums correct")
else:
    rate = max(r["tb_per_s"] for r in rows[:-1])
    for shape, per_flop in (("128 x 256", 384 * 2 / (2 * 128 * 256)), ("128 x 128", 256 * 2 / (2 * 128 * 128)),
                            ("64 x 256", 320 * 2 / (2 * 64 * 256))):
        print(f"tile {shape}: {per_flop:.4f} bytes a FLOP; the L2's {rate:.1f} TB/s feed at most "
              f"{rate * 1e12 / per_flop / 1e12:.0f} TFLOP/s")
    print(f"recorded {record_tool(RECORD, rows, {'block': BLOCK, 'programs_per_sm': 4, 'num_warps': 8})}")
