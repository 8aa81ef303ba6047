"""Timing harness for one routed-expert layer: ceilings, a batch sweep over layouts, tile tuning.

Every number is reported against a *floor* built from two ceilings measured in the same run
(:mod:`moe_kernels.bench.ceilings`): the HBM bandwidth of a large device-to-device copy and the rate of
a large bf16 matmul on random data. For one layer at batch ``B``:

* bytes = the weights of the experts the drawn ids actually touch (``3 d F`` each) plus the
  activations read and the output written (``2 B d``), in the weight dtype;
* FLOPs = ``2 * 3 d F`` per assignment, ``B k`` assignments;
* floor = ``max(bytes / bandwidth, FLOPs / gemm_rate)``; the table shows ``time / floor``.

Layouts are callables ``(hidden, w1, w2, topk_weights, topk_ids) -> [T, d]``: ours (index-gather,
:mod:`moe_kernels.kernels.index_gather`), the permute and masked layouts and PyTorch's ``grouped_mm`` when
their modules import, a per-expert Python loop, and a dense GEMM of the same FLOPs. Our layout
is timed twice: "GEMMs" with the block map precomputed (both grouped GEMMs and the top-k sum)
and "layer" from router logits (routing, alignment, GEMMs, sum), each also replayed from a CUDA
graph (no launch overhead). Times are medians of ``triton.testing.do_bench``, which flushes the
L2 between runs, so weights are read from HBM every time even where they would fit in L2.

``python -m moe_kernels.bench sweep`` runs the sweep (``--record`` writes
``results/<device>/<name>.json``); ``python -m moe_kernels.bench tune`` searches tile
configurations instead and writes the best per batch. Both need a CUDA GPU; the counting
(:func:`moe_kernels.model.costs.count_work`) runs anywhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ..model.costs import count_work, dense_work, read_seconds
from ..model.shapes import MODELS, MoEModel
from .problems import make_batch, make_weights
from .timing import graphed, median_ms, rel_err

DEFAULT_MODELS = ("deepseek-v3", "qwen3-30b-a3b")
DEFAULT_BATCHES = tuple(2**i for i in range(15))  # 1 .. 16384


# ----------------------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# Problems and baselines
# ----------------------------------------------------------------------------------------------


def other_layouts() -> dict[str, Callable]:
    """The layouts of the sibling modules that import here, plus the per-expert loop."""
    layouts = {}
    try:
        from ..kernels.permute import permute_experts
        from .baselines import torch_grouped_mm_experts

        layouts["permute"] = permute_experts
        layouts["torch grouped_mm"] = torch_grouped_mm_experts
    except ImportError as err:
        print(f"(permute layout unavailable: {err})", file=sys.stderr)
    try:
        from ..kernels.masked import masked_experts

        layouts["masked"] = masked_experts
    except ImportError as err:
        print(f"(masked layout unavailable: {err})", file=sys.stderr)
    from .baselines import expert_loop

    layouts["expert loop"] = expert_loop
    return layouts


# ----------------------------------------------------------------------------------------------
# Tuned configurations from a file
# ----------------------------------------------------------------------------------------------


def load_configs(path: str | os.PathLike) -> dict:
    """``--tune`` output -> {(E, N, K): {M: MoEConfig}}."""
    from ..kernels.config import MoEConfig

    table: dict = {}
    recorded = json.loads(Path(path).read_text())
    for entry in recorded.get("data", recorded)["entries"]:  # a --record file wraps it in provenance
        table.setdefault((entry["E"], entry["N"], entry["K"]), {})[entry["M"]] = MoEConfig.from_dict(entry["config"])
    return table


def pick_config(table: dict | None, model: MoEModel, num_tokens: int, dtype: torch.dtype, device="cuda"):
    from ..kernels.config import get_config

    d, f, e = model.hidden_size, model.moe_intermediate_size, model.num_experts
    if table and (e, f, d) in table:  # nearest token count by ratio, as get_config does
        rows = table[(e, f, d)]
        return rows[min(rows, key=lambda m: (abs(math.log(m / max(num_tokens, 1))), m))]
    return get_config(num_tokens, e, f, d, dtype, device)


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


def sweep(models, batches, *, dtype, seed, warmup_ms, rep_ms, ceilings, configs=None, layouts=None,
          graphs=True, log=print, device="cuda") -> list[dict]:
    """Time every layout at every batch; return one dict per (model, batch, layout).

    ``models`` maps names to :class:`~moe_kernels.model.shapes.MoEModel`."""
    from ..kernels.blocks import assign_blocks
    from ..kernels.index_gather import fused_experts, fused_moe

    others = other_layouts()
    if layouts is not None:
        others = {k: v for k, v in others.items() if k in layouts}
    bpe = torch.finfo(dtype).bits / 8
    # Weight streaming only reads: the floor uses the read bandwidth (the copy figure is kept for reference).
    bandwidth, rate = ceilings["read_bandwidth"], ceilings["gemm_rate_bf16"]
    rows = []
    header = (f"{'model':<14} {'batch':>6} {'layout':<26} {'time us':>10} {'touched':>7} {'MB':>9} "
              f"{'GFLOP':>9} {'TB/s':>6} {'TFLOP/s':>7} {'floor us':>9} {'x floor':>7} {'x read':>6}")
    log(header)
    for key, model in models.items():
        w1, w2 = make_weights(model, dtype, seed, device)
        for batch in batches:
            hidden, logits, weights, ids = make_batch(model, batch, dtype, seed + batch, device)
            cfg = pick_config(configs, model, batch, dtype, device)
            blocks = assign_blocks(ids, cfg.block_m, model.num_experts, validate_ids=False)
            work = count_work(model, ids, bpe)

            def gemms():
                return fused_experts(hidden, w1, w2, weights, ids, config=cfg, blocks=blocks, validate_ids=False)

            def layer():
                return fused_moe(hidden, w1, w2, logits, model.top_k, True, config=cfg)

            reference = gemms()
            # (name, call, work, replay from a CUDA graph?, compare the output with ours?)
            candidates = [("index-gather GEMMs", gemms, work, False, False),
                          ("index-gather layer", layer, work, False, True)]
            if graphs:
                candidates += [("index-gather GEMMs graph", gemms, work, True, False),
                               ("index-gather layer graph", layer, work, True, False)]
            for name, fn in others.items():
                # Every other layout is timed the way ours is: ids unchecked, replayed from a CUDA
                # graph where it can be captured (the expert loop reads counts on the host: eager).
                if name == "expert loop":
                    candidates.append((name, lambda fn=fn: fn(hidden, w1, w2, weights, ids), work, False, True))
                else:
                    call = lambda fn=fn: fn(hidden, w1, w2, weights, ids, validate_ids=False)  # noqa: E731
                    candidates.append((name, call, work, graphs, True))
            dense_w = torch.randn(model.hidden_size, 3 * model.moe_intermediate_size, device=device, dtype=dtype)
            dense_x = hidden.repeat_interleave(model.top_k, dim=0)
            candidates.append(("dense GEMM same FLOPs", lambda: dense_x @ dense_w, dense_work(model, batch, bpe),
                               graphs, False))
            candidates.append(("bmm balanced same work", _balanced_bmm(model, batch, dtype, device), work, graphs,
                               False))

            for name, call, wk, as_graph, compare in candidates:
                row = {"model": key, "batch": batch, "layout": name, "experts_touched": wk.experts_touched,
                       "bytes": wk.bytes, "flops": wk.flops, "floor_s": wk.floor_seconds(bandwidth, rate),
                       "graph": as_graph}
                if "read_by_size" in ceilings:   # a plain read of the same bytes, in one kernel
                    row["read_same_bytes_s"] = read_seconds(ceilings["read_by_size"], wk.bytes)
                try:
                    out = call()  # also the warm-up (compilation) before any capture
                    if compare:
                        row["rel_err_vs_index_gather"] = rel_err(out, reference)
                    del out
                    timed = graphed(call) if as_graph else call
                    row["time_s"] = median_ms(timed, warmup_ms, rep_ms) * 1e-3
                except Exception as err:  # noqa: BLE001 - one layout failing (OOM, no kernel) must not stop the sweep
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                rows.append(row)
                log(_format_row(row))
                _empty_cache(device)
            row_cfg = {"model": key, "batch": batch, "layout": "index-gather config", "config": cfg.to_dict(),
                       "naive_blocks": blocks.naive}
            rows.append(row_cfg)
            del hidden, logits, weights, ids, blocks, dense_w, dense_x, reference
        del w1, w2
        _empty_cache(device)
    return rows


def _balanced_bmm(model: MoEModel, batch: int, dtype, device):
    """cuBLAS batched GEMMs doing the layer's work on perfectly balanced groups: every expert gets
    ``ceil(B k / E)`` rows (the limit ragged groups are measured against)."""
    e, d, f = model.num_experts, model.hidden_size, model.moe_intermediate_size
    rows = -(-batch * model.top_k // e)
    x = torch.randn(e, rows, d, device=device, dtype=dtype)
    w13 = torch.randn(e, d, 2 * f, device=device, dtype=dtype) * d**-0.5
    w2 = torch.randn(e, f, d, device=device, dtype=dtype) * f**-0.5

    def run():
        h = torch.bmm(x, w13)
        return torch.bmm(torch.nn.functional.silu(h[..., :f]) * h[..., f:], w2)

    return run


def _empty_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _format_row(row: dict) -> str:
    lead = f"{row['model']:<14} {row['batch']:>6} {row['layout']:<26}"
    if "time_s" not in row:
        return f"{lead} {row.get('error', '')}"
    t = row["time_s"]
    return (f"{lead} {t * 1e6:>10.1f} {row['experts_touched']:>7} {row['bytes'] / 1e6:>9.1f} "
            f"{row['flops'] / 1e9:>9.2f} {row['bytes'] / t / 1e12:>6.2f} {row['flops'] / t / 1e12:>7.1f} "
            f"{row['floor_s'] * 1e6:>9.1f} {t / row['floor_s']:>7.2f}"
            + (f" {t / row['read_same_bytes_s']:>6.2f}" if "read_same_bytes_s" in row else ""))


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------

_SHARED_MEMORY_BYTES = 220 * 1024  # an H100/H200 SM offers 227 KiB to one block; keep a margin


def block_m_candidates(rows_per_expert: float) -> list[int]:
    """M tiles worth trying when each expert gets ``rows_per_expert`` rows on average (where the
    GEMM computes, a smaller tile than the rows also pays: it wastes less on the partial block)."""
    low = rows_per_expert / (4 if rows_per_expert >= 128 else 2)
    picks = [b for b in (16, 32, 64, 128) if low <= b <= 2 * rows_per_expert]
    return picks or [16 if rows_per_expert < 16 else 128]


def tile_candidates(rows_per_expert: float, block_m: int, gated: bool) -> list:
    """N/K tiles, warps and stages to try.

    Where the GEMM streams weights (few rows per expert) a program's speed is bounded by what one
    SM can pull (~30 GB/s measured), so the candidates spread the weights over many programs
    (narrow N tiles) with long K tiles and deep pipelines; where it computes, wide tiles and
    more warps."""
    from ..kernels.config import GemmTiles

    streaming = [(n, k, 1, 4, s) for n in (16, 32, 64, 128, 256) for k in (128, 256) for s in (3, 4, 5)]
    balanced = [(n, k, 8, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
    computing = [(n, 64, 8, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4)]
    if rows_per_expert < 16:
        grid = streaming
    elif rows_per_expert < 128:
        grid = [(n, k, 8, w, s) for n, k, _, w, s in streaming if n >= 32 and s <= 4] + balanced
    else:
        grid = balanced + computing
    weight_tiles = 2 if gated else 1
    out = []
    for n, k, group, warps, stages in dict.fromkeys(grid):
        if gated and n > 128:
            continue  # two accumulators of BLOCK_M x 256 do not fit in registers
        if stages * (block_m * k + weight_tiles * n * k) * 2 > _SHARED_MEMORY_BYTES:
            continue
        for tma in (False, True):   # weight tiles by pointer loads or by the copy engine (TMA)
            # Where the GEMM computes, also a persistent grid (1) and its flattened pipeline (2).
            for persistent in (0, 1, 2) if rows_per_expert >= 128 else (0,):
                out.append(GemmTiles(n, k, group, warps, stages, tma=tma, persistent=persistent))
    return out


def down_variants(rows_per_expert: float) -> list[tuple[bool, int]]:
    """GEMM 2 finishes in one of two ways: ``(False, 1)`` writes ``[T, k, d]`` for the top-k sum
    kernel; ``(True, s)`` adds into ``[T, d]`` fp32 in its epilogue, over ``s`` K slices. Split-K
    only pays where the programs are too few to keep every SM streaming (few rows per expert)."""
    splits = (1, 2, 4) if rows_per_expert < 16 else (1, 2) if rows_per_expert < 64 else (1,)
    return [(False, 1)] + [(True, s) for s in splits]


def _compile_jobs(jobs: list[dict]) -> int:
    """Run each job's kernel once on a tiny problem of the same shape class, so Triton compiles
    it into its on-disk cache; used from worker processes to compile configurations in parallel."""
    from ..kernels.config import GemmTiles
    from ..kernels.blocks import assign_blocks
    from ..kernels.index_gather import expert_down, expert_gate_up

    done = 0
    for job in jobs:
        d, f, top_k, block_m = job["d"], job["f"], job["top_k"], job["block_m"]
        tiles = GemmTiles(**job["tiles"])
        on = dict(device=job["device"], dtype=getattr(torch, job["dtype"]))
        try:
            ids = torch.zeros(4, top_k, dtype=torch.int32, device=job["device"])
            blocks = assign_blocks(ids, block_m, 1, naive=job["naive"])
            if job["gated"]:
                expert_gate_up(torch.randn(4, d, **on), torch.randn(1, 2 * f, d, **on), blocks, top_k, tiles=tiles)
            else:
                weights = torch.rand(4, top_k, device=job["device"])
                expert_down(torch.randn(4 * top_k, f, **on), torch.randn(1, d, f, **on), weights, blocks, tiles=tiles,
                            sum_slots=job["sum_slots"])
            done += 1
        except Exception:  # noqa: BLE001 - a config that cannot compile is skipped when timed too
            pass
    return done


def precompile(jobs: list[dict], workers: int, log=print) -> None:
    """Compile many configurations in parallel processes (Triton compiles one kernel per core)."""
    if workers <= 1 or not jobs:
        return
    import moe_kernels.bench.sweep as this_module  # a picklable reference even when run as __main__

    start = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            done = sum(pool.map(this_module._compile_jobs, chunks))
        log(f"precompiled {done}/{len(jobs)} kernels in {time.perf_counter() - start:.0f} s on {workers} processes")
    except Exception as err:  # noqa: BLE001 - compiling serially later is slower, not wrong
        log(f"parallel precompile failed ({err}); kernels compile on first use")


def tune(models, batches, *, dtype, seed, warmup_ms, rep_ms, workers, budget_s=math.inf, log=print,
         device="cuda", refine=False) -> list[dict]:
    """For each model and batch, the fastest (block_m, GEMM 1 tiles, GEMM 2 tiles) measured.

    ``models`` maps names to models; batches are tuned in the order given until ``budget_s``
    seconds (compilation included) have passed; the rest keep the default configuration. With
    ``refine``, only the configuration :func:`~moe_kernels.kernels.config.get_config` picks today
    is timed, with each of its GEMMs with and without TMA and on each grid (an A/B of that
    machinery on otherwise equal tiles)."""
    from ..kernels.config import get_config
    from ..kernels.blocks import use_naive_block_assignment
    from ..kernels.config import MoEConfig
    from ..kernels.blocks import assign_blocks
    from ..kernels.combine import moe_sum
    from ..kernels.index_gather import expert_down, expert_gate_up

    start = time.perf_counter()
    plans = []
    jobs = []
    for batch in batches:
        for key, model in models.items():
            rho = batch * model.top_k / model.num_experts
            naive = use_naive_block_assignment(batch, model.top_k, model.num_experts)
            base = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, dtype,
                              device) if refine else None
            for bm in [base.block_m] if refine else block_m_candidates(rho):
                for gated, summed, tiles in _candidates(rho, bm, base=base):
                    jobs.append({"d": model.hidden_size, "f": model.moe_intermediate_size, "top_k": model.top_k,
                                 "block_m": bm, "naive": naive, "gated": gated, "sum_slots": summed,
                                 "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                                 "tiles": dataclasses.asdict(tiles)})
            plans.append((key, batch, rho))
    unique = {json.dumps(j, sort_keys=True): j for j in jobs}
    precompile(list(unique.values()), workers, log)

    entries = []
    weights_of = {key: make_weights(model, dtype, seed, device) for key, model in models.items()}
    _warm_up(device)
    for key, batch, rho in plans:
        if time.perf_counter() - start > budget_s:
            log(f"tuning budget of {budget_s:.0f} s spent: {key} batch {batch} and later are not tuned (they keep "
                f"what the tables hold)")
            break
        model = models[key]
        w1, w2 = weights_of[key]
        hidden, _, weights, ids = make_batch(model, batch, dtype, seed + batch, device)
        numel = ids.numel()
        inter = torch.empty(numel, model.moe_intermediate_size, device=device, dtype=dtype)
        per_slot = torch.empty(batch, model.top_k, model.hidden_size, device=device, dtype=dtype)
        summed = torch.empty(batch, model.hidden_size, device=device, dtype=torch.float32)
        out = torch.empty(batch, model.hidden_size, device=device, dtype=dtype)
        per_block_m = {}   # MoEConfig -> (GEMM 1 ms, GEMM 2 with its sum ms)
        tried = []
        base = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, dtype,
                          device) if refine else None
        for bm in [base.block_m] if refine else block_m_candidates(rho):
            blocks = assign_blocks(ids, bm, model.num_experts, validate_ids=False)

            def timed(call, what):
                # Replayed from a CUDA graph, as the layer runs in an engine: launch overhead excluded.
                try:
                    return median_ms(graphed(call), warmup_ms, rep_ms)
                except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                    tried.append({"block_m": bm, **what, "error": str(err)[:120]})
                    return math.inf

            def gate_up(t):
                return lambda: expert_gate_up(hidden, w1, blocks, model.top_k, tiles=t, out=inter)

            def down_and_sum(t, sum_in_gemm):
                # GEMM 2 with the top-k sum, whichever way it is done, into the [T, d] output.
                if sum_in_gemm:
                    def run():
                        summed.zero_()
                        expert_down(inter, w2, weights, blocks, tiles=t, out=summed, sum_slots=True)
                        out.copy_(summed)
                else:
                    def run():
                        moe_sum(expert_down(inter, w2, weights, blocks, tiles=t, out=per_slot), out=out)
                return run

            up_times = {t: timed(gate_up(t), {"gemm": "gate_up", "tiles": dataclasses.asdict(t)})
                        for _, _, t in _candidates(rho, bm, gemm="gate_up", base=base)}
            best_up = plainest_best(up_times, plain_tiles)
            expert_gate_up(hidden, w1, blocks, model.top_k, tiles=best_up, out=inter)  # real data for GEMM 2
            down_times = {(sm, t): timed(down_and_sum(t, sm), {"gemm": "down", "sum_in_gemm": sm,
                                                               "tiles": dataclasses.asdict(t)})
                          for _, sm, t in _candidates(rho, bm, gemm="down", base=base)}
            best_sum, best_down = plainest_best(down_times, lambda key: not key[0] and plain_tiles(key[1]))
            for t, ms in up_times.items():
                tried.append({"gemm": "gate_up", "block_m": bm, "tiles": dataclasses.asdict(t), "ms": ms})
            for (sm, t), ms in down_times.items():
                tried.append({"gemm": "down", "block_m": bm, "sum_in_gemm": sm, "tiles": dataclasses.asdict(t),
                              "ms": ms})
            per_block_m[MoEConfig(bm, best_up, best_down, best_sum)] = (up_times[best_up],
                                                                         down_times[best_sum, best_down])
        # Across M tiles the same rule: machinery must win by the margin over the best plain config.
        cfg = plainest_best({c: sum(t) for c, t in per_block_m.items()},
                            lambda c: not c.sum_in_gemm and plain_tiles(c.gate_up) and plain_tiles(c.down))
        (t_up, t_down), total = per_block_m[cfg], sum(per_block_m[cfg])
        log(f"{key:<14} batch {batch:>6}: {total * 1e3:8.1f} us (gate_up {t_up * 1e3:.1f} + down and sum "
            f"{t_down * 1e3:.1f}) block_m {cfg.block_m} gate_up {_short(cfg.gate_up)} down {_short(cfg.down)}"
            f"{' summed in GEMM 2' if cfg.sum_in_gemm else ''}")
        entries.append({"model": key, "E": model.num_experts, "N": model.moe_intermediate_size, "K": model.hidden_size,
                        "M": batch, "config": cfg.to_dict(), "gemm_ms": {"gate_up": t_up, "down": t_down},
                        "tried": [t for t in tried if t.get("ms", 0) != math.inf]})
        del hidden, weights, ids, inter, per_slot, summed, out
    return entries


#: A candidate that adds machinery (the top-k sum by atomics, split-K, TMA, a persistent grid) must beat the best
#: plain one by more than this fraction, about the run-to-run spread of one timing, to be chosen:
#: otherwise the deterministic pointer-load kernel wins.
MACHINERY_MARGIN = 0.03


def plain_tiles(tiles) -> bool:
    """No split-K, no TMA, one program per tile: the kernel without any of the optional machinery."""
    return tiles.split_k == 1 and not tiles.tma and not tiles.persistent


def plainest_best(times: dict, is_plain) -> object:
    """The fastest key of ``times`` (key -> ms), unless a key for which ``is_plain(key)`` holds is
    within :data:`MACHINERY_MARGIN` of it; then the fastest such key.

        >>> from moe_kernels.kernels.config import GemmTiles
        >>> plain, tma = GemmTiles(64, 128), GemmTiles(64, 128, tma=True)
        >>> plainest_best({plain: 1.00, tma: 0.99}, plain_tiles) is plain
        True
        >>> plainest_best({plain: 1.00, tma: 0.90}, plain_tiles) is tma
        True
    """
    best = min(times, key=times.get)
    plain_keys = [k for k in times if is_plain(k)]
    if plain_keys:
        best_plain = min(plain_keys, key=times.get)
        if times[best_plain] <= times[best] * (1 + MACHINERY_MARGIN):
            return best_plain
    return best


def _candidates(rho: float, block_m: int, gemm: str | None = None, base=None):
    """``(gated, sum_in_gemm, tiles)`` to try for GEMM 1 (``gemm="gate_up"``), GEMM 2 (``"down"``)
    or both (None) at ``rho`` rows per expert and M tile ``block_m``. With ``base`` (a
    :class:`~moe_kernels.kernels.config.MoEConfig`, ``--refine``): its own tiles, each with and
    without TMA and in the three grids, and nothing else."""
    if base is not None:
        for persistent in (0, 1, 2):
            for tma in (False, True):
                if gemm in (None, "gate_up"):
                    yield True, False, dataclasses.replace(base.gate_up, tma=tma, persistent=persistent)
                if gemm in (None, "down"):
                    yield False, base.sum_in_gemm, dataclasses.replace(base.down, tma=tma, persistent=persistent)
        return
    if gemm in (None, "gate_up"):
        yield from ((True, False, t) for t in tile_candidates(rho, block_m, True))
    if gemm in (None, "down"):
        for t in tile_candidates(rho, block_m, False):
            for sum_in_gemm, split in down_variants(rho):
                yield False, sum_in_gemm, dataclasses.replace(t, split_k=split)


def _warm_up(device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a moment: an idle GPU clocks down, and the first candidates timed
    would otherwise pay for the clock ramp (seen: a first tuned batch measured 2x slow)."""
    if torch.device(device).type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _short(t) -> str:
    return (f"n{t.block_n} k{t.block_k} g{t.group_m} w{t.num_warps} s{t.num_stages}"
            + (f" split{t.split_k}" if t.split_k > 1 else "") + (" tma" if t.tma else "")
            + (f" persistent{t.persistent}" if t.persistent else ""))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--batches", type=_int_list, default=list(DEFAULT_BATCHES), help="comma list of token counts")
    parser.add_argument("--layouts", default=None, help="comma list of other layouts to time (default: all that import)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays of our layout")
    parser.add_argument("--configs", default=None, help="a --tune output whose configs our layout uses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=50.0)
    parser.add_argument("--record", action="store_true", help="write results/<device>/<name>.json")
    parser.add_argument("--name", default=None, help="record name (default fused-moe-sweep / fused-moe-tuning)")
    parser.add_argument("--results-dir", default=None, help="where results/<device>/ lives (default: the repo's)")
    parser.add_argument("--tune", action="store_true", help="search tile configs instead of sweeping layouts")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes compiling tuning candidates in parallel")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop tuning new batches after this long")
    parser.add_argument("--refine", action="store_true",
                        help="with --tune: time only today's configs, with and without TMA and each grid")
    parser.add_argument("--write-tables", action="store_true",
                        help="with --tune: write the best configs as the tables the kernels load (kernels/configs/)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("moe_kernels.bench: needs a CUDA GPU (timings on the CPU interpreter mean nothing)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    models = {m: MODELS[m] for m in names}
    dtype = torch.bfloat16
    started = time.perf_counter()
    config = {"models": {m: dataclasses.asdict(model) for m, model in models.items()}, "batches": args.batches,
              "dtype": str(dtype), "seed": args.seed, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
              "routing": "uniform: top-k of iid normal logits (fused_topk, renormalised)"}
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.tune:
        entries = tune(models, args.batches, dtype=dtype, seed=args.seed, warmup_ms=args.warmup_ms,
                       rep_ms=args.rep_ms, workers=args.workers, budget_s=args.budget_s, log=log,
                       refine=args.refine)
        data = {"config": config, "device": torch.cuda.get_device_name(), "entries": entries}
        name = args.name or "fused-moe-tuning"
        if args.write_tables:
            _write_tables(entries, dtype, f"results/{_device_dir()}/{name}.json", log)
    else:
        from .ceilings import measure_gemm_rate, measure_hbm_bandwidth, measure_read_bandwidth, measure_read_time_by_size

        ceilings = {"read_bandwidth": measure_read_bandwidth(), "hbm_bandwidth": measure_hbm_bandwidth(),
                    "gemm_rate_bf16": measure_gemm_rate(), "read_by_size": measure_read_time_by_size()}
        log(f"ceilings: read {ceilings['read_bandwidth'] / 1e12:.2f} TB/s, copy {ceilings['hbm_bandwidth'] / 1e12:.2f} "
            f"TB/s, bf16 GEMM {ceilings['gemm_rate_bf16'] / 1e12:.0f} TFLOP/s")
        configs = load_configs(args.configs) if args.configs else None
        config["configs_file"] = args.configs
        layouts = args.layouts.split(",") if args.layouts else None
        name = args.name or "fused-moe-sweep"
        data = {"config": config, "ceilings": ceilings, "rows": [], "complete": False}
        for key, model in models.items():  # record after each model: a cut-short run keeps what it measured
            data["rows"] += sweep({key: model}, args.batches, dtype=dtype, seed=args.seed, warmup_ms=args.warmup_ms,
                                  rep_ms=args.rep_ms, ceilings=ceilings, configs=configs, layouts=layouts,
                                  graphs=not args.no_graphs, log=log)
            data["wall_s"] = time.perf_counter() - started
            if args.record:
                _record(name, data, args.results_dir, log)
        data["complete"] = True
    data["wall_s"] = time.perf_counter() - started
    if args.record:
        _record(name, data, args.results_dir, log)
    return 0


def _device_dir() -> str:
    from ..results import device_slug

    return device_slug(torch.cuda.get_device_name())


def _write_tables(entries: list[dict], dtype: torch.dtype, record: str, log) -> None:
    """One table per tuned shape: the best config at each token count tuned (merged into the
    entries an existing table has at other token counts)."""
    from ..kernels.config import MoEConfig, load_table, table_name, write_table

    device = torch.cuda.get_device_name()
    by_shape: dict = {}
    for entry in entries:
        by_shape.setdefault((entry["E"], entry["N"], entry["K"]), {})[entry["M"]] = MoEConfig.from_dict(entry["config"])
    for (e, n, k), configs in by_shape.items():
        old = load_table(table_name(device, e, n, k, dtype, "index_gather")) or {}
        measured = {"device": device, "torch": torch.__version__, "triton": _triton_version(),
                    "routing": "uniform (top-k of iid normal logits)",
                    "method": "python -m moe_kernels.bench tune --write-tables (GEMM 1 and GEMM 2 with its top-k "
                              "sum timed separately, each replayed from a CUDA graph, L2 flushed)",
                    "record": record}
        path = write_table(device, e, n, k, dtype, "index_gather", {**old, **configs}, measured)
        log(f"wrote {path}")


def _triton_version() -> str:
    import triton

    return triton.__version__


def _record(name: str, data: dict, results_dir: str | None, log) -> None:
    from ..results import record

    path = record(name, data, Path(results_dir) if results_dir else None)
    log(f"recorded {path}")


if __name__ == "__main__":
    sys.exit(main())
