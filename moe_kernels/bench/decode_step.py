"""One DeepSeek-V3 MoE layer of a decode step, timed stage by stage on the GPU.

The layer is traced first (:func:`moe_kernels.trace.trace_moe_layer`, checked against the
float64 reference), then each stage is timed on its own from CUDA-graph replays, reading the
previous stage's real outputs, and the whole layer chained. ``python -m moe_kernels.bench
decode-step --record`` writes ``results/<device>/decode-step.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from ..trace import (_check_layer_args, _fit_to_run, _for_kernels, _trace, make_layer, route,
                          shared_expert, trace_config)
from ..kernels.combine import moe_sum
from ..kernels.blocks import assign_blocks, use_naive_block_assignment
from ..kernels.config import separate_sum_tiles
from ..kernels.index_gather import expert_down, expert_gate_up
from ..model.shapes import MODELS, MoEModel
from .cli import add_record_arguments, positive_ints, write_record

def chained_router(layer, block_m: int, naive: bool) -> Callable | None:
    """The router as :class:`~moe_kernels.layer.MoELayer` runs it at decode for a checkpoint's gate (stored
    in the activations' dtype; the trace's gate is float32, cast here, and a float32 gate would make the
    layer take the two steps instead): :func:`~moe_kernels.kernels.chained_routing.gate_route_chained`,
    the gate, the routing and, unless the block map is naive, the alignment, in launches chained by PDL.
    It replaces the ``routing`` and ``alignment`` stages; None above the chain's ``MAX_TOKENS`` (the
    layer's ``CHAINED_ROUTER_MAX_TOKENS`` may stop earlier)."""
    from ..kernels.chained_routing import MAX_TOKENS, gate_route_chained
    from ..layer_spec import Routing

    hidden = layer.hidden_states
    if not 0 < hidden.shape[0] <= MAX_TOKENS:
        return None
    rule = Routing.of(layer.model)
    gate = layer.gate_weight.to(hidden.dtype)
    bias = layer.correction_bias
    grouped = rule.num_expert_group is not None or bias is not None
    return lambda: gate_route_chained(
        hidden, gate, rule.top_k, rule.renormalize, rule.scoring_func, block_size=None if naive else block_m,
        num_expert_group=rule.num_expert_group, topk_group=(rule.topk_group or 1) if grouped else None,
        routed_scaling_factor=rule.routed_scaling_factor, e_score_correction_bias=bias)


# Largest relative error against the float64 reference that :func:`measure` accepts before timing.
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}

# ----------------------------------------------------------------------------------------------
# Per-stage timing (GPU)
# ----------------------------------------------------------------------------------------------

STAGES = ("routing", "alignment", "gemm1", "gemm2", "sum", "shared expert")


