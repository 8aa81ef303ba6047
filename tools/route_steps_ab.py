"""Issue 19: where DeepSeek-V3's router spends its time at decode, step by step, without changing a kernel.

The chained router (``chained_routing.gate_route_chained``: the split gate, one routing program per
token, PDL between them) took 7.4-7.7 us for DeepSeek-V3 at 1-16 tokens against 3.8-4.3 for
Qwen3-30B-A3B (``gate-routing.json`` at 22dc97c, before the group mask by ranks). Two things differ:
the gate (256 x 7168 against 128 x 2048, 7x the bytes) and the rule (sigmoid, a correction bias, 8
groups of which 4 are kept, top-8 of 256, against softmax top-8 of 128). Here the same chain runs on
shapes and rules that move one or two things at a time, so that the differences between rows split
the 3-4 us:

  qwen3 softmax            E=128, d=2048, softmax top-8 (the reference)
  e256 d2048 softmax       E=256 on Qwen3's hidden size: the wider routing program, and a gate of
                           twice Qwen3's bytes (256 x 2048)
  e256 d2048 grouped+bias  the real rule on a small gate: its steps with the gate of the row above
  e256 d7168 softmax       DeepSeek-V3's gate, the plain rule
  e256 d7168 sigmoid       sigmoid top-8, no groups, no bias
  e256 d7168 grouped       sigmoid, 8 groups, 4 kept, no bias
  e256 d7168 grouped+bias  DeepSeek-V3's rule (what the layer runs)
  ... no pdl / argmax topk the same without PDL, or with k rounds of argmax instead of the sort
  ... + align              with the alignment launch (block size 16)
  cublas gate d7168 / d2048  x @ W^T alone (torch): DeepSeek-V3's 256 x 7168 gate, Qwen3's 128 x 2048
  ... route N warps        the routing program on N warps (``chained_routing.ROUTE_WARPS``; by default
                           ``chained_routing.route_warps``: 1 for Qwen3's 128 experts, 2 for softmax
                           over 256, 4 for DeepSeek-V3's grouped rule)
  ... gate ~N programs     the gate's grid sized for about N programs (``gate_grid._TARGET_PROGRAMS``;
                           the default, since 1acf7da, aims at 132 and falls back to 264 where a
                           program would take more than 7 K steps): "~132 programs" without that
                           fall-back, "~264 programs" the grid before (``_MAX_K_STEPS`` None)

Each row is one CUDA graph of the call: "warm" replays a graph of 20 calls back to back (the gate
stays in L2, as in ``bench routing``), "flushed" replays a graph of one call with the L2 flushed
before each replay (triton's do_bench). Two rounds each, interleaved, the lower kept.

    PYTHONPATH=. python tools/route_steps_ab.py [tokens, default 1,8,64,256] [record name, default route-steps-ab]
"""
import sys

import torch

from moe_kernels.bench.timing import graph_us, graphed, median_ms
from moe_kernels.kernels import chained_routing, gate_grid
from moe_kernels.results import record_tool

device = "cuda" if torch.cuda.is_available() else "cpu"
token_counts = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 64, 256]
record_name = sys.argv[2] if len(sys.argv) > 2 else "route-steps-ab"
GROUPED = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
rows = []


def router(x, w, bias=None, **kwargs):
    rule = dict(kwargs)
    pdl = rule.pop("pdl", True)
    sorted_topk = rule.pop("sorted_topk", True)
    block = rule.pop("block_size", None)
    return lambda: chained_routing.gate_route_chained(x, w, 8, True, e_score_correction_bias=bias, pdl=pdl,
                                                      sorted_topk=sorted_topk, block_size=block, **rule)[1]


def with_setting(fn, module, name, value):
    """``fn`` run with ``module.name`` set to ``value`` (restored after): a launch reads these module
    constants when it is made, so a CUDA graph captured through this keeps the setting."""
    def run():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, old)
    return run


