"""Skewed routing on an H200: what the contiguous and masked layouts allocate and how long they take.

``python -m moe_kernels.bench.skew [--record]`` draws routings with Zipf-skewed popularity
(:mod:`moe_kernels.model.skew`: exponents 0, 0.5, 1.0, 1.5; ``s = 0`` is uniform) at both model shapes,
bf16, batches 512 and 4096, and for each one:

* lays it out both ways, outside the timed region: the alignment for the index-gather layer
  (tile height from :func:`moe_kernels.kernels.config.get_config`), and the masked dispatch with
  ``m_max`` = the measured cap (:func:`moe_kernels.model.buffers.m_max_measured_cap`: the hottest
  expert's rows rounded up to 256);
* checks both layers' outputs against each other on every token, and against the float64
  direct reference on the first tokens;
* times, as CUDA-graph replays, the index-gather pair of GEMMs (block map precomputed), the whole
  index-gather layer (:func:`moe_kernels.kernels.index_gather.fused_experts`, ``validate_ids=False``), and
  the masked pair of GEMMs (:func:`moe_kernels.kernels.masked.grouped_gemm_masked` twice; two tile
  configurations, the faster kept);
* records the rows (real, contiguous padded, masked reserved), the hottest expert, the experts
  touched, each layout's intermediate buffer bytes, and the closed-form expectations beside the
  drawn values.

``--record`` writes ``results/<device>/skew.json``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..model.shapes import MODELS
from .cli import add_record_arguments, write_record

MODEL_KEYS = ("deepseek-v3", "qwen3-30b-a3b")
BATCHES = (512, 4096)
EXPONENTS = (0.0, 0.5, 1.0, 1.5)
#: the masked ``m_max`` is rounded up to this (SGLang's measured cap, DeepGEMM's block M)
MASKED_ROUND = 256
#: tokens checked against the float64 reference (each token's output depends on its own ids only)
REFERENCE_TOKENS = 32
TOLERANCE = 2e-2  # relative (Frobenius) error allowed in bf16


def _masked_tile_configs():
    from ..kernels.config import GemmTiles, MoEConfig, default_config

    narrow = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
    return {"128x128x64": default_config(0, 0, 0, 0, layout="masked"), "64x64x128": MoEConfig(64, narrow, narrow)}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def measure(model_key: str, batch: int, s: float, w1: torch.Tensor, w2: torch.Tensor, seed: int) -> dict:
    """One (model, batch, exponent) point: layouts, checks, times, counts."""
    from ..kernels import blocks, index_gather, masked
    from ..kernels.config import get_config, separate_sum_tiles
    from ..model import buffers, skew
    from ..reference import moe_reference
    from .timing import graph_us

    model = MODELS[model_key]
    E, k, d, F = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    dtype, device = torch.bfloat16, w1.device
    gen = torch.Generator(device=device).manual_seed(seed)
    inclusion = skew.inclusion_probabilities(skew.zipf_popularity(E, s), k)
    ids = skew.sample_topk_ids(batch, inclusion.to(device), k, generator=gen)
    hidden = torch.randn(batch, d, generator=gen, device=device, dtype=dtype)
    weights = torch.rand(batch, k, generator=gen, device=device).softmax(dim=-1)

    # Layouts, outside every timed region.
    cfg = get_config(batch, E, F, d, dtype, device)
    blocks = blocks.assign_blocks(ids, cfg.block_m, E, validate_ids=False)
    m_max = buffers.m_max_measured_cap(ids, E, block=MASKED_ROUND)
    dispatched = masked.masked_dispatch(hidden, ids, E, m_max=m_max)

    # Check before timing: the two layers against each other, and against float64 on a prefix.
    index_gather_out = index_gather.fused_experts(hidden, w1, w2, weights, ids, config=cfg, validate_ids=False)
    masked_out = masked.masked_experts(hidden, w1, w2, weights, ids, m_max=m_max)
    head = slice(0, min(batch, REFERENCE_TOKENS))
    reference = moe_reference(hidden[head], w1, w2, weights[head], ids[head])
    errors = {"index-gather vs masked": _relative_error(index_gather_out, masked_out),
              "index-gather vs float64": _relative_error(index_gather_out[head], reference),
              "masked vs float64": _relative_error(masked_out[head], reference)}
    bad = {name: err for name, err in errors.items() if not err <= TOLERANCE}
    if bad:
        raise AssertionError(f"{model_key} B={batch} s={s}: outputs disagree: {bad}")
    del index_gather_out, masked_out, reference
    torch.cuda.empty_cache()

    calls = 10 if batch <= 512 else 2
    act = index_gather.expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up)
    per_slot = index_gather.expert_down(act, w2, weights, blocks, tiles=separate_sum_tiles(cfg))

    def index_gather_gemms():
        index_gather.expert_gate_up(hidden, w1, blocks, k, tiles=cfg.gate_up, out=act)
        index_gather.expert_down(act, w2, weights, blocks, tiles=separate_sum_tiles(cfg), out=per_slot)

    times = {
        "index-gather GEMMs": graph_us(index_gather_gemms, calls=calls),
        "index-gather layer": graph_us(lambda: index_gather.fused_experts(
            hidden, w1, w2, weights, ids, config=cfg, validate_ids=False), calls=calls),
    }
    del act, per_slot
    masked_act = torch.empty(E, m_max, F, dtype=dtype, device=device)
    masked_y = torch.empty(E, m_max, d, dtype=dtype, device=device)
    best_masked = None
    for name, tiles in _masked_tile_configs().items():
        def masked_gemms(tiles=tiles):
            masked.grouped_gemm_masked(dispatched.rows, w1, dispatched.masked_m, silu_mul=True,
                                       out=masked_act, config=tiles)
            masked.grouped_gemm_masked(masked_act, w2, dispatched.masked_m, out=masked_y, config=tiles,
                                       which="down")

        t = graph_us(masked_gemms, calls=calls)
        if t is not None and (best_masked is None or t < best_masked[1]):
            best_masked = (name, t, tiles.block_m)
    times["masked GEMMs"] = best_masked[1] if best_masked else None
    del masked_act, masked_y, dispatched
    torch.cuda.empty_cache()

    drawn = skew.layout_rows(ids, E, cfg.block_m, MASKED_ROUND)
    masked_tiles = skew.layout_rows(ids, E, best_masked[2], MASKED_ROUND).contiguous if best_masked else None
    itemsize = dtype.itemsize
    row = {
        "model": model_key, "batch": batch, "s": s, "seed": seed,
        "top_inclusion": float(inclusion.max()),
        "block_m": cfg.block_m,
        "masked_tiles": best_masked[0] if best_masked else None,
        "real_rows": drawn.real,
        "experts_touched": drawn.touched,
        "hottest_rows": drawn.hottest,
        "contiguous_rows": int(blocks.num_tokens_post_padded[0]) if not blocks.naive else drawn.contiguous,
        "masked_m_max": m_max,
        "masked_rows": E * m_max,
        "masked_rows_computed": masked_tiles,
        "expected": {
            "experts_touched": skew.expected_experts_touched(batch, inclusion),
            "hottest_rows": skew.expected_hottest_rows(batch, inclusion),
            "contiguous_rows": skew.expected_contiguous_rows(batch, inclusion, cfg.block_m),
            "masked_rows": skew.expected_masked_rows(batch, inclusion, MASKED_ROUND),
        },
        # Intermediates only (weights are the same for both): index-gather keeps [Bk, F] after
        # GEMM 1 and [T, k, d] after GEMM 2; masked keeps [E, m_max, d] rows and [E, m_max, F].
        "buffer_bytes": {
            "index-gather": drawn.real * (d + F) * itemsize,
            "masked": buffers.masked_buffer_bytes(E, m_max, d, F, dtype),
        },
        "flops": drawn.real * model.expert_flops_per_token,
        "times_us": times,
        "errors": errors,
    }
    print(f"{model_key:14s} B={batch:5d} s={s:3.1f} touched {drawn.touched:3d} hottest {drawn.hottest:5d}  "
          f"rows: real {drawn.real:6d} contiguous {row['contiguous_rows']:6d} masked {E * m_max:7d}  "
          + "  ".join(f"{name} {t:8.1f} us" if t is not None else f"{name} n/a" for name, t in times.items()),
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench skew", description=__doc__.splitlines()[0])
    add_record_arguments(parser, "skew")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench.skew: needs a CUDA GPU (timings on the CPU interpreter mean nothing)",
              file=sys.stderr)
        return 2
    from .problems import make_weights

    rows = []
    for key in MODEL_KEYS:
        w1, w2 = make_weights(MODELS[key], torch.bfloat16, args.seed)
        for batch in BATCHES:
            for index, s in enumerate(EXPONENTS):
                rows.append(measure(key, batch, s, w1, w2, seed=args.seed + 10 * batch + index))
        del w1, w2
        torch.cuda.empty_cache()
    if args.record:
        config = {"batches": list(BATCHES), "exponents": list(EXPONENTS), "masked_round": MASKED_ROUND,
                  "dtype": "bfloat16", "timing": "CUDA-graph replay, median"}
        write_record(args.name or "skew", {"config": config, "rows": rows}, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
