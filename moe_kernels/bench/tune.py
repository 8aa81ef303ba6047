"""Tile tuning for the index-gather layer: ``python -m moe_kernels.bench tune``.

For each model and batch the tuner times candidate configurations of the two grouped GEMMs and
keeps the fastest: the M tile (:func:`block_m_candidates`), N/K tiles, warps and stages
(:func:`tile_candidates`), and how GEMM 2 finishes (:func:`down_variants`: the top-k sum in its
epilogue, split-K), each with and without TMA loads, transposed where a small M tile meets a wide
N tile (``swap_ab``) and, where the GEMM computes, on a persistent grid. GEMM 1 and GEMM 2 with its
top-k sum are timed separately, each replayed from a CUDA graph
(``do_bench`` medians, L2 flushed). A candidate that adds machinery must beat the plain kernel by
:data:`MACHINERY_MARGIN` to be chosen (:func:`plainest_best`). The candidates are compiled first in
parallel processes (:func:`precompile`); ``--budget-s`` stops tuning new batches after a while.

``--format block`` tunes fp8 weights with 128x128 block scales (activations quantised outside
the timed GEMMs, as the layer does before each); its tables are the fp8 ones. ``--refine`` times
only the configuration the kernels pick today, with and without TMA, on each grid and, for a
16- or 32-row M tile, transposed onto 64- and 128-row weight tiles; ``--record`` writes ``results/<device>/<name>.json``; ``--write-tables`` writes the best
configs as the tables the kernels load (``moe_kernels/kernels/configs/``). Timing needs a CUDA GPU;
the candidate lists are plain Python.
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

import torch

from ..model.shapes import MODELS
from .cli import add_record_arguments, add_run_arguments, at_least, log_line, start_run, write_record
from .problems import make_batch, make_weights
from .timing import graphed, median_ms

_SHARED_MEMORY_BYTES = 220 * 1024  # an H100/H200 SM offers 227 KiB to one block; keep a margin


def block_m_candidates(rows_per_expert: float) -> list[int]:
    """M tiles worth trying when each expert gets ``rows_per_expert`` rows on average (where the
    GEMM computes, a smaller tile than the rows also pays: it wastes less on the partial block)."""
    low = rows_per_expert / (4 if rows_per_expert >= 128 else 2)
    picks = [b for b in (16, 32, 64, 128) if low <= b <= 2 * rows_per_expert]
    return picks or [16 if rows_per_expert < 16 else 128]


def tile_candidates(rows_per_expert: float, block_m: int, gated: bool, fmt=None) -> list:
    """N/K tiles, warps and stages to try (for weights of format ``fmt``, default 16-bit).

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
    from ..kernels.formats import UNQUANTIZED

    fmt = fmt or UNQUANTIZED
    if fmt.quantized:   # fp8: 8 warps too (4-warp block-fp8 tiles were seen to lose 2x), K steps <= 128
        grid = grid + [(n, k, g, 8, s) for n, k, g, w, s in grid if w == 4]
    weight_tiles = 2 if gated else 1
    element_bytes = 1 if fmt.quantized else 2
    out = []
    for n, k, group, warps, stages in dict.fromkeys(grid):
        k = fmt.gemm_tiles(GemmTiles(n, k)).block_k   # the K step the kernel will run
        if gated and n > 128:
            continue  # two accumulators of BLOCK_M x 256 do not fit in registers
        if stages * (block_m * k + weight_tiles * n * k) * element_bytes > _SHARED_MEMORY_BYTES:
            continue
        # A 16- or 32-row M tile compiles to mma.sync; with 64+ weight rows per tile the transposed
        # product (swap_ab) puts them on the MMA's M side, where Hopper's wgmma can take them.
        swaps = (False, True) if block_m <= 32 and n >= 64 else (False,)
        for tma in (False, True):   # weight tiles by pointer loads or by the copy engine (TMA)
            # Where the GEMM computes, also a persistent grid (1) and its flattened pipeline (2).
            for persistent in (0, 1, 2) if rows_per_expert >= 128 else (0,):
                for swap_ab in swaps:
                    out.append(GemmTiles(n, k, group, warps, stages, tma=tma, persistent=persistent, swap_ab=swap_ab))
    return list(dict.fromkeys(out))   # fp8's K clamp makes some candidates equal


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
    from ..kernels.formats import FORMATS
    from ..kernels.index_gather import expert_down, expert_gate_up

    done = 0
    for job in jobs:
        d, f, top_k, block_m = job["d"], job["f"], job["top_k"], job["block_m"]
        tiles = GemmTiles(**job["tiles"])
        fmt = FORMATS[job.get("format", "none")]
        on = dict(device=job["device"], dtype=getattr(torch, job["dtype"]))
        try:
            ids = torch.zeros(4, top_k, dtype=torch.int32, device=job["device"])
            blocks = assign_blocks(ids, block_m, 1, naive=job["naive"])
            if job["gated"]:
                w, w_scale = fmt.quantize_weight(torch.randn(1, 2 * f, d, **on))
                x, x_scale = fmt.quantize_activations(torch.randn(4, d, **on))
                expert_gate_up(x, w, blocks, top_k, tiles=tiles, a_scale=x_scale, w_scale=w_scale,
                               out_dtype=on["dtype"])
            else:
                weights = torch.rand(4, top_k, device=job["device"])
                w, w_scale = fmt.quantize_weight(torch.randn(1, d, f, **on))
                y, y_scale = fmt.quantize_activations(torch.randn(4 * top_k, f, **on))
                expert_down(y, w, weights, blocks, tiles=tiles, a_scale=y_scale, w_scale=w_scale,
                            out_dtype=on["dtype"], sum_slots=job["sum_slots"])
            done += 1
        except Exception:  # noqa: BLE001 - a config that cannot compile is skipped when timed too
            pass
    return done


