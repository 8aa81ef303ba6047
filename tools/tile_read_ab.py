"""How fast the GEMMs' *weight-tile pattern* alone can stream, without any multiply: issue 17's
question for Qwen3-30B-A3B, whose decode GEMMs run 9-80% over a plain read of the same bytes.

A GEMM program of the index-gather kernel reads one expert's ``[BLOCK_N, K]`` weight rows in
``BLOCK_K`` steps. Qwen3's GEMM 2 has K = 768: six 128-wide steps a program, so each program is
short and its pipeline fills and drains often. This times a kernel that does only that: one program
per (expert, N-tile), the same K loop over ``[BLOCK_N, BLOCK_K]`` tiles (pointer loads, ``STAGES``
deep), a sum kept so that the loads stay, one float written per program. Beside it, in the same
run and by the same method (one CUDA graph per call, L2 flushed, the lower of two round medians):
the package's contiguous read of the same bytes (``ceilings.weight_reader``) and the floor (bytes
over the 4 GiB read bandwidth).

* tiled ~ contiguous: the tile shape costs nothing, and the GEMM's excess is its own (MMA, scales,
  epilogue, the A rows, the top-k sum);
* tiled >> contiguous at short K and not at long K: programs too short to stream; the fix is the
  work decomposition (longer programs), not the multiply.

Rows: Qwen3 and DeepSeek-V3, GEMM 1 (``[2N, K]`` per expert) and GEMM 2 (``[K_model, N]``), bf16 and
fp8 (one byte), over every expert (what a batch of 64+ tokens touches), for BLOCK_N 64/128/256,
BLOCK_K 128/256, 4 and 8 warps, 3 and 4 stages, with the 16-row MMA ("dot") and, for some, without
("sum").

    PYTHONPATH=. python tools/tile_read_ab.py [models] [formats]   # GPU: prints, records tile-read.json
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/tile_read_ab.py   # CPU: checks the sums on a toy tensor
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from moe_kernels._runtime import tl, triton
from moe_kernels.model.shapes import MODELS


@triton.jit
def _tile_read(w_ptr, a_ptr, out_ptr, N, K, stride_e, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               STAGES: tl.constexpr, DOT: tl.constexpr):
    """Program (e, n): expert e's rows [n * BLOCK_N, (n + 1) * BLOCK_N) of a [E, N, K] tensor, read
    in [BLOCK_N, BLOCK_K] tiles as a GEMM program reads its weights, through the same cp.async
    pipeline, ``STAGES`` deep (checked in the sm_90 PTX with N, K and the stride 16-divisible, as the
    launches specialise them). ``DOT``: each tile goes into a ``tl.dot`` with 16 rows of ``a [16, K]``
    (one small A tile, the same for every program), the decode GEMM's mma.sync; without it, the tile
    is only summed. One float out."""
    e = tl.program_id(0)
    n = tl.program_id(1)
    rows = n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e.to(tl.int64) * stride_e + rows[None, :].to(tl.int64) * K + ks[:, None]   # [BLOCK_K, BLOCK_N]
    a_ptrs = a_ptr + tl.arange(0, 16)[:, None] * K + ks[None, :]
    if DOT:
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        w = tl.load(w_ptrs)
        if DOT:
            acc = tl.dot(tl.load(a_ptrs), w, acc)
        else:
            acc += w.to(tl.float32)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(out_ptr + e * tl.num_programs(1) + n, tl.sum(acc))


def tile_reader(w: torch.Tensor, block_n: int, block_k: int, stages: int, warps: int, dot: bool = True):
    """A function reading ``w [E, N, K]`` (contiguous; N and K multiples of the blocks) tile by tile."""
    E, N, K = w.shape
    if N % block_n or K % block_k or not w.is_contiguous():
        raise ValueError(f"tile_reader: w {tuple(w.shape)} must be contiguous with N % {block_n} == 0 and "
                         f"K % {block_k} == 0")
    a = torch.ones(16, K, device=w.device).to(w.dtype)
    out = torch.empty(E, N // block_n, device=w.device)

    def read():
        _tile_read[(E, N // block_n)](w, a, out, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
                                      DOT=dot, num_warps=warps)
        return out

    return read


def check_values() -> None:
    w = torch.arange(2 * 16 * 16, dtype=torch.float32).reshape(2, 16, 16)
    want = w.reshape(2, 1, 16, 16).sum(dim=(2, 3))
    for dot, scale in ((False, 1), (True, 16)):   # (the dot sums each product over 16 rows of ones)
        got = tile_reader(w, 16, 8, 2, 4, dot=dot)()
        if not torch.equal(got, scale * want):
            raise SystemExit(f"tile_reader (dot={dot}) gave {got.tolist()}, not {(scale * want).tolist()}")


def shapes(model) -> dict:
    """GEMM 1's and GEMM 2's weights as [E, rows, K] (what a program reads along K)."""
    E, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    return {"gate_up": (E, 2 * f, d), "down": (E, d, f)}


def main() -> int:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET"):
        check_values()
        print("tile sums correct (no GPU: nothing timed)")
        return 0
    from moe_kernels.bench.ceilings import measure_read_bandwidth, weight_reader
    from moe_kernels.bench.cli import write_record
    from moe_kernels.bench.timing import graphed, median_ms

    models = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qwen3-30b-a3b", "deepseek-v3"]
    formats = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", "fp8"]
    read_bw = measure_read_bandwidth()
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for key, fmt in itertools.product(models, formats):
        for gemm, shape in shapes(MODELS[key]).items():
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
            w = torch.randn(shape, device="cuda").to(dtype)
            nbytes = w.numel() * w.element_size()
            floor_us = nbytes / read_bw * 1e6
            candidates = {"contiguous": weight_reader(w)}
            for block_n, block_k, warps, stages in itertools.product((64, 128, 256), (128, 256), (4, 8), (3, 4)):
                if stages * (block_n + 16) * block_k * w.element_size() > 200 * 1024:
                    continue   # (past an SM's shared memory)
                candidates[f"n{block_n} k{block_k} w{warps} s{stages} dot"] = tile_reader(w, block_n, block_k, stages, warps)
                if warps == 8 and block_n >= 128 and block_k == 128:   # the read alone, same pipeline
                    candidates[f"n{block_n} k{block_k} w{warps} s{stages} sum"] = tile_reader(
                        w, block_n, block_k, stages, warps, dot=False)
            times = {name: [] for name in candidates}
            for _ in range(2):   # two rounds, interleaved; the lower median
                for name, fn in candidates.items():
                    times[name].append(median_ms(graphed(fn), 2, 10) * 1e3)
            us = {name: min(v) for name, v in times.items()}
            best = {mode: min((n for n in us if n.endswith(mode)), key=us.get) for mode in ("dot", "sum")}
            row = {"model": key, "format": fmt, "gemm": gemm, "shape": list(shape), "bytes": nbytes,
                   "floor_us": floor_us, "contiguous_us": us["contiguous"],
                   "best": {mode: {"tiles": n, "us": us[n]} for mode, n in best.items()},
                   "tiled_us": {n: t for n, t in us.items() if n != "contiguous"}}
            rows.append(row)
            print(f"{key:<14} {fmt:<5} {gemm:<8} {nbytes / 1e6:7.1f} MB: floor {floor_us:7.1f} us, contiguous "
                  f"{us['contiguous']:7.1f} ({us['contiguous'] / floor_us:.2f}x), "
                  + ", ".join(f"best {mode} {us[n]:7.1f} ({us[n] / floor_us:.2f}x, {n})" for mode, n in best.items()),
                  flush=True)
            del w, candidates
    write_record("tile-read", {"read_bandwidth": read_bw, "method": "one CUDA graph per call, L2 flushed "
                               "(do_bench median), the lower of two interleaved rounds", "rows": rows}, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
