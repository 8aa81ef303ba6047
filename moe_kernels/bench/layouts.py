"""Where the time goes in each grouped-GEMM layout: ``python -m moe_kernels.bench.layouts``.

For each model shape and batch, each layout is split into its stages and every stage is timed
on its own as a CUDA-graph replay (:func:`moe_kernels.bench.timing.graph_us`: GPU time, no launch
overhead, no host synchronisation allowed), together with the whole pipeline:

* index-gather: block map (alignment, or nothing on the small-batch path), GEMM 1 (+SiLU·mul),
  GEMM 2 (+routed weight) and the sum over top-k;
* permute: the copy into 128-row-aligned segments, GEMM 1, GEMM 2, the weighted gather back;
* masked, ``m_max`` = token budget: the dispatch into ``[E, m_max, d]``, GEMM 1, GEMM 2, the gather.

The permute and masked GEMMs are timed with two tile configurations (their module default, and a
narrower one for few rows per expert) and the faster is kept. The masked layout with a measured
cap needs a device-to-host read, so it cannot be graphed: it is timed eagerly, read included.
``--record`` writes ``results/<device>/layout-stages.json``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..model.shapes import MODELS
from .cli import add_record_arguments, positive_ints, write_record

BATCHES = (1, 8, 64, 512, 2048, 8192)


def _best(stage_fns: dict, configs: dict):
    """Time every stage for each config; keep the config with the smallest total."""
    from .timing import graph_us

    best = None
    for cfg_name, cfg in configs.items():
        stages = {name: graph_us(lambda fn=fn: fn(cfg)) for name, fn in stage_fns.items()}
        if any(v is None for v in stages.values()):
            continue
        total = sum(stages.values())
        if best is None or total < best[2]:
            best = (cfg_name, stages, total)
    return best


def measure(model_key: str, batch: int, seed: int = 0) -> list[dict]:
    from ..model.costs import count_work
    from .problems import make_batch, make_weights

    model = MODELS[model_key]
    dtype = torch.bfloat16
    w1, w2 = make_weights(model, dtype, seed)
    hidden, _, weights, ids = make_batch(model, batch, dtype, seed + batch)
    E, k, d, F = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    rows = []

    def row(layout, stages, total, config=None):
        rows.append({"model": model_key, "batch": batch, "layout": layout, "stages_us": stages,
                     "total_us": total, "config": config})
        print(f"{model_key:14s} B={batch:6d} {layout:28s} total {total:9.1f} us  "
              + "  ".join(f"{s} {v:.1f}" for s, v in stages.items()), flush=True)

    def index_gather():
        _index_gather(row, hidden, w1, w2, weights, ids, E, k, d, F, batch, dtype)

    def permuted():
        _permute(row, hidden, w1, w2, weights, ids, E)

    def masked_layouts():
        _masked(row, hidden, w1, w2, weights, ids, E, d, batch)

    for section in (index_gather, permuted, masked_layouts):
        try:
            section()
        except Exception as err:  # noqa: BLE001 - one layout failing must not lose the others
            print(f"{model_key} B={batch} {section.__name__}: {type(err).__name__}: {err}", flush=True)
        torch.cuda.empty_cache()
    work = count_work(model, ids, 2)
    for r in rows:
        r.update(bytes=work.bytes, flops=work.flops, experts_touched=work.experts_touched)
    return rows


def _index_gather(row, hidden, w1, w2, weights, ids, E, k, d, F, batch, dtype):
    from ..kernels import combine, index_gather
    from ..kernels.blocks import assign_blocks
    from ..kernels.config import get_config, separate_sum_tiles
    from .timing import graph_us

    cfg = get_config(batch, E, F, d, dtype, hidden.device)
    blocks = assign_blocks(ids, cfg.block_m, E, validate_ids=False)
    act = index_gather.expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up)
    down = index_gather.expert_down(act, w2, weights, blocks, tiles=separate_sum_tiles(cfg))
    stages = {
        "block map": graph_us(lambda: assign_blocks(ids, cfg.block_m, E, validate_ids=False)),
        "gemm1": graph_us(lambda: index_gather.expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up, out=act)),
        "gemm2": graph_us(lambda: index_gather.expert_down(act, w2, weights, blocks, tiles=separate_sum_tiles(cfg),
                                                           out=down)),
        "sum": graph_us(lambda: combine.moe_sum(down)),
    }
    total = graph_us(lambda: index_gather.fused_experts(hidden, w1, w2, weights, ids, config=cfg, validate_ids=False))
    row("index-gather", stages, total, cfg.to_dict())


def _tile_configs():
    from ..kernels.config import GemmTiles, MoEConfig

    narrow = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
    return {"default": None, "narrow": MoEConfig(64, narrow, narrow)}


def _permute(row, hidden, w1, w2, weights, ids, E):
    from ..kernels import combine, permute

    tile_configs = _tile_configs()
    perm = permute.permute(hidden, ids, E, align=128, validate_ids=False)
    act_p = permute.grouped_gemm_contiguous(perm.rows, w1, perm.m_indices, align=128, silu_mul=True)
    y_p = permute.grouped_gemm_contiguous(act_p, w2, perm.m_indices, align=128, which="down")
    best = _best({
        "permute copy": lambda c: permute.permute(hidden, ids, E, align=128, out=perm.rows, validate_ids=False),
        "gemm1": lambda c: permute.grouped_gemm_contiguous(perm.rows, w1, perm.m_indices, align=128, silu_mul=True,
                                                           out=act_p, config=c),
        "gemm2": lambda c: permute.grouped_gemm_contiguous(act_p, w2, perm.m_indices, align=128, out=y_p, config=c,
                                                           which="down"),
        "unpermute": lambda c: combine.unpermute(y_p, perm.src2dst, weights),
    }, tile_configs)
    if best:
        row("permute", best[1], best[2], best[0])


def _masked(row, hidden, w1, w2, weights, ids, E, d, batch):
    from ..kernels import combine, masked
    from ..model import buffers
    from .timing import eager_us

    tile_configs = _tile_configs()
    m_max = buffers.m_max_token_budget(batch)
    disp = masked.masked_dispatch(hidden, ids, E, m_max=m_max)
    act_m = masked.grouped_gemm_masked(disp.rows, w1, disp.masked_m, silu_mul=True)
    y_m = masked.grouped_gemm_masked(act_m, w2, disp.masked_m)
    best = _best({
        "dispatch": lambda c: masked.masked_dispatch(hidden, ids, E, m_max=m_max, out=disp.rows, validate_ids=False),
        "gemm1": lambda c: masked.grouped_gemm_masked(disp.rows, w1, disp.masked_m, silu_mul=True, out=act_m, config=c),
        "gemm2": lambda c: masked.grouped_gemm_masked(act_m, w2, disp.masked_m, out=y_m, config=c, which="down"),
        "gather": lambda c: combine.unpermute(y_m.view(E * m_max, d), disp.src2dst, weights),
    }, tile_configs)
    if best:
        row(f"masked (m_max={m_max})", best[1], best[2], best[0])
    del disp, act_m, y_m

    cap = buffers.m_max_measured_cap(ids, E)
    eager = eager_us(lambda: masked.masked_experts(hidden, w1, w2, weights, ids,
                                                   m_max=buffers.m_max_measured_cap(ids, E)))
    row(f"masked, measured cap (m_max={cap}), eager", {}, eager)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_ints, default=list(BATCHES), help="comma list of token counts")
    add_record_arguments(parser, "layout-stages")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench.layouts: needs a CUDA GPU", file=sys.stderr)
        return 2
    from .ceilings import measure_gemm_rate, measure_hbm_bandwidth

    ceilings = {"hbm_bandwidth": measure_hbm_bandwidth(), "gemm_rate_bf16": measure_gemm_rate()}
    print(f"ceilings: {ceilings['hbm_bandwidth'] / 1e12:.2f} TB/s, {ceilings['gemm_rate_bf16'] / 1e12:.0f} TFLOP/s")
    rows = []
    for key in ("deepseek-v3", "qwen3-30b-a3b"):
        for batch in args.batches:
            rows += measure(key, batch)
            torch.cuda.empty_cache()
    if args.record:
        write_record(args.name or "layout-stages", {"ceilings": ceilings, "rows": rows}, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
