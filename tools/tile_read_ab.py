"""How fast the GEMMs' *weight-tile pattern* alone can stream: issue 17's question for
Qwen3-30B-A3B, whose decode GEMMs run 9-80% over a plain read of the same bytes.

A program of the index-gather GEMM reads one expert's weight rows for its N-tile in ``BLOCK_K``
steps; GEMM 1 (gated) reads two such tiles per step, the gate rows ``n * BLOCK_N ..`` and the up
rows ``F + n * BLOCK_N ..`` of the expert's ``[2F, d]`` matrix. Qwen3's GEMM 2 has K = 768: six
128-wide steps a program, so each program is short and its pipeline fills and drains often. This
times a kernel that does only the reading, the way the GEMM does it: programs in the GEMM's order
(an expert's N-tiles one after another), the same K loop through the same cp.async pipeline
(``STAGES`` deep), and either a ``tl.dot`` with one 16-row A tile (the decode GEMM's mma.sync, with
no gather, no scales, no epilogue: "dot") or a plain sum of each tile ("sum"). Beside it, in the
same run and by the same method (one CUDA graph per call, L2 flushed, the lower of two interleaved
rounds' medians): the package's contiguous read of the same bytes (``ceilings.weight_reader``) and
the floor (the bytes over the read bandwidth of a 4 GiB read).

* tiled ~ contiguous: the tile pattern costs nothing, and the GEMM's excess over a read is its own
  (the gathered A rows, the scales, the epilogue, the top-k sum);
* tiled >> contiguous at short K and not at long K: programs too short to stream; the fix is the
  work decomposition (longer programs), not the arithmetic.

Rows: Qwen3 and DeepSeek-V3, GEMM 1 and GEMM 2, bf16 and fp8 (one byte), over every expert (what
a batch of 64+ tokens touches), for :func:`candidates` (the tuner's decode tiles and their
neighbours). The record is rewritten after each row, and a candidate that fails (out of shared
memory, say) is recorded with its error, so a run cut short keeps what it measured.

    PYTHONPATH=. python tools/tile_read_ab.py [models] [formats] [experts]   # GPU: records tile-read.json
                                                     # (or $TILE_READ_NAME.json); experts: 0 = all
    # TILE_READ_N, TILE_READ_WARPS, TILE_READ_STAGES: comma lists narrowing the candidates' tiles
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/tile_read_ab.py   # CPU: checks the sums on a toy tensor
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from moe_kernels._runtime import tl, triton
from moe_kernels.model.shapes import MODELS

#: Shared memory one program may take on an H100/H200 (227 KiB).
SHARED_BYTES = 227 * 1024


@triton.jit
def _tile_read(w_ptr, a_ptr, out_ptr, N, K, stride_e, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr, TILED: tl.constexpr = False,
               CHUNKS: tl.constexpr = 1, w_desc=None, TMA: tl.constexpr = False):
    """Program (n, e): expert e's weight rows for N-tile n of a ``[E, (2 if GATED else 1) * N, K]``
    tensor, read in ``[BLOCK_K, BLOCK_N]`` tiles (and, with ``GATED``, the matching up rows ``N``
    further on), as the GEMM's K loop reads them, ``STAGES`` deep. ``DOT``: each tile goes into a
    ``tl.dot`` with 16 rows of ``a [16, K]`` (one small A tile, the same for every program);
    otherwise it is summed over K into a ``BLOCK_N`` vector. One float out per program.

    ``TILED``: the same values stored tile by tile (:func:`tiled_copy`), so that each K step reads
    one contiguous ``BLOCK_N x BLOCK_K`` block (gated: the gate block, then its up block) and a
    program's whole read is one contiguous run, instead of ``BLOCK_N`` rows ``K`` elements apart.

    ``CHUNKS`` = 2: each step loads two ``BLOCK_K`` tiles of the same rows, K-adjacent, as two loads and two dots (a
    block-fp8 GEMM's step over two scale blocks, each 128 wide with its own scale): ``2 * BLOCK_K`` values of a row
    requested together. ``TMA``: the weight tiles through the copy engine (``w_desc``: all experts' rows as one
    ``[E * rows, K]`` matrix, box ``[BLOCK_N, BLOCK_K]``), as the GEMMs' ``tma`` tiles read them."""
    n = tl.program_id(0)   # (the GEMM walks an expert's N-tiles one after another)
    e = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    if TILED:   # [N / BLOCK_N, K / BLOCK_K, (2,) BLOCK_N, BLOCK_K] per expert
        parts: tl.constexpr = 2 if GATED else 1
        start = e.to(tl.int64) * stride_e + n.to(tl.int64) * (parts * BLOCK_N) * K
        w_ptrs = w_ptr + start + tl.arange(0, BLOCK_N)[None, :] * BLOCK_K + ks[:, None]
        up_offset = BLOCK_N * BLOCK_K
        step = parts * BLOCK_N * BLOCK_K
    else:
        rows = n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + e.to(tl.int64) * stride_e + rows[None, :].to(tl.int64) * K + ks[:, None]   # [BLOCK_K, BLOCK_N]
        up_offset = N * K
        step = BLOCK_K
    a_ptrs = a_ptr + tl.arange(0, 16)[:, None] * K + ks[None, :]
    if DOT:
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    desc_row = e * (2 if GATED else 1) * N + n * BLOCK_N
    for i in tl.range(0, tl.cdiv(K, CHUNKS * BLOCK_K), num_stages=STAGES):
        for c in tl.static_range(CHUNKS):
            if TMA:
                w = w_desc.load([desc_row, (i * CHUNKS + c) * BLOCK_K]).T
                if GATED:
                    up = w_desc.load([desc_row + N, (i * CHUNKS + c) * BLOCK_K]).T
            else:
                w = tl.load(w_ptrs + c * BLOCK_K)
                if GATED:
                    up = tl.load(w_ptrs + c * BLOCK_K + up_offset)
            if DOT:
                a = tl.load(a_ptrs + c * BLOCK_K)
                acc = tl.dot(a, w, acc)
                if GATED:
                    acc = tl.dot(a, up, acc)
            else:
                acc += tl.sum(w.to(tl.float32), axis=0)
                if GATED:
                    acc += tl.sum(up.to(tl.float32), axis=0)
        w_ptrs += CHUNKS * step
        a_ptrs += CHUNKS * BLOCK_K
    tl.store(out_ptr + e * tl.num_programs(0) + n, tl.sum(acc))


def tiled_copy(w: torch.Tensor, gated: bool, block_n: int, block_k: int) -> torch.Tensor:
    """``w [E, rows, K]`` stored tile by tile, as ``_tile_read`` with ``TILED`` reads it: per expert
    ``[N / block_n, K / block_k, (2,) block_n, block_k]`` (gated: the gate tile and the up tile of
    the same rows and K step side by side). The same bytes; a weight format that engines use for
    decode so that a tile is one contiguous block.

        >>> w = torch.arange(2 * 4 * 4).reshape(1, 8, 4)   # gated: N = 4 gate rows, 4 up rows
        >>> tiled_copy(w, True, 2, 2).flatten()[:8].tolist()   # N-tile 0, K step 0: gate rows 0-1, up rows 4-5
        [0, 1, 4, 5, 16, 17, 20, 21]
    """
    E, rows, K = w.shape
    parts = 2 if gated else 1
    N = rows // parts
    t = w.reshape(E, parts, N // block_n, block_n, K // block_k, block_k)
    return t.permute(0, 2, 4, 1, 3, 5).contiguous().reshape(E, rows, K)


def tile_reader(w: torch.Tensor, gated: bool, block_n: int, block_k: int, stages: int, warps: int, dot: bool = True,
                tiled: bool = False, copies: dict | None = None, chunks: int = 1, tma: bool = False):
    """A function reading ``w [E, rows, K]`` tile by tile (``gated``: ``rows = 2N``, gate and up
    halves read together); ``w`` contiguous, N and K multiples of the blocks. ``tiled``: it reads a
    :func:`tiled_copy` of ``w`` the way ``_tile_read`` with ``TILED`` does (made once per tile shape
    and kept in ``copies``, if given). ``chunks`` 2: two K-adjacent tiles a step; ``tma``: through the copy engine
    (Hopper; not with ``tiled``)."""
    E, rows, K = w.shape
    N = rows // 2 if gated else rows
    if (gated and rows % 2) or N % block_n or K % (chunks * block_k) or not w.is_contiguous() or (tiled and (
            tma or chunks > 1)):
        raise ValueError(f"tile_reader: w {tuple(w.shape)} must be contiguous with {'half ' if gated else ''}its rows "
                         f"a multiple of {block_n} and K a multiple of {chunks * block_k} (tiled: one chunk, no TMA)")
    source = w
    if tiled:
        copies = {} if copies is None else copies
        if (block_n, block_k) not in copies:
            copies[block_n, block_k] = tiled_copy(w, gated, block_n, block_k)
        source = copies[block_n, block_k]
    a = torch.ones(16, K, device=w.device).to(w.dtype)
    out = torch.empty(E, N // block_n, device=w.device)

    desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(w.view(E * rows, K), [block_n, block_k])

    def read():
        _tile_read[(N // block_n, E)](source, a, out, N, K, source.stride(0), GATED=gated, BLOCK_N=block_n,
                                      BLOCK_K=block_k, STAGES=stages, DOT=dot, TILED=tiled, CHUNKS=chunks,
                                      w_desc=desc, TMA=tma, num_warps=warps)
        return out

    return read


def shared_bytes(gated: bool, block_n: int, block_k: int, stages: int, element_size: int) -> int:
    """The pipeline's shared memory as Triton 3.6 allocates it: ``STAGES - 1`` buffers of the
    weight tiles and the A tile (checked against the compiled kernels' ``shared`` in the tests)."""
    return (stages - 1) * ((2 if gated else 1) * block_n + 16) * block_k * element_size


def candidates(gated: bool, element_size: int) -> list[dict]:
    """The tiles to time: BLOCK_N 32-256 (GEMM 1's tuned decode tiles are 32-64 wide, two of them),
    BLOCK_K 128 and 256 (and 512 for one-byte weights), 4 and 8 warps, 3-5 stages, with the MMA; and a few
    without it (TILE_READ_N, TILE_READ_WARPS and TILE_READ_STAGES narrow them). TILE_READ_TILED=1
    adds each MMA candidate again on the weights stored tile by tile (:func:`tiled_copy`). TILE_READ_K narrows the K
    steps; TILE_READ_CHUNKS=1,2 and TILE_READ_TMA=0,1 add each MMA tile with two K-adjacent chunks a step and through
    the copy engine ("x2", "tma" in the label)."""
    out = []
    k_steps = (128, 256, 512) if element_size == 1 else (128, 256)   # (fp8: 128, 256 or 512 bytes of a row a step)
    warp_counts = tuple(int(v) for v in os.environ.get("TILE_READ_WARPS", "4,8").split(","))
    stage_counts = tuple(int(v) for v in os.environ.get("TILE_READ_STAGES", "3,4,5").split(","))
    widths = tuple(int(v) for v in os.environ.get("TILE_READ_N", "32,64,128,256").split(","))
    k_steps = tuple(int(v) for v in os.environ.get("TILE_READ_K", ",".join(map(str, k_steps))).split(","))
    chunk_counts = tuple(int(v) for v in os.environ.get("TILE_READ_CHUNKS", "1").split(","))
    tma_modes = tuple(v == "1" for v in os.environ.get("TILE_READ_TMA", "0").split(","))
    for block_n, block_k, warps, stages, chunks, tma in itertools.product(widths, k_steps, warp_counts, stage_counts,
                                                                           chunk_counts, tma_modes):
        if chunks > 1 or tma:   # (the pairs and the copy engine: each MMA candidate once more)
            if not (gated and block_n > 128) and shared_bytes(gated, block_n, chunks * block_k, stages,
                                                              element_size) <= SHARED_BYTES:
                out.append(dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, dot=True,
                                chunks=chunks, tma=tma))
            continue
        if gated and block_n > 128:
            continue   # (the GEMM's gated tiles stop at 128: two accumulators)
        if shared_bytes(gated, block_n, block_k, stages, element_size) > SHARED_BYTES:
            continue
        out.append(dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, dot=True))
        if os.environ.get("TILE_READ_TILED") == "1":
            out.append(dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, dot=True, tiled=True))
        if warps == 8 and block_n >= 64 and block_k == 128 and stages == 4:
            out.append(dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, dot=False))
    return out


