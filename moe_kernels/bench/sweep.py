"""Timing harness for one routed-expert layer: a batch sweep over layouts against a floor.

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
``results/<device>/<name>.json``; ``--configs`` takes the configurations of a ``tune`` record, see
:mod:`moe_kernels.bench.tune`). It needs a CUDA GPU; the counting
(:func:`moe_kernels.model.costs.count_work`) runs anywhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ..model.costs import count_work, dense_work, read_seconds
from ..model.shapes import MODELS, MoEModel
from .cli import add_record_arguments, add_run_arguments, log_line, start_run, write_record
from .problems import make_batch, make_weights
from .timing import graphed, median_ms, rel_err


# ----------------------------------------------------------------------------------------------
# Problems and baselines
# ----------------------------------------------------------------------------------------------


#: Rows timed only up to this batch: the permute layout's 16-row segments on the transposed Gluon kernel
#: (decode: an expert's few tokens on wgmma's N side).
DECODE_ONLY, DECODE_ONLY_MAX_BATCH = ("permute gluon a16", ), 1024


def other_layouts() -> dict[str, Callable]:
    """The layouts of the sibling modules that import here, plus the per-expert loop (and, where the Gluon
    kernels run, the permute layout at decode on the transposed one)."""
    layouts = {}
    try:
        from ..kernels.gluon_block_fp8 import available
        from ..kernels.permute import permute_experts
        from .baselines import torch_grouped_mm_experts

        layouts["permute"] = permute_experts
        layouts["torch grouped_mm"] = torch_grouped_mm_experts
        if torch.cuda.is_available() and available("cuda") is None:
            layouts["permute gluon a16"] = functools.partial(permute_experts, align=16, gemm="gluon")
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
    """A ``tune`` output -> {(E, N, K): {M: MoEConfig}}."""
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
    from ..kernels.formats import UNQUANTIZED
    from ..kernels.index_gather import fused_experts, fused_moe
    from ..kernels.one_launch import runs_in_one_launch

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

            # (a table entry that runs both GEMMs in one launch needs no block map: none is passed then)
            one = runs_in_one_launch(cfg, UNQUANTIZED)

            def gemms():
                return fused_experts(hidden, w1, w2, weights, ids, config=cfg, blocks=None if one else blocks,
                                     validate_ids=False)

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
                if name in DECODE_ONLY and batch > DECODE_ONLY_MAX_BATCH:
                    continue
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
                       "naive_blocks": blocks.naive, "one_launch": one}
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
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench sweep", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, warmup_ms=10.0, rep_ms=50.0)
    add_record_arguments(parser, "fused-moe-sweep")
    parser.add_argument("--layouts", default=None, help="comma list of other layouts to time (default: all that import)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays of our layout")
    parser.add_argument("--configs", default=None, help="a tune output whose configs our layout uses")
    dtype = torch.bfloat16
    args, config = start_run(parser, argv, dtype)
    if config is None:
        return 2
    started = time.perf_counter()
    from .ceilings import measure_gemm_rate, measure_hbm_bandwidth, measure_read_bandwidth, measure_read_time_by_size

    ceilings = {"read_bandwidth": measure_read_bandwidth(), "hbm_bandwidth": measure_hbm_bandwidth(),
                "gemm_rate_bf16": measure_gemm_rate(), "read_by_size": measure_read_time_by_size()}
    log_line(f"ceilings: read {ceilings['read_bandwidth'] / 1e12:.2f} TB/s, "
             f"copy {ceilings['hbm_bandwidth'] / 1e12:.2f} TB/s, bf16 GEMM {ceilings['gemm_rate_bf16'] / 1e12:.0f} TFLOP/s")
    configs = load_configs(args.configs) if args.configs else None
    config["configs_file"] = args.configs
    layouts = args.layouts.split(",") if args.layouts else None
    name = args.name or "fused-moe-sweep"
    data = {"config": config, "ceilings": ceilings, "rows": [], "complete": False}
    for key in args.models:  # record after each model: a cut-short run keeps what it measured
        data["rows"] += sweep({key: MODELS[key]}, args.batches, dtype=dtype, seed=args.seed, warmup_ms=args.warmup_ms,
                              rep_ms=args.rep_ms, ceilings=ceilings, configs=configs, layouts=layouts,
                              graphs=not args.no_graphs, log=log_line)
        data["wall_s"] = time.perf_counter() - started
        if args.record:
            write_record(name, data, args.results_dir, log_line)
    data["complete"] = True
    data["wall_s"] = time.perf_counter() - started
    if args.record:
        write_record(name, data, args.results_dir, log_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
