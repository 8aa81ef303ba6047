"""The layer as a caller sees it: host time per eager call, GPU time per call, what the id check
costs, and whether a layer runs as fast as its own GEMMs. ``python -m moe_kernels.bench layer``.

Three numbers per (model, weight format, batch) and per entry point:

* host: microseconds of Python and launches per eager call. The GPU is first given a long sleep
  kernel, so the calls that follow only queue behind it: what is timed is the host's work alone,
  whatever the GPU would have taken (``calls`` calls per round, the median of ``rounds``);
* GPU: microseconds per call replayed from a CUDA graph (no host work at all; the L2 is not
  flushed between the calls of one graph, so small batches read weights partly from L2);
* what the id check costs (``validate_ids=True`` over ``False``): host and GPU differences of
  interleaved pairs of rounds, the GPU's with the L2 flushed before each call and back to back
  without (:func:`id_check_cost`; ``--id-check-only`` times only these);
* the entry points: ``fused_experts`` with the id check (its default) and without, the experts
  step with trusted ids (what :class:`~moe_kernels.layer.MoELayer` runs: no check, no zero-fill),
  and ``MoELayer(x)``.

Last, the layer against its GEMMs: the fp8 (or bf16) layer at 4096 tokens against the same call
without its gate, routing and alignment (the quantisers, the routed and shared experts' GEMMs and
the top-k sum, with the same tuned tables), and against the routed experts alone, all replayed
from CUDA graphs with the L2 flushed (the tile table an fp8 layer takes once was the bf16 one,
4-6x slower).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .._runtime import tl  # noqa: F401 - the annotations of _gemm_arity name it
from .cli import DEFAULT_MODELS, add_record_arguments, model_names, positive_ints, write_record

DEFAULT_BATCHES = (1, 8, 64, 256, 1024, 4096, 16384)
#: GPU cycles of the sleep that holds the queue: 100 M cycles is 50-80 ms at the H200's clocks,
#: longer than ``calls`` eager calls take on the host.
SLEEP_CYCLES = 100_000_000


def host_us(fn, *, calls: int = 20, rounds: int = 7) -> tuple[float, float]:
    """Host microseconds per call of ``fn`` with the GPU busy (see the module docstring): the
    median and the least of ``rounds`` rounds. Whatever else the host does only ever adds time, and
    on the H200's host the rounds of one function differ up to 2x, so the least round is the
    better estimate of the call's own cost; the median is kept beside it."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    times.sort()
    return 1e6 * times[len(times) // 2], 1e6 * times[0]


def id_check_cost(checked, unchecked, *, pairs: int = 15, calls: int = 20, graph_calls: int = 20) -> dict:
    """What ``validate_ids=True`` costs, measured as a difference, not as two separate timings: the
    host's and the GPU's rounds of the checked and the unchecked call alternate (ABBA, so neither
    always goes first), and each pair gives one difference; the median of the differences is kept.
    Timed apart, each call's rounds spread by 10-20 us on the H200's host, more than the check costs.

    Host rounds queue ``calls`` calls behind a sleep of a tenth of :data:`SLEEP_CYCLES` (5-8 ms,
    longer than the calls take on the host). Two GPU differences:

    * ``gpu_us``: one call replayed from a CUDA graph with the L2 flushed before it (the median of
      ``do_bench``, as the sweeps and the A/B tools time): the weights come from HBM, as in a model
      whose layers each read their own;
    * ``gpu_back_to_back_us``: a graph of ``graph_calls`` calls replayed once, nothing flushed, so
      that each call after the first may find the same weights in L2 (Qwen3's 8 fp8 experts at one
      token are 38 MB, within the H200's L2).

    The unchecked call zero-fills its ``[T, k, d]`` buffer, which the checked one does not: that
    memset is why most rows come out negative.
    """
    from .timing import captured, median_ms

    torch.cuda.synchronize()
    host, gpu, back_to_back = [], [], []
    graphs = [captured(fn, graph_calls) for fn in (checked, unchecked)]
    # (one call per graph; None where it cannot be captured, e.g. no memory for a second graph at a large batch)
    singles = [captured(fn, 1) if graph is not None else None for fn, graph in zip((checked, unchecked), graphs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for pair in range(pairs):
        order = (0, 1) if pair % 2 == 0 else (1, 0)
        host_t, gpu_t, flushed_t = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
        for i in order:
            fn = (checked, unchecked)[i]
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host_t[i] = (time.perf_counter() - t0) / calls
            torch.cuda.synchronize()
        for i in order:
            if graphs[i] is None:
                continue
            start.record()
            graphs[i].replay()
            end.record()
            end.synchronize()
            gpu_t[i] = start.elapsed_time(end) * 1e-3 / graph_calls
        for i in order:
            if None not in singles:
                flushed_t[i] = median_ms(singles[i].replay, 1, 5) * 1e-3
        host.append(host_t[0] - host_t[1])
        back_to_back.append(None if None in graphs else gpu_t[0] - gpu_t[1])
        gpu.append(None if None in singles else flushed_t[0] - flushed_t[1])
    return {"id_check host_us": 1e6 * statistics.median(host),
            "id_check gpu_us": None if None in gpu else 1e6 * statistics.median(gpu),
            "id_check gpu_back_to_back_us": None if None in back_to_back else 1e6 * statistics.median(back_to_back),
            "id_check pairs": pairs}


def entry_points(layer, x):
    """``{name: call}`` for the layer's experts step through each entry point, on ``x``."""
    from ..kernels.config import choose_config
    from ..kernels.index_gather import fused_experts, run_experts
    from ..kernels.routing import router_logits

    w = layer.weights
    topk_weights, topk_ids = layer.routing.route(x, router_logits(x, w.gate), w.bias)
    scales = dict(w1_scale=w.w13_scale, w2_scale=w.w2_scale) if w.format.quantized else {}
    config = choose_config(x.shape[0], w.num_experts, w.w2.shape[2], w.w2.shape[1], w.format.element or x.dtype,
                           x.device).config
    return {
        "fused_experts": lambda: fused_experts(x, w.w13, w.w2, topk_weights, topk_ids, **scales),
        "fused_experts unchecked": lambda: fused_experts(x, w.w13, w.w2, topk_weights, topk_ids, validate_ids=False,
                                                         **scales),
        "experts trusted": lambda: run_experts(x, w.w13, w.w2, topk_weights, topk_ids, fmt=w.format, config=config,
                                               w1_scale=w.w13_scale, w2_scale=w.w2_scale, ids="trusted"),
        "MoELayer": lambda: layer(x),
    }


def layer_against_gemms(layer, x) -> dict:
    """The whole layer against its GEMMs: the same call minus the gate, the routing and the
    alignment (the routed experts on a precomputed block map, the shared expert if any, the
    quantisers and the top-k sum, with the layer's tuned tiles), and against the routed experts'
    step alone. Each is replayed from a CUDA graph with the L2 flushed."""
    from ..kernels.blocks import assign_blocks
    from ..kernels.index_gather import run_experts
    from ..kernels.routing import router_logits
    from ..layer_shared import runs_apart, shared_expert_output, with_shared_slot
    from .timing import graphed, median_ms

    w, fmt = layer.weights, layer.weights.format
    plan = layer.plan(x.shape[0], dtype=x.dtype)
    # A gated shared expert (Qwen2-MoE) is timed with its gate, computed here, outside the GEMMs.
    shared_gate = None if w.shared_gate is None else torch.sigmoid(router_logits(x, w.shared_gate))
    topk_weights, topk_ids = layer.routing.route(x, router_logits(x, w.gate), w.bias)
    if plan.shared_slot:   # a stacked shared expert as slot E this batch: the routed GEMMs take it in
        topk_weights, topk_ids = with_shared_slot(topk_weights, topk_ids, w, shared_gate)
    blocks = assign_blocks(topk_ids, plan.config.block_m, w.num_experts + plan.shared_slot, naive=plan.naive_blocks,
                           validate_ids=False)
    separate_shared = runs_apart(w, plan.shared_slot)

    def routed(activations=None, add=None):
        return run_experts(x, w.w13, w.w2, topk_weights, topk_ids, fmt=fmt, config=plan.config, blocks=blocks,
                           w1_scale=w.w13_scale, w2_scale=w.w2_scale, ids="trusted", activations=activations, add=add)

    def gemms():
        activations = fmt.quantize_activations(x) if fmt.quantized else None
        shared = shared_expert_output(plan, x, w, shared_gate, activations) if separate_shared else None
        return routed(activations, shared)

    rounds = [tuple(median_ms(graphed(fn), 10, 50) for fn in (lambda: layer(x), gemms, routed)) for _ in range(2)]
    # The lower of two rounds' medians (the H200's clock moves between rounds at large batches).
    layer_ms, gemms_ms, routed_ms = (min(r[i] for r in rounds) for i in range(3))
    return {"batch": x.shape[0], "layer_us": 1e3 * layer_ms, "gemms_us": 1e3 * gemms_ms,
            "routed_gemms_us": 1e3 * routed_ms, "layer_over_gemms": layer_ms / gemms_ms,
            "layer_over_routed_gemms": layer_ms / routed_ms,
            "shared_expert": "separate" if separate_shared else ("slot" if plan.shared_slot else None),
            "table": plan.choice.table, "entry": plan.choice.entry, "config": plan.config.to_dict()}


def _gemm_arity_kernel():
    """An empty kernel with the grouped GEMM's arity (module level: Triton reads ``tl`` from the
    kernel's globals)."""
    from .._runtime import kernel

    return kernel(_gemm_arity)


def _gemm_arity(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13,
                C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                C10: tl.constexpr, C11: tl.constexpr):
    pass


def host_floor() -> dict:
    """What a launch and an allocation cost this host, measured as :func:`host_us` measures a call:
    a compiled kernel of the grouped GEMM's arity (10 tensors, 14 integers, 12 constexprs) launched
    through its launcher directly (the least Python can do per launch), the same through
    ``kernel[grid](...)``, and one ``torch.empty``. An entry point's launches times the first is a
    floor on its host time that no Python above the launcher can lower."""
    gemm_arity = _gemm_arity_kernel()
    t = torch.empty(64, device="cuda")
    ints = [3 + 16 * i for i in range(14)]
    constexprs = {f"C{i}": i + 1 for i in range(12)}
    launch = lambda: gemm_arity[(1,)](*([t] * 10), *ints, **constexprs)   # noqa: E731
    compiled = launch()
    stream = torch.cuda.current_stream().cuda_stream
    args = [t] * 10 + ints + list(constexprs.values())
    raw = lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata,  # noqa: E731
                               None, None, None, *args)
    return {"raw_launch_us": host_us(raw, calls=200), "kernel_launch_us": host_us(launch, calls=200),
            "torch_empty_us": host_us(lambda: torch.empty(64, 2048, device="cuda"), calls=200)}


def launches_per_call(fn) -> int:
    """The package's own kernel launches in one call of ``fn`` (torch's are not counted)."""
    from .._runtime import record_launches

    with record_launches() as launches:
        fn()
    return len(launches)


def run(models, formats, batches, *, seed: int = 0, id_check_only: bool = False, id_check_pairs: int = 15,
        log=print) -> dict:
    from ..layer import MoELayer
    from ..model.shapes import MODELS
    from .timing import graph_us

    rows, against = [], []
    floor = host_floor()
    log("host floor (median, least of the rounds), us: "
        + ", ".join(f"{k} {v[0]:.1f} ({v[1]:.1f})" for k, v in floor.items()))
    for name in models:
        base = MoELayer.random(name, dtype=torch.bfloat16, device="cuda", seed=seed)
        for fmt in formats:
            layer = base if fmt == "none" else base.quantized(fmt)
            for batch in batches:
                x = torch.randn(batch, MODELS[name].hidden_size, device="cuda", dtype=torch.bfloat16,
                                generator=torch.Generator(device="cuda").manual_seed(seed + batch))
                calls = entry_points(layer, x)
                big = batch >= 4096
                row = {"model": name, "format": layer.weights.format.name, "batch": batch}
                row.update(id_check_cost(calls["fused_experts"], calls["fused_experts unchecked"],
                                         pairs=min(id_check_pairs, max(7, id_check_pairs // 2)) if big else id_check_pairs,
                                         graph_calls=2 if big else 20))
                gpu, back = (float("nan") if row[key] is None else row[key]
                             for key in ("id_check gpu_us", "id_check gpu_back_to_back_us"))
                check = (f"id check: host {row['id_check host_us']:+5.1f} us, gpu (L2 flushed) {gpu:+6.2f} us, "
                         f"back to back {back:+6.2f} us")
                if id_check_only:
                    rows.append(row)
                    log(f"{name:<14} {row['format']:<11} {batch:>6} {check}")
                    continue
                for what, fn in calls.items():
                    # 20 calls per round at every batch: a decode loop calls back to back, and a round of
                    # 5 (the large batches' once, to save GPU time) also times what a round's first call
                    # pays after the GPU's long sleep
                    row[f"{what} host_us"], row[f"{what} host_us_least"] = host_us(fn, calls=20,
                                                                                    rounds=5 if big else 9)
                    row[f"{what} launches"] = launches_per_call(fn)
                for what, fn in calls.items():   # two rounds, interleaved; the lower is kept
                    graph = [graph_us(fn, calls=2 if big else 20, replays=5 if big else 20) for _ in range(2)]
                    row[f"{what} gpu_us"] = min(graph) if None not in graph else None
                plan = layer.plan(batch, dtype=x.dtype)
                row.update(table=plan.choice.table, entry=plan.choice.entry, naive_blocks=plan.naive_blocks)
                rows.append(row)
                log(" ".join([f"{name:<14} {row['format']:<11} {batch:>6}"]
                             + [f"{what}: host {row[what + ' host_us']:6.1f} (least "
                                f"{row[what + ' host_us_least']:6.1f}) gpu {row[what + ' gpu_us'] or 0:8.1f}"
                                for what in calls] + [check]))
                if batch == 4096:
                    a = {"model": name, "format": row["format"], **layer_against_gemms(layer, x)}
                    against.append(a)
                    log(f"  layer {a['layer_us']:.1f} us against its GEMMs {a['gemms_us']:.1f} us "
                        f"({a['layer_over_gemms']:.3f}x; routed experts alone {a['routed_gemms_us']:.1f} us, "
                        f"{a['layer_over_routed_gemms']:.3f}x), table {plan.choice.table} at {plan.choice.entry}")
                del x, calls
            del layer
        del base
        torch.cuda.empty_cache()
    return {"host_floor": floor, "rows": rows, "layer_against_gemms": against}


def format_names(text: str) -> list[str]:
    """``--formats``: a comma list of keys of :data:`~moe_kernels.kernels.formats.FORMATS`."""
    from ..kernels.formats import FORMATS

    names = [f for f in text.split(",") if f]
    if not names or any(f not in FORMATS for f in names):
        raise argparse.ArgumentTypeError(f"must be a comma list of {sorted(FORMATS)}, got {text!r}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.bench layer", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=model_names, default=list(DEFAULT_MODELS), help="comma list of model names")
    parser.add_argument("--formats", type=format_names, default=["none", "block"],
                        help="comma list of weight formats (none, block, channel, tensor)")
    parser.add_argument("--batches", type=positive_ints, default=list(DEFAULT_BATCHES), help="comma list of token counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--id-check-only", action="store_true",
                        help="time only what validate_ids=True adds (interleaved pairs); records layer-id-check")
    parser.add_argument("--id-check-pairs", type=lambda text: positive_ints(text)[0], default=15,
                        help="interleaved pairs of rounds for the id check's cost (half that from 4096 tokens)")
    add_record_arguments(parser, "layer-cost")
    args = parser.parse_args(argv)
    models, formats, batches = args.models, args.formats, args.batches
    if not torch.cuda.is_available():
        print("moe_kernels.bench layer: needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    data = run(models, formats, batches, seed=args.seed, id_check_only=args.id_check_only,
               id_check_pairs=args.id_check_pairs)
    data.update(config={"models": models, "formats": formats, "batches": batches, "seed": args.seed,
                        "sleep_cycles": SLEEP_CYCLES, "id_check_only": args.id_check_only,
                        "id_check_pairs": args.id_check_pairs},
                wall_s=time.perf_counter() - started)
    if args.record:
        write_record(args.name or ("layer-id-check" if args.id_check_only else "layer-cost"), data, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