def label(c: dict) -> str:
    return (f"n{c['block_n']} k{c['block_k']}{'x%d' % c['chunks'] if c.get('chunks', 1) > 1 else ''} w{c['warps']} "
            f"s{c['stages']} {'dot' if c['dot'] else 'sum'}" + (" tiled" if c.get("tiled") else "")
            + (" tma" if c.get("tma") else ""))


def check_values() -> None:
    w = torch.arange(2 * 16 * 16, dtype=torch.float32).reshape(2, 16, 16)
    for gated, block_n in ((False, 16), (True, 8)):
        want = w.sum(dim=(1, 2))[:, None] if gated else w.reshape(2, 1, 16, 16).sum(dim=(2, 3))
        for dot, scale, tiled, chunks in ((False, 1, False, 1), (True, 16, False, 1), (True, 16, True, 1),
                                          (True, 16, False, 2), (False, 1, False, 2)):
            got = tile_reader(w, gated, block_n, 8, 2, 4, dot=dot, tiled=tiled, chunks=chunks)()   # (16: the dot's
            # rows of ones)
            if not torch.equal(got, scale * want):
                raise SystemExit(f"tile_reader (gated={gated}, dot={dot}, tiled={tiled}, chunks={chunks}) gave {got.tolist()}, not "
                                 f"{(scale * want).tolist()}")


