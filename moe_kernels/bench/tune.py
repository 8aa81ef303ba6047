"""Tile tuning for the index-gather layer: ``python -m moe_kernels.bench tune``.

For each model and batch the tuner times candidate configurations of the two grouped GEMMs and
keeps the fastest (the candidates: :mod:`moe_kernels.bench.tune_candidates`): the M tile, N/K
tiles, warps and stages, and how GEMM 2 finishes (the top-k sum in its
epilogue, split-K), each with and without TMA loads, transposed where a small M tile meets a wide
N tile (``swap_ab``) and, where the GEMM computes, on a persistent grid. GEMM 1 and GEMM 2 with its
top-k sum are timed separately, each replayed from a CUDA graph
(``do_bench`` medians, L2 flushed). A candidate that adds machinery must beat the plain kernel by
:data:`~moe_kernels.bench.tune_candidates.MACHINERY_MARGIN` to be chosen
(:func:`~moe_kernels.bench.tune_candidates.plainest_best`). The candidates are compiled first in
parallel processes (:func:`precompile`); ``--budget-s`` stops tuning new batches after a while.

``--shared`` tunes the models' shared experts instead: one expert of ``num_shared_experts * F``
rows that every token uses, timed on the dense block map the layer runs it on (no index, GEMM 2
storing each row once, GEMM 1 also split over K: at decode it has a single M block, so few
programs); its tables are the ``E=1`` ones, which the layer's shared-expert lookup reads.
``--fused-shared`` tunes routed experts with the shared expert fused as slot ``E`` (SGLang's way): every
token's top-k plus that slot, ``k + 1`` rows a token over ``E + 1`` experts; its tables are the ``E + 1``
ones, which a layer built with ``shared_expert="fused"`` reads
(:func:`~moe_kernels.kernels.config.choose_fused_shared_config`); each pick is timed against the routed table's
entry (the slot's fallback) as one experts call, and that entry written where faster (Chapter 8 says why).

``--format block`` tunes fp8 weights with 128x128 block scales (activations quantised outside
the timed GEMMs, as the layer does before each); its tables are the fp8 ones. ``--refine`` times
only the configuration the kernels pick today, with and without TMA, on each grid and, for a
16- or 32-row M tile, transposed onto 64- and 128-row weight tiles (each grid too). Either way the chosen tiles
are then timed as one experts call with and without the switches that act between the GEMMs: GEMM
2 launched as a programmatic dependent of GEMM 1 (``MoEConfig.pdl``, Hopper) and, in fp8, GEMM 1's
epilogue quantising GEMM 2's input (``MoEConfig.quant_in_gemm``), and both GEMMs as one stream of tiles
(``MoEConfig.stream_lag``, at a lag of :data:`STREAM_LAG` blocks, with GEMM 1's warps and with the other
count). ``--record`` writes ``results/<device>/<name>.json``;
``--write-tables`` writes the best configs as the tables the kernels load
(``moe_kernels/kernels/configs/``). Timing needs a CUDA GPU; the candidate lists are plain Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

from ..model.shapes import MODELS, shared_expert_shape
from .cli import add_record_arguments, add_run_arguments, at_least, log_line, start_run, write_record
from .problems import make_batch, make_weights
from .timing import graphed, median_ms
from .tune_compile import precompile
from .tune_candidates import (MACHINERY_MARGIN, block_m_candidates, candidates, down_variants,  # noqa: F401
                              fits, plain_tiles, plainest_best, short, tile_candidates)
from .tune_tables import write_tables

#: The lag the tuner gives the streamed pair: 32 blocks measured best of 2-64 and "all" on Qwen3-30B-A3B
#: (``results/nvidia-h200/streamed-pair-ab*.json``).
STREAM_LAG = 32


def tune(models, batches, *, dtype, seed, warmup_ms, rep_ms, workers, budget_s=math.inf, log=print,
         device="cuda", refine=False, weight_format: str = "none", shared: bool = False,
         fused_shared: bool = False) -> list[dict]:
    """For each model and batch, the fastest (block_m, GEMM 1 tiles, GEMM 2 tiles) measured.

    ``models`` maps names to models; batches are tuned in the order given until ``budget_s``
    seconds (compilation included) have passed; the rest keep the default configuration. With
    ``refine``, only the configuration :func:`~moe_kernels.kernels.config.get_config` picks today
    is timed, with each of its GEMMs with and without TMA and on each grid (an A/B of that
    machinery on otherwise equal tiles). Either way the chosen tiles are then timed as one experts
    call with each combination of the switches between the GEMMs (``MoEConfig.pdl``,
    ``MoEConfig.quant_in_gemm``). ``weight_format`` is a key of
    :data:`~moe_kernels.kernels.formats.FORMATS` ("none": ``dtype`` weights; "block": fp8 with
    128x128 block scales, whose tables are the fp8 ones). ``shared``: ``models`` are shared
    experts (:func:`~moe_kernels.model.shapes.shared_expert_shape`), tuned on the dense block map
    as the layer runs them (not with ``refine``). ``fused_shared``: each model's routed experts with one
    more expert, the shared one, in every token's ids as slot ``k + 1`` (entries keyed ``E + 1``), and the routed
    table's entry written instead where it ran the fused experts call faster (each entry's ``routed_tiles``)."""
    from .._checks import fail
    from ..kernels._pdl import pdl_available
    from ..kernels.blocks import assign_blocks, dense_blocks, naive_group_size, use_naive_block_assignment
    from ..kernels.combine import moe_sum
    from ..kernels.config import MoEConfig, choose_fused_shared_config, get_config
    from ..kernels.formats import FORMATS
    from ..kernels.index_gather import dense_expert, down, expert_down, expert_gate_up, run_experts
    from ..kernels.one_launch import runs_in_one_launch
    from ..kernels.routing import append_shared_expert

    fmt = FORMATS[weight_format]
    table_dtype = fmt.element or dtype
    if shared and refine:
        fail("tune", "refine", "must be False with shared=True (a shared expert's table comes from a full tune)", refine)
    if shared and any(model.num_experts != 1 or model.top_k != 1 for model in models.values()):
        fail("tune", "models", "must be one-expert, top-1 shapes with shared=True (shared_expert_shape)",
             sorted(models))
    if fused_shared and (shared or any(model.num_shared_experts != 1 for model in models.values())):
        fail("tune", "models", "must each have one shared expert of the routed width with fused_shared=True "
             "(and shared=False)", sorted(models))

    def slots(model):   # (experts, rows a token) of the problem tuned: the shared slot fused adds one of each
        return model.num_experts + fused_shared, model.top_k + fused_shared

    def todays(batch, model):   # what a call runs today (--refine's start): the fused slot's own lookup if fused
        args = (batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, table_dtype, device)
        return choose_fused_shared_config(*args).config if fused_shared else get_config(*args)

    start = time.perf_counter()
    plans = []
    jobs = []
    for batch in batches:
        for key, model in models.items():
            experts, top_k = slots(model)
            rho = batch * top_k / experts
            dense = shared   # a shared expert (--shared): the dense block map
            naive = not dense and use_naive_block_assignment(batch, top_k, experts, block_fp8=fmt.scales == "block")
            base = todays(batch, model) if refine else None
            for bm in [base.block_m] if refine else block_m_candidates(rho):
                for gated, summed, tiles in candidates(rho, bm, base=base, fmt=fmt, dense=dense):
                    jobs.append({"d": model.hidden_size, "f": model.moe_intermediate_size, "top_k": top_k,
                                 "block_m": bm, "naive": naive, "dense": dense, "gated": gated, "sum_slots": summed,
                                 "naive_group": naive_group_size(batch, top_k) if naive else 0,
                                 "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                                 "format": weight_format, "tiles": dataclasses.asdict(tiles)})
            plans.append((key, batch, rho))
    unique = {json.dumps(j, sort_keys=True): j for j in jobs}
    precompile(list(unique.values()), workers, log)

    entries = []
    weights_of = {}
    for key, model in models.items():   # (w1, w1_scale, w2, w2_scale) in the format tuned
        w1, w2 = make_weights(dataclasses.replace(model, num_experts=slots(model)[0]), dtype, seed, device)
        weights_of[key] = (*fmt.quantize_weight(w1), *fmt.quantize_weight(w2))
        del w1, w2
    _warm_up(device)
    for key, batch, rho in plans:
        if time.perf_counter() - start > budget_s:
            log(f"tuning budget of {budget_s:.0f} s spent: {key} batch {batch} and later are not tuned (they keep "
                f"what the tables hold)")
            break
        model = models[key]
        experts, top_k = slots(model)
        naive = use_naive_block_assignment(batch, top_k, experts, block_fp8=fmt.scales == "block")   # (the layer's)
        w1, w1_scale, w2, w2_scale = weights_of[key]
        hidden, _, weights, ids = make_batch(model, batch, dtype, seed + batch, device)
        if fused_shared:   # as the layer splices it in: id E, weight 1, in every token's last slot
            weights, ids = append_shared_expert(weights, ids, model.num_experts)
        x, x_scale = fmt.quantize_activations(hidden)   # as the layer does, before GEMM 1
        numel = ids.numel()
        inter = torch.empty(numel, model.moe_intermediate_size, device=device, dtype=dtype)
        per_slot = torch.empty(batch, top_k, model.hidden_size, device=device, dtype=dtype)
        summed = torch.empty(batch, model.hidden_size, device=device, dtype=torch.float32)
        out = torch.empty(batch, model.hidden_size, device=device, dtype=dtype)
        per_block_m = {}   # MoEConfig -> (GEMM 1 ms, GEMM 2 with its sum ms)
        tried = []
        base = todays(batch, model) if refine else None
        dense = shared
        for bm in [base.block_m] if refine else block_m_candidates(rho):
            blocks = (dense_blocks(batch, bm, ids) if dense
                      else assign_blocks(ids, bm, experts, naive=naive, validate_ids=False))

            def timed(call, what):
                # Replayed from a CUDA graph, as the layer runs in an engine: launch overhead excluded.
                try:
                    return median_ms(graphed(call), warmup_ms, rep_ms)
                except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                    tried.append({"block_m": bm, **what, "error": str(err)[:120]})
                    return math.inf

            def gate_up(t):
                return lambda: expert_gate_up(x, w1, blocks, top_k, tiles=t, out=inter, a_scale=x_scale,
                                              w_scale=w1_scale, out_dtype=dtype)

            def down_and_sum(t, sum_in_gemm):
                # GEMM 2 with the top-k sum, whichever way it is done, into the [T, d] output.
                if dense:   # one row per token, weight 1, stored once: as dense_expert runs it
                    def run():
                        down(y, w2, None, blocks, tiles=t, out=out, a_scale=y_scale, w_scale=w2_scale, fmt=fmt,
                             sum_slots=False)
                elif sum_in_gemm:
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
                        for _, _, t in candidates(rho, bm, gemm="gate_up", base=base, fmt=fmt, dense=dense)}
            best_up = plainest_best(up_times, plain_tiles)
            gate_up(best_up)()   # real data for GEMM 2, quantised as the layer quantises it
            y, y_scale = fmt.quantize_activations(inter)
            down_times = {(sm, t): timed(down_and_sum(t, sm), {"gemm": "down", "sum_in_gemm": sm,
                                                               "tiles": dataclasses.asdict(t)})
                          for _, sm, t in candidates(rho, bm, gemm="down", base=base, fmt=fmt, dense=dense)}
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
        # Switches that act between the GEMMs show only when both run in one graph: the experts call
        # (quantisers and the sum included) with each combination, kept if it wins by the margin. The
        # fused quantiser needs GEMM 1 tiles of whole 128-column groups: a narrower tile is tried
        # widened to 128 columns (with as many stages as fit) for it.
        quant_ok = fmt.activations == "group"
        wide_up = dataclasses.replace(cfg.gate_up, split_k=1)   # (the fused quantiser needs whole K sums)
        while quant_ok and wide_up.block_n % fmt.block[1]:
            stages = wide_up.num_stages
            while stages > 2 and not fits(cfg.block_m, fmt.block[1], wide_up.block_k, stages, True, fmt,
                                          wide_up.k_chunks):
                stages -= 1
            wide_up = dataclasses.replace(wide_up, block_n=fmt.block[1], num_stages=stages)
        combos = [(pdl, quant) for pdl in ((False, True) if pdl_available(torch.device(device)) else (False,))
                  for quant in ((False, True) if quant_ok else (False,))]
        # Both GEMMs as one stream of tiles (MoEConfig.stream_lag; moe_kernels.kernels.streamed_pair): GEMM 1's
        # tiles (whole groups in fp8: the stream quantises in GEMM 1's epilogue), a lag of STREAM_LAG blocks, the
        # kernel's warps GEMM 1's or the other count (8 warps made the fp8 stream 1.29x slower at 256 tokens).
        streams = []
        if not dense and not cfg.sum_in_gemm and cfg.down.split_k == 1 and not cfg.down.persistent:
            stream_up = dataclasses.replace(wide_up if fmt.quantized else cfg.gate_up, split_k=1, persistent=0,
                                            k_chunks=1)   # (the stream's kernel has no chunked K loop)
            if not fmt.quantized or quant_ok:
                other_warps = 8 if stream_up.num_warps == 4 else 4
                streams = [dataclasses.replace(cfg, stream_lag=STREAM_LAG,
                                               gate_up=dataclasses.replace(stream_up, num_warps=warps),
                                               down=dataclasses.replace(cfg.down, k_chunks=1))
                           for warps in dict.fromkeys((stream_up.num_warps, other_warps))]
        switch_ms = {}
        if dense:   # dense_expert runs neither switch: the tiles alone, timed as it runs them
            combos = []
            try:
                switch_ms[cfg] = median_ms(graphed(lambda: dense_expert(
                    hidden, w1[0], w2[0], fmt=fmt, config=cfg, w1_scale=None if w1_scale is None else w1_scale[0],
                    w2_scale=None if w2_scale is None else w2_scale[0])), warmup_ms, rep_ms)
            except Exception as err:  # noqa: BLE001 - recorded; the tiles stay chosen
                tried.append({"gemm": "both", "error": str(err)[:120]})
        blocks = (dense_blocks(batch, cfg.block_m, ids) if dense
                  else assign_blocks(ids, cfg.block_m, experts, naive=naive, validate_ids=False))
        variants = [dataclasses.replace(cfg, pdl=pdl, quant_in_gemm=quant, gate_up=wide_up if quant else cfg.gate_up)
                    for pdl, quant in combos] if len(combos) > 1 or streams else []

        def experts_call_ms(c, c_blocks, what):   # one experts call on config c, or inf with the failure recorded
            try:
                return median_ms(graphed(lambda: run_experts(hidden, w1, w2, weights, ids, fmt=fmt, config=c,
                                                             w1_scale=w1_scale, w2_scale=w2_scale, blocks=c_blocks,
                                                             ids="trusted")), warmup_ms, rep_ms)
            except Exception as err:  # noqa: BLE001 - recorded; another config stays chosen
                tried.append({"gemm": "both", **what, "error": str(err)[:120]})
                return math.inf

        for both in variants + streams:
            switch_ms[both] = experts_call_ms(both, blocks, {"pdl": both.pdl, "quant_in_gemm": both.quant_in_gemm,
                                                             "stream_lag": both.stream_lag})
        if switch_ms and not dense:
            cfg = plainest_best(switch_ms, lambda c: not c.pdl and not c.quant_in_gemm and c.stream_lag is None)
        routed = (get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size, table_dtype,
                             device) if fused_shared and not refine else None)   # (the slot's tiles with no E+1 entry)
        if routed:
            routed_ms, tuned = {}, cfg
            for c in dict.fromkeys((cfg, routed)):   # each as one experts call; the faster is written (no margin here)
                c_blocks = None if runs_in_one_launch(c, fmt) else assign_blocks(ids, c.block_m, experts,
                                                                                  naive=naive, validate_ids=False)
                routed_ms[c] = experts_call_ms(c, c_blocks, {"routed_tiles": c == routed})
            if routed_ms[routed] < routed_ms[tuned]:   # (an entry no faster than the fallback would only cost)
                cfg = routed
        log(f"{key:<14} {fmt.name:<11} batch {batch:>6}: {total * 1e3:8.1f} us (gate_up {t_up * 1e3:.1f} + down "
            f"{'' if dense else 'and sum '}{t_down * 1e3:.1f}) block_m {cfg.block_m} gate_up {short(cfg.gate_up)} down {short(cfg.down)}"
            f"{' summed in GEMM 2' if cfg.sum_in_gemm else ''}"
            + "".join(f"; experts call{' with PDL' if c.pdl else ''}{' quantising in GEMM 1' if c.quant_in_gemm else ''}"
                      f"{f' as one stream ({c.gate_up.num_warps} warps)' if c.stream_lag is not None else ''}"
                      f" {ms * 1e3:.1f} us" for c, ms in (switch_ms or {}).items())
            + (f"; on the routed table's tiles {routed_ms[routed] * 1e3:.1f} us against {routed_ms[tuned] * 1e3:.1f}"
               f"{' (taken: the times before are the tuned pick’s)' if cfg is routed else ''}" if routed else ""))
        entries.append({"model": key, "format": weight_format, "E": experts,
                        "N": model.moe_intermediate_size, "K": model.hidden_size, "M": batch, "config": cfg.to_dict(),
                        "gemm_ms": {"gate_up": t_up, "down": t_down},
                        "experts_ms_by_switches": [{"pdl": c.pdl, "quant_in_gemm": c.quant_in_gemm,
                                                    "stream_lag": c.stream_lag, "gate_up_block_n": c.gate_up.block_n,
                                                    "gate_up_warps": c.gate_up.num_warps, "ms": ms}
                                                   for c, ms in (switch_ms or {}).items()],
                        "routed_tiles": routed and {"config": routed.to_dict(), "ms": routed_ms[routed],
                                                    "taken": cfg is routed, "tuned_config": tuned.to_dict(),
                                                    "tuned_ms": routed_ms[tuned]},
                        "tried": [t for t in tried if t.get("ms", 0) != math.inf]})
        del hidden, x, x_scale, weights, ids, inter, per_slot, summed, out, y, y_scale
    return entries


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

# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench tune", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, warmup_ms=10.0, rep_ms=50.0)
    add_record_arguments(parser, "fused-moe-tuning, or fused-moe-tuning-fp8-block with --format block; "
                                 "with --refine, fused-moe-tuning-refine[-fp8-block]")
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
    parser.add_argument("--shared", action="store_true",
                        help="tune the models' shared experts instead (one expert, every token, on the dense block "
                             "map the layer runs them on); with --write-tables, the E=1 tables")
    parser.add_argument("--fused-shared", action="store_true",
                        help="tune the routed experts with the shared expert fused as slot E (top-(k+1) over E+1 "
                             "experts; models with one shared expert); with --write-tables, the E+1 tables")
    dtype = torch.bfloat16
    args = parser.parse_args(argv)
    models = {m: MODELS[m] for m in args.models}
    if args.shared:
        if args.refine:
            parser.error("argument --shared: not with --refine (a shared expert's table comes from a full tune)")
        without = [m for m, model in models.items() if model.num_shared_experts < 1]
        if args.models == parser.get_default("models"):   # not asked for: the models that have one
            models = {m: model for m, model in models.items() if m not in without}
        elif without:
            parser.error(f"argument --models: with --shared, every model must have a shared expert; "
                         f"{', '.join(without)} has none")
        models = {f"{m}:shared": shared_expert_shape(model) for m, model in models.items()}
    if args.fused_shared:
        if args.shared:
            parser.error("argument --fused-shared: not with --shared")
        without = [m for m, model in models.items() if model.num_shared_experts != 1]
        if args.models == parser.get_default("models"):
            models = {m: model for m, model in models.items() if m not in without}
        elif without:
            parser.error(f"argument --models: with --fused-shared, every model must have one shared expert; "
                         f"{', '.join(without)} has not")
    args, config = start_run(parser, argv, dtype)
    if config is None:
        return 2
    if args.shared:   # the record names the shapes tuned, not the routed ones
        config.update(models={k: dataclasses.asdict(m) for k, m in models.items()},
                      routing="none: one expert that every token uses (a shared expert)")
    if args.fused_shared:
        config.update(routing="uniform top-k of the routed experts, then the shared expert (id E, weight 1) in "
                              "every token's last slot")
    started = time.perf_counter()
    entries = tune(models, args.batches, dtype=dtype, seed=args.seed,
                   warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, workers=args.workers, budget_s=args.budget_s,
                   log=log_line, refine=args.refine, weight_format=args.format, shared=args.shared,
                   fused_shared=args.fused_shared)
    data = {"config": config, "device": torch.cuda.get_device_name(), "entries": entries}
    # (a refine times a few variants of today's tables: its record must not replace a full tune's)
    name = args.name or ("fused-moe-tuning" + ("-shared" if args.shared else "")
                         + ("-fused-shared" if args.fused_shared else "") + ("-refine" if args.refine else "")
                         + ("" if args.format == "none" else f"-fp8-{args.format}"))
    if args.write_tables:
        from ..kernels.formats import FORMATS

        if not args.record:
            log_line("--write-tables without --record: the tables will name a record that this run does not write")
        where = f"{args.results_dir or 'results'}/{_device_dir()}/{name}.json"
        write_tables(entries, FORMATS[args.format].element or dtype, where, args.format, log_line, shared=args.shared,
                     fused_shared=args.fused_shared)
    data["wall_s"] = time.perf_counter() - started
    if args.record:
        write_record(name, data, args.results_dir, log_line)
    return 0


def _device_dir() -> str:
    from ..results import device_slug
    return device_slug(torch.cuda.get_device_name())


if __name__ == "__main__":
    sys.exit(main())