def precompile(jobs: list[dict], workers: int, log=print) -> None:
    """Compile many configurations in parallel processes (Triton compiles one kernel per core)."""
    if workers <= 1 or not jobs:
        return
    import moe_kernels.bench.tune as this_module  # a picklable reference even when run as __main__

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
         device="cuda", refine=False, weight_format: str = "none") -> list[dict]:
    """For each model and batch, the fastest (block_m, GEMM 1 tiles, GEMM 2 tiles) measured.

    ``models`` maps names to models; batches are tuned in the order given until ``budget_s``
    seconds (compilation included) have passed; the rest keep the default configuration. With
    ``refine``, only the configuration :func:`~moe_kernels.kernels.config.get_config` picks today
    is timed, with each of its GEMMs with and without TMA and on each grid (an A/B of that
    machinery on otherwise equal tiles). ``weight_format`` is a key of
    :data:`~moe_kernels.kernels.formats.FORMATS` ("none": ``dtype`` weights; "block": fp8 with
    128x128 block scales, whose tables are the fp8 ones)."""
    from ..kernels.config import get_config
    from ..kernels.formats import FORMATS

    fmt = FORMATS[weight_format]
    table_dtype = fmt.element or dtype
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
            base = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                              table_dtype, device) if refine else None
            for bm in [base.block_m] if refine else block_m_candidates(rho):
                for gated, summed, tiles in _candidates(rho, bm, base=base, fmt=fmt):
                    jobs.append({"d": model.hidden_size, "f": model.moe_intermediate_size, "top_k": model.top_k,
                                 "block_m": bm, "naive": naive, "gated": gated, "sum_slots": summed,
                                 "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                                 "format": weight_format, "tiles": dataclasses.asdict(tiles)})
            plans.append((key, batch, rho))
    unique = {json.dumps(j, sort_keys=True): j for j in jobs}
    precompile(list(unique.values()), workers, log)

    entries = []
    weights_of = {}
    for key, model in models.items():   # (w1, w1_scale, w2, w2_scale) in the format tuned
        w1, w2 = make_weights(model, dtype, seed, device)
        weights_of[key] = (*fmt.quantize_weight(w1), *fmt.quantize_weight(w2))
        del w1, w2
    _warm_up(device)
    for key, batch, rho in plans:
        if time.perf_counter() - start > budget_s:
            log(f"tuning budget of {budget_s:.0f} s spent: {key} batch {batch} and later are not tuned (they keep "
                f"what the tables hold)")
            break
        model = models[key]
        w1, w1_scale, w2, w2_scale = weights_of[key]
        hidden, _, weights, ids = make_batch(model, batch, dtype, seed + batch, device)
        x, x_scale = fmt.quantize_activations(hidden)   # as the layer does, before GEMM 1
        numel = ids.numel()
        inter = torch.empty(numel, model.moe_intermediate_size, device=device, dtype=dtype)
        per_slot = torch.empty(batch, model.top_k, model.hidden_size, device=device, dtype=dtype)
        summed = torch.empty(batch, model.hidden_size, device=device, dtype=torch.float32)
        out = torch.empty(batch, model.hidden_size, device=device, dtype=dtype)
        per_block_m = {}   # MoEConfig -> (GEMM 1 ms, GEMM 2 with its sum ms)
        tried = []
        base = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, table_dtype,
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
                return lambda: expert_gate_up(x, w1, blocks, model.top_k, tiles=t, out=inter, a_scale=x_scale,
                                              w_scale=w1_scale, out_dtype=dtype)

            def down_and_sum(t, sum_in_gemm):
                # GEMM 2 with the top-k sum, whichever way it is done, into the [T, d] output.
                if sum_in_gemm:
                    def run():
                        summed.zero_()
                        expert_down(y, w2, weights, blocks, tiles=t, out=summed, sum_slots=True, a_scale=y_scale,
                                    w_scale=w2_scale)
                        out.copy_(summed)
                else:
                    def run():
                        moe_sum(expert_down(y, w2, weights, blocks, tiles=t, out=per_slot, a_scale=y_scale,
                                            w_scale=w2_scale, out_dtype=dtype), out=out)
                return run

            up_times = {t: timed(gate_up(t), {"gemm": "gate_up", "tiles": dataclasses.asdict(t)})
                        for _, _, t in _candidates(rho, bm, gemm="gate_up", base=base, fmt=fmt)}
            best_up = plainest_best(up_times, plain_tiles)
            gate_up(best_up)()   # real data for GEMM 2, quantised as the layer quantises it
            y, y_scale = fmt.quantize_activations(inter)
            down_times = {(sm, t): timed(down_and_sum(t, sm), {"gemm": "down", "sum_in_gemm": sm,
                                                               "tiles": dataclasses.asdict(t)})
                          for _, sm, t in _candidates(rho, bm, gemm="down", base=base, fmt=fmt)}
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
        log(f"{key:<14} {fmt.name:<11} batch {batch:>6}: {total * 1e3:8.1f} us (gate_up {t_up * 1e3:.1f} + down and sum "
            f"{t_down * 1e3:.1f}) block_m {cfg.block_m} gate_up {_short(cfg.gate_up)} down {_short(cfg.down)}"
            f"{' summed in GEMM 2' if cfg.sum_in_gemm else ''}")
        entries.append({"model": key, "format": weight_format, "E": model.num_experts, "N": model.moe_intermediate_size, "K": model.hidden_size,
                        "M": batch, "config": cfg.to_dict(), "gemm_ms": {"gate_up": t_up, "down": t_down},
                        "tried": [t for t in tried if t.get("ms", 0) != math.inf]})
        del hidden, x, x_scale, weights, ids, inter, per_slot, summed, out
    return entries


#: A candidate that adds machinery (the top-k sum by atomics, split-K, TMA, a persistent grid, the
#: transposed product) must beat the best plain one by more than this fraction, about the run-to-run
#: spread of one timing, to be chosen: otherwise the deterministic pointer-load kernel wins.
MACHINERY_MARGIN = 0.03


def plain_tiles(tiles) -> bool:
    """No split-K, no TMA, one program per tile, not transposed: the kernel without any of the
    optional machinery."""
    return tiles.split_k == 1 and not tiles.tma and not tiles.persistent and not tiles.swap_ab


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


def _candidates(rho: float, block_m: int, gemm: str | None = None, base=None, fmt=None):
    """``(gated, sum_in_gemm, tiles)`` to try for GEMM 1 (``gemm="gate_up"``), GEMM 2 (``"down"``)
    or both (None) at ``rho`` rows per expert and M tile ``block_m``, for weights of format
    ``fmt``. With ``base`` (a :class:`~moe_kernels.kernels.config.MoEConfig`, ``--refine``): its
    own tiles, each with and without TMA and in the three grids, and for a 16- or 32-row M tile
    the same tiles transposed (``swap_ab``) onto 64- and 128-row weight tiles, and nothing else."""
    if base is not None:
        for tiles, gated in ((base.gate_up, True), (base.down, False)):
            if gemm not in (None, "gate_up" if gated else "down"):
                continue
            for variant in dict.fromkeys(_refinements(tiles, block_m)):
                yield gated, False if gated else base.sum_in_gemm, variant
        return
    if gemm in (None, "gate_up"):
        yield from ((True, False, t) for t in tile_candidates(rho, block_m, True, fmt))
    if gemm in (None, "down"):
        for t in tile_candidates(rho, block_m, False, fmt):
            for sum_in_gemm, split in down_variants(rho):
                yield False, sum_in_gemm, dataclasses.replace(t, split_k=split)


def _refinements(tiles, block_m: int):
    """``--refine``'s variants of one GEMM's tiles: TMA on and off on each grid; for a 16- or
    32-row M tile also transposed (A/B of the transposed product: its N tile becomes the MMA's M,
    so it needs 64 or more rows to reach wgmma)."""
    for persistent in (0, 1, 2):
        for tma in (False, True):
            yield dataclasses.replace(tiles, tma=tma, persistent=persistent, swap_ab=False)
    if block_m <= 32:
        for block_n in sorted({max(64, tiles.block_n), 128}):
            for tma in (False, True):
                yield dataclasses.replace(tiles, block_n=block_n, tma=tma, persistent=0, swap_ab=True)


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
            + (f" persistent{t.persistent}" if t.persistent else "") + (" swap" if t.swap_ab else ""))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench tune", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, warmup_ms=10.0, rep_ms=50.0)
    add_record_arguments(parser, "fused-moe-tuning")
    parser.add_argument("--workers", type=at_least(int, 0), default=min(12, os.cpu_count() or 1),
                        help="processes compiling tuning candidates in parallel")
    parser.add_argument("--budget-s", type=at_least(float, 0), default=math.inf,
                        help="stop tuning new batches after this long")
    parser.add_argument("--refine", action="store_true",
                        help="time only today's configs, with and without TMA, each grid, and transposed (swap_ab)")
    parser.add_argument("--format", choices=["none", "block"], default="none",
                        help="weights: bf16 (none) or fp8 with 128x128 block scales (block)")
    parser.add_argument("--write-tables", action="store_true",
                        help="write the best configs as the tables the kernels load (kernels/configs/)")
    dtype = torch.bfloat16
    args, config = start_run(parser, argv, dtype)
    if config is None:
        return 2
    started = time.perf_counter()
    entries = tune({m: MODELS[m] for m in args.models}, args.batches, dtype=dtype, seed=args.seed,
                   warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, workers=args.workers, budget_s=args.budget_s,
                   log=log_line, refine=args.refine, weight_format=args.format)
    data = {"config": config, "device": torch.cuda.get_device_name(), "entries": entries}
    name = args.name or ("fused-moe-tuning" if args.format == "none" else f"fused-moe-tuning-fp8-{args.format}")
    if args.write_tables:
        from ..kernels.formats import FORMATS

        _write_tables(entries, FORMATS[args.format].element or dtype, f"results/{_device_dir()}/{name}.json",
                      args.format, log_line)
    data["wall_s"] = time.perf_counter() - started
    if args.record:
        write_record(name, data, args.results_dir, log_line)
    return 0


def _device_dir() -> str:
    from ..results import device_slug

    return device_slug(torch.cuda.get_device_name())


def _write_tables(entries: list[dict], dtype: torch.dtype, record: str, weight_format: str, log) -> None:
    """One table per tuned shape: the best config at each token count tuned (merged into the
    entries an existing table has at other token counts)."""
    from ..kernels.config import MoEConfig, load_table, table_name, write_table

    device = torch.cuda.get_device_name()
    by_shape: dict = {}
    for entry in entries:
        by_shape.setdefault((entry["E"], entry["N"], entry["K"]), {})[entry["M"]] = MoEConfig.from_dict(entry["config"])
    for (e, n, k), configs in by_shape.items():
        name = table_name(device, e, n, k, dtype, "index_gather")
        old = load_table(name) or {}
        kept = sorted(set(old) - set(configs))
        old_measured = _table_measured(name)
        measured = {"device": device, "torch": torch.__version__, "triton": _triton_version(),
                    "routing": "uniform (top-k of iid normal logits)",
                    "weights": "bf16" if weight_format == "none" else f"fp8, format {weight_format!r} "
                               "(128x128 block scales, 1x128 activation groups)",
                    "method": "python -m moe_kernels.bench tune --write-tables (GEMM 1 and GEMM 2 with its top-k "
                              "sum timed separately, each replayed from a CUDA graph, L2 flushed)",
                    "record": record, "tuned_token_counts": sorted(configs)}
        if kept and old_measured:   # say where the entries this run did not tune come from
            measured["other_token_counts"] = {"tokens": kept, "measured": old_measured}
        path = write_table(device, e, n, k, dtype, "index_gather", {**old, **configs}, measured)
        log(f"wrote {path}")


def _table_measured(name: str) -> dict:
    """The ``measured`` block of an existing table (empty if none)."""
    from ..kernels.config import CONFIG_DIR

    path = CONFIG_DIR / f"{name}.json"
    return json.loads(path.read_text()).get("measured", {}) if path.exists() else {}


def _triton_version() -> str:
    import triton

    return triton.__version__



if __name__ == "__main__":
    sys.exit(main())