def shapes(model, experts: int = 0) -> dict:
    """GEMM 1's and GEMM 2's weights as ``(gated, [E, rows, K])``, what a program reads along K;
    ``experts`` (if not 0): that many experts, as a batch of few tokens touches."""
    E, d, f = experts or model.num_experts, model.hidden_size, model.moe_intermediate_size
    return {"gate_up": (True, (E, 2 * f, d)), "down": (False, (E, d, f))}


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
    experts = int(sys.argv[3]) if len(sys.argv) > 3 else 0   # (0: every expert)
    read_bw = measure_read_bandwidth()
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for key, fmt, gemm in itertools.product(models, formats, ("down", "gate_up")):
        gated, shape = shapes(MODELS[key], experts)[gemm]
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        w = torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_().to(dtype)
        nbytes = w.numel() * w.element_size()
        floor_us = nbytes / read_bw * 1e6
        fns, errors, copies = {"contiguous": weight_reader(w)}, {}, {}
        for c in candidates(gated, w.element_size()):
            try:
                fns[label(c)] = tile_reader(w, gated, c["block_n"], c["block_k"], c["stages"], c["warps"], c["dot"],
                                            c.get("tiled", False), copies, c.get("chunks", 1), c.get("tma", False))
            except ValueError as error:   # (a tile that does not divide the shape: Qwen3's K = 768 by 512)
                errors[label(c)] = str(error)
        times = {name: [] for name in fns}
        for _ in range(2):   # two rounds, each over every candidate in turn; the lower median of each
            for name, fn in fns.items():
                if name in errors:
                    continue
                try:
                    times[name].append(median_ms(graphed(fn), 2, 10) * 1e3)
                except Exception as error:   # e.g. out of shared memory: recorded, the rest goes on
                    errors[name] = repr(error)[:300]
        us = {name: min(v) for name, v in times.items() if v}
        modes = {"dot": lambda n: n.endswith("dot") and "x2" not in n, "sum": lambda n: n.endswith("sum"),
                 "tiled": lambda n: n.endswith("tiled"), "x2": lambda n: "x2 " in n and not n.endswith("tma"),
                 "tma": lambda n: n.endswith("tma")}
        best = {mode: min((n for n in us if n != "contiguous" and keep(n)), key=us.get, default=None)
                for mode, keep in modes.items()}
        row = {"model": key, "format": fmt, "gemm": gemm, "shape": list(shape), "bytes": nbytes, "floor_us": floor_us,
               "contiguous_us": us.get("contiguous"), "best": {m: n and {"tiles": n, "us": us[n]} for m, n in best.items()},
               "tiled_us": {n: t for n, t in us.items() if n != "contiguous"}, "errors": errors}
        rows.append(row)
        print(f"{key:<14} {fmt:<5} {gemm:<8} {nbytes / 1e6:7.1f} MB: floor {floor_us:7.1f} us, contiguous "
              + (f"{us['contiguous']:7.1f} ({us['contiguous'] / floor_us:.2f}x)" if "contiguous" in us else "failed")
              + "".join(f", best {m} {us[n]:7.1f} ({us[n] / floor_us:.2f}x, {n})" for m, n in best.items() if n)
              + (f"; {len(errors)} failed" if errors else ""), flush=True)
        write_record(os.environ.get("TILE_READ_NAME", "tile-read"),
                     {"read_bandwidth": read_bw, "experts": experts or "all", "method": "one CUDA graph per call, L2 "
                      "flushed (do_bench median), the lower of two interleaved rounds", "rows": rows}, None)
        del w, fns, copies
    return 0


if __name__ == "__main__":
    sys.exit(main())
