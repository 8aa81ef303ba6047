"""Does the way the L2 is flushed change what a short call seems to cost? (issues 17 and 19)

Every sweep times a call as ``triton.testing.do_bench`` does: before each call it zeroes a 256 MB
buffer, so that the call finds none of its weights in the L2, then times the call between two CUDA
events. Zeroing *writes*: the L2 (write-back) is left full of dirty lines, up to its 50 MB, and the
timed call's first reads must write them back to HBM as they evict them. A call that reads 38 MB
(Qwen3-30B-A3B's eight experts in fp8) may then move almost twice its bytes. In a decode step the
L2 before an MoE layer holds what attention read (weights, the KV cache: clean lines), so the
zeroing flush charges the layer for traffic it would not have.

Each payload is timed five ways (index-gather's stages two), interleaved over two rounds (the lower of the
two medians):

* ``zero, do_bench``: ``do_bench`` itself (the sweeps' method): zero 256 MB, event, one replay of the
  call's CUDA graph, event; ``zero, events``: the same loop written out (``timing.flushed_median_ms``).
* ``read, events``: the same loop with a flush that zeroes the 256 MB and then reads another
  256 MB buffer, so the L2 is left holding clean lines.
* ``zero, in graph`` and ``read, in graph``: one CUDA graph of ``REPS`` x (flush, call) less one of
  ``REPS`` x flush, per call: no event and no graph launch per call, as a layer runs inside a
  decode step's graph.

Payloads: one tiny kernel (128 floats), the read kernel over 4 MB to 1.2 GB, both models' routed
experts in bf16 and fp8 block (index-gather on the GPU's tables, or the default tiles where it has none, as the
H100 had none when this first ran; both GEMMs, the activation and the sum) at 1-512 tokens with their read floors,
and the chained router (gate, routing, alignment).

    PYTHONPATH=. python tools/l2_flush_ab.py [record name, default l2-flush-ab]
    PYTHONPATH=. TRITON_INTERPRET=1 python tools/l2_flush_ab.py   # CPU: the calls run once, no timing
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

from moe_kernels.bench.ceilings import weight_reader
from moe_kernels.bench.timing import FLUSH_BYTES, captured, clean_flush, flushed_median_ms, graphed
from moe_kernels.results import record_tool

RECORD = sys.argv[1] if len(sys.argv) > 1 else "l2-flush-ab"
REPS = 8
READ_MB = tuple(int(m) for m in os.environ.get("FLUSH_AB_READ_MB", "4,16,38,75,150,300,1200").split(","))
BATCHES = tuple(int(b) for b in os.environ.get("FLUSH_AB_BATCHES", "1,8,64,512").split(","))
MODELS = tuple(os.environ.get("FLUSH_AB_MODELS", "qwen3-30b-a3b,deepseek-v3").split(","))
# Index-gather's stages alone too, by the two clean-flush methods (0: none), at these batches.
STAGE_BATCHES = tuple(int(b) for b in os.environ.get("FLUSH_AB_STAGE_BATCHES", "1,8,64,512").split(",") if b)
STAGE_METHODS = ("read, events", "read, in graph")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def flushes():
    """The two flushes: ``zero`` (do_bench's), and ``read`` (:func:`~moe_kernels.bench.timing.clean_flush`: the
    same zeroing, then a read of another buffer as large, which evicts the dirty lines before the timing starts)."""
    if not CUDA:   # (the interpreter: the flushes' plumbing on small buffers, nothing timed)
        cache, other = torch.empty(8192, dtype=torch.int32), torch.ones(8192)
        return {"zero": cache.zero_, "read": lambda: (cache.zero_(), other.sum())}
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
    return {"zero": cache.zero_, "read": clean_flush()}


def in_graph_ms(call, flush, replays=15) -> float:
    """Per call: a graph of ``REPS`` x (flush, call) less a graph of ``REPS`` x flush, each the median
    of ``replays`` replays."""
    def both():
        flush()
        return call()
    graphs = [captured(both, REPS), captured(flush, REPS)]
    if None in graphs:
        raise RuntimeError("the call could not be captured")
    times = [[], []]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        for i, graph in enumerate(graphs):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return (statistics.median(times[0]) - statistics.median(times[1])) / REPS


def time_methods(call, flush, only=None) -> dict:
    """Microseconds of ``call`` by each method (or those named in ``only``), the lower of two interleaved
    rounds."""
    from triton.testing import do_bench

    replay = graphed(call)
    methods = {"zero, do_bench": lambda: do_bench(replay, warmup=5, rep=40, return_mode="median"),
               "zero, events": lambda: flushed_median_ms(replay, flush["zero"], 5, 40),
               "read, events": lambda: flushed_median_ms(replay, flush["read"], 5, 40),
               "zero, in graph": lambda: in_graph_ms(call, flush["zero"]),
               "read, in graph": lambda: in_graph_ms(call, flush["read"])}
    methods = {name: method for name, method in methods.items() if only is None or name in only}
    rounds = {name: [] for name in methods}
    for r in range(2):
        for name in (methods if r == 0 else reversed(list(methods))):
            rounds[name].append(1e3 * methods[name]())
    return {name: round(min(times), 3) for name, times in rounds.items()}


def payloads():
    """``(name, bytes it must read or None, call, methods or None for all)`` for every payload, made lazily
    (a model's weights are freed before the next model's are made)."""
    from moe_kernels.bench.problems import index_gather_stages, make_batch, make_weights
    from moe_kernels.kernels.blocks import assign_blocks
    from moe_kernels.kernels.config import get_config
    from moe_kernels.kernels.formats import FORMATS
    from moe_kernels.kernels.index_gather import fused_experts
    from moe_kernels.kernels.quant import quantize_weight
    from moe_kernels.model.costs import count_work
    from moe_kernels.model.shapes import MODELS as SHAPES

    tiny_in, tiny_out = torch.zeros(128, device=DEVICE), torch.empty(128, device=DEVICE)
    yield "tiny kernel", None, lambda: torch.add(tiny_in, 1, out=tiny_out), None
    for mb in READ_MB if CUDA else (1,):
        buffer = torch.ones(mb * 1024**2 // 4 if CUDA else 8192, device=DEVICE)
        reader = weight_reader(buffer) if CUDA else (lambda: buffer.sum())
        yield f"read {mb} MB", buffer.numel() * 4, reader, None
        del buffer, reader
    for key in MODELS:
        model = SHAPES[key]
        if not CUDA:   # (the interpreter: a shape it finishes)
            model = dataclasses.replace(model, hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2)
        w1, w2 = make_weights(model, torch.bfloat16 if CUDA else torch.float32, 0, device=DEVICE)
        b1, b1s = quantize_weight(w1, "block") if CUDA else (None, None)
        b2, b2s = quantize_weight(w2, "block") if CUDA else (None, None)
        for batch in BATCHES if CUDA else (1,):
            hidden, _, weights, ids = make_batch(model, batch, w1.dtype, batch, device=DEVICE)
            for fmt in ("bf16", "fp8") if CUDA else ("bf16",):
                dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
                cfg = get_config(batch, model.num_experts, model.moe_intermediate_size, model.hidden_size,
                                 dtype if CUDA else torch.float32, hidden.device)
                blocks = assign_blocks(ids, cfg.block_m, model.num_experts, validate_ids=False)
                scales = {} if fmt == "bf16" else {"w1_scale": b1s, "w2_scale": b2s}
                a, b = (w1, w2) if fmt == "bf16" else (b1, b2)
                work = count_work(model, ids, 2 if fmt == "bf16" else 1)

                def call(a=a, b=b, cfg=cfg, blocks=blocks, scales=scales, hidden=hidden, weights=weights, ids=ids):
                    return fused_experts(hidden, a, b, weights, ids, config=cfg, blocks=blocks,
                                         validate_ids=False, **scales)
                yield f"{key} {fmt} GEMMs {batch}", work.bytes, call, None
                if batch in STAGE_BATCHES or not CUDA:
                    stages = index_gather_stages(hidden, a, b, scales.get("w1_scale"), scales.get("w2_scale"), weights,
                                                 ids, FORMATS["none" if fmt == "bf16" else "block"], cfg, blocks)
                    for stage, stage_call in stages.items():
                        yield f"{key} {fmt} {stage} {batch}", None, stage_call, STAGE_METHODS
            if batch <= 512 and CUDA:
                yield f"{key} router {batch}", None, router_call(key, batch), None
        del w1, w2, b1, b2
        if CUDA:
            torch.cuda.empty_cache()


def router_call(key: str, num_tokens: int):
    """The layer's chained router at ``num_tokens`` (gate, routing and alignment; PDL where it can)."""
    from moe_kernels.bench.routing import default_block_size
    from moe_kernels.kernels.chained_routing import gate_route_chained
    from moe_kernels.layer_spec import Routing
    from moe_kernels.model.shapes import MODELS as SHAPES

    model = SHAPES[key]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    d, e = model.hidden_size, model.num_experts
    gate = (torch.randn(e, d, device=DEVICE, generator=g) * d**-0.5).to(torch.bfloat16)
    x = torch.randn(num_tokens, d, device=DEVICE, generator=g).to(torch.bfloat16)
    bias = 0.01 * torch.randn(e, device=DEVICE, generator=g) if model.num_expert_groups > 1 else None
    rule = Routing.of(model)
    return lambda: gate_route_chained(x, gate, rule.top_k, rule.renormalize, rule.scoring_func,
                                      block_size=default_block_size(num_tokens),
                                      num_expert_group=rule.num_expert_group, topk_group=rule.topk_group,
                                      routed_scaling_factor=rule.routed_scaling_factor,
                                      e_score_correction_bias=bias)


def main() -> int:
    flush = flushes()
    rows, config = [], {"flush_bytes": FLUSH_BYTES, "reps_in_graph": REPS, "read_mb": READ_MB,
                        "batches": BATCHES, "models": MODELS}
    if CUDA:
        from moe_kernels.bench.ceilings import measure_read_bandwidth
        config["read_bandwidth"] = measure_read_bandwidth()
        print(f"read bandwidth {config['read_bandwidth'] / 1e12:.2f} TB/s", flush=True)
    for name, nbytes, call, only in payloads():
        call()
        if not CUDA:
            for f in flush.values():
                f()
            rows.append({"payload": name})
            continue
        us = time_methods(call, flush, only)
        row = {"payload": name, "us": us}
        if nbytes:
            row["bytes"] = nbytes
            row["floor_us"] = round(nbytes / config["read_bandwidth"] * 1e6, 3)
        rows.append(row)
        floor = f" floor {row['floor_us']:8.1f}" if nbytes else " " * 15
        print(f"{name:<34}{floor} " + " ".join(f"{k} {v:8.2f}" for k, v in us.items()), flush=True)
        record_tool(RECORD, rows, config)
    if not CUDA:
        print(f"{len(rows)} payloads ran once (no GPU: nothing timed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
