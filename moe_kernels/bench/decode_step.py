"""One DeepSeek-V3 MoE layer of a decode step, timed stage by stage on the GPU.

The layer is traced first (:func:`moe_kernels.book.trace.trace_moe_layer`, checked against the
float64 reference), then each stage is timed on its own from CUDA-graph replays, reading the
previous stage's real outputs, and the whole layer chained. ``python -m moe_kernels.bench
decode-step --record`` writes ``results/<device>/decode-step.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from ..book.trace import (_check_layer_args, _fit_to_run, _for_kernels, _trace, make_layer, route,
                          shared_expert, trace_config)
from ..kernels.combine import moe_sum
from ..kernels.blocks import assign_blocks
from ..kernels.index_gather import expert_down, expert_gate_up
from ..model.shapes import MODELS, MoEModel

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
    chained, from the hidden states to the output.
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
        expert_down(intermediate, run.w2, w, b, tiles=config.down, out=per_slot)
        out = moe_sum(per_slot, out=routed)
        shared = shared_expert(run)
        return out if shared is None else out.add_(shared)

    stage_fns = {
        "routing": lambda: route(run),
        "alignment": lambda: assign_blocks(ids, config.block_m, E, naive=trace.naive, validate_ids=False),
        "gemm1": lambda: expert_gate_up(hidden, run.w1, blocks, k, tiles=config.gate_up, out=intermediate),
        "gemm2": lambda: expert_down(intermediate, run.w2, weights, blocks, tiles=config.down, out=per_slot),
        "sum": lambda: moe_sum(per_slot, out=routed),
    }
    if run.shared_w1 is not None:
        stage_fns["shared expert"] = lambda: shared_expert(run)
    stages_us = {name: timer(stage_fns[name]) for name in STAGES if name in stage_fns}
    return {"model": model.name, "num_tokens": num_tokens, "dtype": trace.dtype, "seed": seed,
            "config": config.to_dict(), "trace": trace.to_dict(), "stages_us": stages_us,
            "layer_us": timer(whole_layer)}


def _print_run(run: dict, bandwidth: float | None) -> None:
    t = run["trace"]
    print(f"{run['model']}, {run['num_tokens']} tokens, {run['dtype']}: {t['experts_touched']} experts touched, "
          f"naive blocks {t['naive']}, BLOCK_M {t['block_m']}, num_tokens_post_padded {t['num_tokens_post_padded']}, "
          f"relative error {t['rel_error']:.1e}")
    for name, us in run["stages_us"].items():
        print(f"  {name:<14} {us:9.1f} us" if us is not None else f"  {name:<14}   (not capturable)")
    total = sum(v for v in run["stages_us"].values() if v is not None)
    print(f"  {'sum of stages':<14} {total:9.1f} us;  whole layer graphed {run['layer_us']:.1f} us")
    if bandwidth:
        floor = t["routed_bytes_bf16"] / bandwidth * 1e6
        print(f"  routed bf16 weights {t['routed_bytes_bf16'] / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s: "
              f"{floor:.1f} us floor for GEMM 1 + GEMM 2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench decode-step",
                                     description="One MoE decode layer at the real shape, traced and timed per stage.")
    parser.add_argument("--model", default="deepseek-v3", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=[64],
                        help="comma list of batch sizes (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", action="store_true", help="write results/<device>/decode-step.json")
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
    runs = []
    for num_tokens in args.tokens:
        run = measure(args.model, num_tokens, dtype=torch.bfloat16, device="cuda", seed=args.seed, timer=graph_us)
        _print_run(run, bandwidth)
        runs.append(run)
        torch.cuda.empty_cache()
    if args.record:
        from ..results import record

        print("recorded", record("decode-step", {"ceilings": {"read_bandwidth": bandwidth, "hbm_bandwidth": copy_bandwidth},
                                               "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