def measure(model: MoEModel | str, num_tokens: int, *, dtype: torch.dtype, device, seed: int,
            timer: Callable[[Callable], float | None], hidden_size: int | None = None,
            intermediate_size: int | None = None) -> dict:
    """Trace one layer, then time each stage and the whole layer with ``timer(fn) -> µs``.

    The trace runs first, and an output off the float64 reference (beyond float32 1e-5, float16
    1e-3, bfloat16 2e-2 relative) raises before anything is timed.
    Each stage is timed on its own, reading the previous stage's real outputs and writing into
    preallocated buffers (``timer`` is :func:`moe_kernels.bench.timing.graph_us` on the GPU: a CUDA-graph
    replay, no launch overhead, no host synchronisation allowed). ``layer`` times the stages
    chained, from the hidden states to the output. ``router_chained_us``: :func:`chained_router`, what
    the layer runs instead of ``routing`` + ``alignment`` at decode.
    """
    model, _, _ = _check_layer_args("measure", model, num_tokens, hidden_size, intermediate_size, dtype, seed)
    layer = make_layer(model, num_tokens, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       dtype=dtype, device=device, seed=seed)
    trace = _trace(layer, None)
    if not trace.rel_error <= _TOLERANCE[dtype]:
        raise AssertionError(f"measure: the layer's output is off the float64 reference by {trace.rel_error:.1e} "
                             f"(relative), more than {_TOLERANCE[dtype]:.0e} for {trace.dtype}: not timing it")
    run = _for_kernels(layer)
    E, k = model.num_experts, model.top_k
    config = _fit_to_run(trace_config(model, num_tokens), run.hidden_states.shape[1], run.w2.shape[2])
    weights, ids = trace.topk_weights, trace.topk_ids
    blocks = assign_blocks(ids, config.block_m, E, naive=trace.naive, validate_ids=False)
    hidden = run.hidden_states
    intermediate = torch.empty(num_tokens * k, run.w2.shape[2], dtype=hidden.dtype, device=hidden.device)
    per_slot = torch.empty(num_tokens, k, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    routed = torch.empty_like(hidden)

    def whole_layer():
        w, i = route(run)
        b = assign_blocks(i, config.block_m, E, naive=trace.naive, validate_ids=False)
        expert_gate_up(hidden, run.w1, b, k, tiles=config.gate_up, out=intermediate)
        expert_down(intermediate, run.w2, w, b, tiles=separate_sum_tiles(config), out=per_slot)
        out = moe_sum(per_slot, out=routed)
        shared = shared_expert(run)
        return out if shared is None else out.add_(shared)

    stage_fns = {
        "routing": lambda: route(run),
        "alignment": lambda: assign_blocks(ids, config.block_m, E, naive=trace.naive, validate_ids=False),
        "gemm1": lambda: expert_gate_up(hidden, run.w1, blocks, k, tiles=config.gate_up, out=intermediate),
        "gemm2": lambda: expert_down(intermediate, run.w2, weights, blocks, tiles=separate_sum_tiles(config),
                                     out=per_slot),
        "sum": lambda: moe_sum(per_slot, out=routed),
    }
    if run.shared_w1 is not None:
        stage_fns["shared expert"] = lambda: shared_expert(run)
    stages_us = {name: timer(stage_fns[name]) for name in STAGES if name in stage_fns}
    chained = chained_router(run, config.block_m, trace.naive)
    return {"model": model.name, "num_tokens": num_tokens, "dtype": trace.dtype, "seed": seed,
            "config": config.to_dict(), "trace": trace.to_dict(), "stages_us": stages_us,
            "router_chained_us": None if chained is None else timer(chained), "layer_us": timer(whole_layer)}


STAGES_FP8 = ("routing", "alignment", "quantise", "gemm1", "requantise", "gemm2", "sum", "shared expert")


def measure_fp8(model: MoEModel | str, num_tokens: int, *, device, seed: int,
                timer: Callable[[Callable], float | None]) -> dict:
    """The same layer with DeepSeek-V3's real format: fp8 experts with 128x128 block scales,
    activations quantised per token per 128 channels before GEMM 1 and again before GEMM 2.

    The bf16 layer is traced first (same weights, same routing); its expert weights are then
    quantised, and the fp8 layer is checked against the quantised float64 reference before any
    stage is timed. The shared expert runs the same W8A8 GEMMs with one expert.
    """
    from ..kernels.config import get_config
    from ..kernels.index_gather import fused_experts
    from ..kernels.quant import per_token_group_quant_fp8, quantize_weight
    from ..reference import moe_reference_fp8

    model, _, _ = _check_layer_args("measure_fp8", model, num_tokens, None, None, torch.bfloat16, seed)
    layer = make_layer(model, num_tokens, dtype=torch.bfloat16, device=device, seed=seed)
    trace = _trace(layer, None)
    E, k, d, f = model.num_experts, model.top_k, model.hidden_size, model.moe_intermediate_size
    (w1, w1s), (w2, w2s) = quantize_weight(layer.w1, "block"), quantize_weight(layer.w2, "block")
    (s1, s1s), (s2, s2s) = quantize_weight(layer.shared_w1[None], "block"), quantize_weight(layer.shared_w2[None], "block")
    config = get_config(num_tokens, E, f, d, torch.float8_e4m3fn, device)   # fp8 tiles: K steps of 128
    weights, ids = trace.topk_weights, trace.topk_ids
    naive8 = use_naive_block_assignment(num_tokens, k, E, block_fp8=True)   # (the fp8 layer's block map)
    hidden = layer.hidden_states
    routed = fused_experts(hidden, w1, w2, weights, ids, config=config, validate_ids=False, w1_scale=w1s,
                           w2_scale=w2s)
    ref = moe_reference_fp8(hidden, w1, w2, weights, ids, w1_scale=w1s, w2_scale=w2s, granularity="block")
    rel_error = float(torch.linalg.norm(routed.double() - ref) / torch.linalg.norm(ref))
    if not rel_error <= _TOLERANCE[torch.bfloat16]:
        raise AssertionError(f"measure_fp8: the routed output is off the quantised reference by {rel_error:.1e}")
    blocks = assign_blocks(ids, config.block_m, E, naive=naive8, validate_ids=False)
    xq, xs = per_token_group_quant_fp8(hidden)
    inter = expert_gate_up(xq, w1, blocks, k, tiles=config.gate_up, a_scale=xs, w_scale=w1s)
    iq, is_ = per_token_group_quant_fp8(inter)
    per_slot = expert_down(iq, w2, weights, blocks, tiles=separate_sum_tiles(config), a_scale=is_, w_scale=w2s)
    everyone = torch.zeros(num_tokens, 1, dtype=torch.int32, device=hidden.device)
    ones = torch.ones(num_tokens, 1, device=hidden.device)
    stage_fns = {
        "routing": lambda: route(layer),
        "alignment": lambda: assign_blocks(ids, config.block_m, E, naive=naive8, validate_ids=False),
        "quantise": lambda: per_token_group_quant_fp8(hidden),
        "gemm1": lambda: expert_gate_up(xq, w1, blocks, k, tiles=config.gate_up, a_scale=xs, w_scale=w1s, out=inter),
        "requantise": lambda: per_token_group_quant_fp8(inter),
        "gemm2": lambda: expert_down(iq, w2, weights, blocks, tiles=separate_sum_tiles(config), a_scale=is_,
                                     w_scale=w2s, out=per_slot),
        "sum": lambda: moe_sum(per_slot),
        "shared expert": lambda: fused_experts(hidden, s1, s2, ones, everyone, validate_ids=False, w1_scale=s1s,
                                               w2_scale=s2s),
    }

    def whole_layer():
        w, i = route(layer)
        out = fused_experts(hidden, w1, w2, w, i, config=config, validate_ids=False, w1_scale=w1s, w2_scale=w2s)
        return out + stage_fns["shared expert"]()

    stages_us = {name: timer(stage_fns[name]) for name in STAGES_FP8}
    chained = chained_router(layer, config.block_m, trace.naive)
    fp8_bytes = trace.experts_touched * model.expert_params   # one byte per weight
    return {"model": model.name, "num_tokens": num_tokens, "dtype": "fp8 block (128x128 weights, 1x128 activations)",
            "seed": seed, "config": config.to_dict(), "experts_touched": trace.experts_touched,
            "routed_bytes_fp8": fp8_bytes, "routed_scale_bytes": trace.experts_touched * 4 * (w1s[0].numel() + w2s[0].numel()),
            "rel_error_vs_quantised_reference": rel_error, "stages_us": stages_us,
            "router_chained_us": None if chained is None else timer(chained), "layer_us": timer(whole_layer)}


def _print_run(run: dict, bandwidth: float | None) -> None:
    t = run["trace"]
    print(f"{run['model']}, {run['num_tokens']} tokens, {run['dtype']}: {t['experts_touched']} experts touched, "
          f"naive blocks {t['naive']}, BLOCK_M {t['block_m']}, num_tokens_post_padded {t['num_tokens_post_padded']}, "
          f"relative error {t['rel_error']:.1e}")
    for name, us in run["stages_us"].items():
        print(f"  {name:<14} {us:9.1f} us" if us is not None else f"  {name:<14}   (not capturable)")
    total = sum(v for v in run["stages_us"].values() if v is not None)
    print(f"  {'sum of stages':<14} {total:9.1f} us;  whole layer graphed {run['layer_us']:.1f} us")
    if run["router_chained_us"] is not None:
        print(f"  router chained {run['router_chained_us']:9.1f} us (gate, routing and alignment, instead of "
              "routing + alignment)")
    if bandwidth:
        floor = t["routed_bytes_bf16"] / bandwidth * 1e6
        print(f"  routed bf16 weights {t['routed_bytes_bf16'] / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s: "
              f"{floor:.1f} us floor for GEMM 1 + GEMM 2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench decode-step",
                                     description="One MoE decode layer at the real shape, traced and timed per stage.")
    parser.add_argument("--model", default="deepseek-v3", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=positive_ints, default=[64],
                        help="comma list of batch sizes (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    add_record_arguments(parser, "decode-step")
    parser.add_argument("--fp8", action="store_true", help="also the fp8 block-quantised layer (DeepSeek-V3's format)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels.bench.decode_step: needs a CUDA GPU (the trace itself runs anywhere: trace_moe_layer)",
              file=sys.stderr)
        return 2
    from .ceilings import measure_hbm_bandwidth, measure_read_bandwidth
    from .timing import graph_us

    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = measure_read_bandwidth()   # weight streaming only reads
    copy_bandwidth = measure_hbm_bandwidth()
    runs, runs_fp8 = [], []
    for num_tokens in args.tokens:
        run = measure(args.model, num_tokens, dtype=torch.bfloat16, device="cuda", seed=args.seed, timer=graph_us)
        _print_run(run, bandwidth)
        runs.append(run)
        torch.cuda.empty_cache()
        if args.fp8:
            run = measure_fp8(args.model, num_tokens, device="cuda", seed=args.seed, timer=graph_us)
            print(f"fp8: relative error vs the quantised reference {run['rel_error_vs_quantised_reference']:.1e}; "
                  + ", ".join(f"{n} {us:.1f}" for n, us in run["stages_us"].items())
                  + f"; router chained {run['router_chained_us'] or float('nan'):.1f}"
                  + f" us; layer {run['layer_us']:.1f} us; fp8 floor {run['routed_bytes_fp8'] / bandwidth * 1e6:.1f} us")
            runs_fp8.append(run)
            torch.cuda.empty_cache()
    if args.record:
        data = {"ceilings": {"read_bandwidth": bandwidth, "hbm_bandwidth": copy_bandwidth}, "runs": runs,
                "runs_fp8": runs_fp8}
        write_record(args.name or "decode-step", data, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