for tokens in token_counts:
    torch.manual_seed(tokens)
    gates = {(e, d): torch.randn(e, d, device=device, dtype=torch.bfloat16) * d**-0.5
             for e, d in ((128, 2048), (256, 2048), (256, 7168))}
    xs = {d: torch.randn(tokens, d, device=device, dtype=torch.bfloat16) for d in (2048, 7168)}
    bias = torch.randn(256, device=device, dtype=torch.float32) * 0.1
    q, s, b = (xs[2048], gates[128, 2048]), (xs[2048], gates[256, 2048]), (xs[7168], gates[256, 7168])
    candidates = {
        "qwen3 softmax": router(*q),
        "e256 d2048 softmax": router(*s),
        "e256 d2048 grouped+bias": router(*s, bias, **GROUPED),
        "e256 d7168 softmax": router(*b),
        "e256 d7168 sigmoid": router(*b, scoring_func="sigmoid"),
        "e256 d7168 grouped": router(*b, **GROUPED),
        "e256 d7168 grouped+bias": router(*b, bias, **GROUPED),
        "e256 d7168 grouped+bias no pdl": router(*b, bias, pdl=False, **GROUPED),
        "e256 d7168 grouped+bias argmax topk": router(*b, bias, sorted_topk=False, **GROUPED),
        "e256 d7168 grouped+bias + align": router(*b, bias, block_size=16, **GROUPED),
        "qwen3 softmax + align": router(*q, block_size=16),
        "e256 d7168 grouped+bias route 2 warps": with_setting(router(*b, bias, **GROUPED), chained_routing,
                                                              "ROUTE_WARPS", 2),
        "e256 d7168 grouped+bias route 8 warps": with_setting(router(*b, bias, **GROUPED), chained_routing,
                                                              "ROUTE_WARPS", 8),
        "e256 d7168 softmax route 2 warps": with_setting(router(*b), chained_routing, "ROUTE_WARPS", 2),
        "qwen3 softmax route 2 warps": with_setting(router(*q), chained_routing, "ROUTE_WARPS", 2),
        "e256 d7168 grouped+bias gate ~132 programs": with_setting(router(*b, bias, **GROUPED), gate_grid,
                                                                   "_MAX_K_STEPS", None),
        "qwen3 softmax gate ~132 programs": with_setting(router(*q), gate_grid, "_MAX_K_STEPS", None),
        "e256 d7168 grouped+bias gate ~264 programs": with_setting(with_setting(
            router(*b, bias, **GROUPED), gate_grid, "_TARGET_PROGRAMS", 264), gate_grid, "_MAX_K_STEPS", None),
        "qwen3 softmax gate ~264 programs": with_setting(with_setting(
            router(*q), gate_grid, "_TARGET_PROGRAMS", 264), gate_grid, "_MAX_K_STEPS", None),
        "cublas gate d7168": lambda: xs[7168] @ gates[256, 7168].t(),
        "cublas gate d2048": lambda: xs[2048] @ gates[128, 2048].t(),
    }
    outputs = {name: fn() for name, fn in candidates.items()}   # compile and check that each runs
    for name in candidates:   # a switch changes the launch, not the ids (random logits: no near-ties)
        if " warp" in name or " programs" in name:
            base = next(b for b in ("qwen3 softmax", "e256 d7168 softmax", "e256 d7168 grouped+bias")
                        if name.startswith(b + " "))
            if not torch.equal(outputs[name], outputs[base]):
                raise SystemExit(f"route_steps_ab: {name!r} routed {tokens} tokens differently from {base!r}")
    warm = {n: [] for n in candidates}
    cold = {n: [] for n in candidates}
    for _ in range(2):
        for name, fn in candidates.items():
            warm[name].append(graph_us(fn) if device == "cuda" else 1.0)
            cold[name].append(1e3 * median_ms(graphed(fn), 5, 30) if device == "cuda" else 1.0)
    row = {"tokens": tokens, "warm_us": {n: min(t) for n, t in warm.items()},
           "flushed_us": {n: min(t) for n, t in cold.items()}, "rounds": {"warm": warm, "flushed": cold}}
    rows.append(row)
    print(f"tokens {tokens}:", flush=True)
    for n in candidates:
        print(f"   {n:38s} warm {row['warm_us'][n]:6.2f} us  flushed {row['flushed_us'][n]:6.2f} us", flush=True)

path = record_tool(record_name, rows, {"tokens": token_counts, "grouped_rule": GROUPED, "top_k": 8,
                                           "renormalize": True, "dtype": "bfloat16"})
print(f"recorded {path}")
